"""A safetensors file written tensor by tensor (no collectives, no engine).

The header (every name, dtype, shape and byte range) is known before any data: the
file is reserved at its full size first (``posix_fallocate``, so a full disk fails
before a byte of data is written, naming the bytes needed), then each tensor's bytes
go to their own offset as they arrive, in any order. The result is byte-for-byte what
``safetensors.torch.save_file`` writes for the same fp32 tensors (names sorted, data in
name order); only one tensor needs to be in memory at a time.

Written to a temporary name beside the target (mode 0666 less the umask, as any new
file), fsynced, renamed over the target and the directory fsynced; any failure removes
the temporary and raises ValueError naming the path and the bytes needed.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from mct.outputs import replace_file
from mct.persistence.files import write_failure

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}


def _header(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
            metadata: dict[str, str] | None = None) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """(header bytes incl. the 8-byte length, {name: (start, end) in the data area})."""
    offsets, pos = {}, 0
    entries: dict = {"__metadata__": metadata} if metadata else {}
    dtypes = {dt for dt, _ in specs.values()}
    assert len(dtypes) <= 1, f"one dtype per file keeps save_file's order (name order): {dtypes}"
    for name in sorted(specs):
        dtype, shape = specs[name]
        n = math.prod(shape) * dtype.itemsize
        offsets[name] = (pos, pos + n)
        entries[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, offsets


class SafetensorsWriter:
    """``SafetensorsWriter(path, specs, metadata)`` reserves the temporary file;
    ``put(name, t)`` writes one tensor, ``put_part(name, start, t)`` a piece of one (a
    tensor need not be in memory whole); ``commit()`` renames it into place once every
    byte is in; ``abort()`` removes it. Raises ValueError (one line) for any OS failure."""

    def __init__(self, path: str | os.PathLike, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        self.specs = specs
        head, self.offsets = _header(specs, metadata)
        self.base = len(head)
        self.nbytes = self.base + max((e for _, e in self.offsets.values()), default=0)
        self.tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        self._written: dict[str, int] = dict.fromkeys(specs, 0)  # bytes of each tensor written
        self._fd = -1
        try:
            self._fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            if self.nbytes and hasattr(os, "posix_fallocate"):
                os.posix_fallocate(self._fd, 0, self.nbytes)
            self._pwrite(head, 0)
        except OSError as e:
            self.abort()
            raise write_failure(self.path, self.nbytes, e) from None

    def _pwrite(self, data: bytes | memoryview, pos: int) -> None:
        view, done = memoryview(data).cast("B"), 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], pos + done)

    def put(self, name: str, t: torch.Tensor) -> None:
        """Write tensor ``name`` (dtype and shape as declared; any device)."""
        dtype, shape = self.specs[name]
        assert t.dtype == dtype and tuple(t.shape) == tuple(shape), (name, t.dtype, tuple(t.shape), dtype, shape)
        self.put_part(name, 0, t)

    def put_part(self, name: str, start: int, t: torch.Tensor) -> None:
        """Write ``t`` (the declared dtype, any shape and device) as elements
        [start, start + t.numel()) of tensor ``name``'s flat data."""
        dtype = self.specs[name][0]
        assert t.dtype == dtype, (name, t.dtype, dtype)
        data = t.detach().to("cpu").contiguous().reshape(-1)
        lo, hi = self.offsets[name]
        pos = lo + start * dtype.itemsize
        assert pos + data.numel() * dtype.itemsize <= hi, (name, start, data.numel())
        try:
            if data.numel():
                self._pwrite(data.view(torch.uint8).numpy().data, self.base + pos)
        except OSError as e:
            self.abort()
            raise write_failure(self.path, self.nbytes, e) from None
        self._written[name] += data.numel() * dtype.itemsize

    def commit(self) -> None:
        """Every tensor written: fsync, rename over ``path``, fsync the directory."""
        missing = sorted(n for n, (lo, hi) in self.offsets.items() if self._written[n] != hi - lo)
        assert not missing, f"tensors not written whole: {missing[:3]}"
        try:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
            replace_file(self.tmp, self.path)  # never through a link or FIFO that appeared meanwhile
        except OSError as e:
            self.abort()
            raise write_failure(self.path, self.nbytes, e) from None

    def abort(self) -> None:
        """Close and remove the temporary (safe to call more than once)."""
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1
        try:
            self.tmp.unlink()
        except OSError:
            pass
