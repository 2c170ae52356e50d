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

from mct.persistence.files import fsync_dir, write_failure

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}


def _header(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """(header bytes incl. the 8-byte length, {name: (start, end) in the data area})."""
    offsets, entries, pos = {}, {}, 0
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
    """``SafetensorsWriter(path, specs)`` reserves the temporary file; ``put(name, t)``
    writes one tensor; ``commit()`` renames it into place once every tensor is in;
    ``abort()`` removes it. Raises ValueError (one line) for any OS failure."""

    def __init__(self, path: str | os.PathLike, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
        self.path = Path(path)
        self.specs = specs
        head, self.offsets = _header(specs)
        self.base = len(head)
        self.nbytes = self.base + max((e for _, e in self.offsets.values()), default=0)
        self.tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        self._done: set[str] = set()
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
        data = t.detach().to("cpu").contiguous().reshape(-1)
        start, end = self.offsets[name]
        try:
            if end > start:
                self._pwrite(data.view(torch.uint8).numpy().data, self.base + start)
        except OSError as e:
            self.abort()
            raise write_failure(self.path, self.nbytes, e) from None
        self._done.add(name)

    def commit(self) -> None:
        """Every tensor written: fsync, rename over ``path``, fsync the directory."""
        missing = sorted(set(self.specs) - self._done)
        assert not missing, f"tensors never written: {missing[:3]}"
        try:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
            os.replace(self.tmp, self.path)
            fsync_dir(self.path.parent)
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
