"""Where offloaded tensors live between uses: host memory or a file. Pure storage, no
streams, no threads: ``stream.py`` decides when reads and writes happen.

A store holds *records*: named 1-D tensors of a fixed numel and dtype (one unit's fp32
master shard, one optimizer state tensor, one gradient shard, one parameter shard).
Reads and writes address an element range ``[lo, hi)`` of a record and move it to or
from a host tensor the caller owns, so a record is never read whole unless asked.

- ``HostStore``: one host tensor per record, pinned when ``pin`` (CUDA runs, so copies
  to the device are asynchronous). ``host_view`` hands out a slice without a copy.
- ``DiskStore``: one file per store, records at 4 KiB-aligned offsets, read and written
  with ``os.preadv``/``os.pwritev`` into and out of the caller's buffer: nothing maps a
  whole file, and the only process memory used is the caller's buffers. The folder is
  private to the store (``tempfile.mkdtemp`` inside ``root``) and removed by ``close``
  (or when the store is garbage collected). A missing ``root`` is created, and removed
  again once the last store in it is closed.
- ``NullStore``: sizes only, for dry runs on fake tensors (the planner).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from mct.errors import not_a_directory

_ALIGN = 4096


@dataclass(frozen=True)
class Record:
    numel: int
    dtype: torch.dtype
    offset: int = 0
    """DiskStore: byte offset in the file."""

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def _bytes_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (any dtype, bf16
    included), valid while ``t`` lives. Not ``Tensor.numpy()``: that marks the storage
    not resizable, and offloaded masters free and regrow their storage."""
    assert t.device.type == "cpu" and t.is_contiguous(), (t.device, t.is_contiguous())
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else memoryview(b"")


class HostStore:
    """Records in host tensors. ``pin``: page-locked memory (CUDA runs only)."""

    tier = "cpu"

    def __init__(self, *, pin: bool = False) -> None:
        self.pin = pin
        self._tensors: dict[str, torch.Tensor] = {}
        self.records: dict[str, Record] = {}

    def allocate(self, key: str, numel: int, dtype: torch.dtype) -> None:
        """Create record ``key`` (uninitialized). Raises ValueError if it exists."""
        if key in self.records:
            raise ValueError(f"offload record {key!r} already exists")
        self._tensors[key] = torch.empty(numel, dtype=dtype, pin_memory=self.pin)
        self.records[key] = Record(numel, dtype)

    def host_view(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the record, without a copy (the caller may write them)."""
        return self._tensors[key][lo:hi]

    def read(self, key: str, lo: int, hi: int, out: torch.Tensor) -> None:
        out.copy_(self._tensors[key][lo:hi])

    def swap(self, a: str, b: str) -> None:
        """Exchange what records ``a`` and ``b`` hold (no data moves)."""
        self._tensors[a], self._tensors[b] = self._tensors[b], self._tensors[a]
        self.records[a], self.records[b] = self.records[b], self.records[a]

    def release(self, key: str) -> None:
        """Forget record ``key`` and free its memory."""
        self._tensors.pop(key, None)
        self.records.pop(key, None)

    def write(self, key: str, lo: int, src: torch.Tensor) -> None:
        self._tensors[key][lo:lo + src.numel()].copy_(src)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.records.values())

    def close(self) -> None:
        self._tensors.clear()


class DiskStore:
    """Records in one file under a private folder in ``root`` ('' = system temp dir).
    Raises ValueError when ``root`` cannot hold a folder (not creatable, not writable)."""

    tier = "disk"

    def __init__(self, root: str = "", *, name: str = "state") -> None:
        """``name`` ends the folder's and names the file's name (e.g. 'rank0'). A missing
        ``root`` is created (and removed again by the last store that leaves it empty)."""
        created = _make_root(root) if root else False
        try:
            self.dir = tempfile.mkdtemp(prefix="mct-offload-", suffix=f"-{name}", dir=root or None)
        except OSError as e:
            raise ValueError(f"offload.dir = {root!r}: cannot create a folder there ({e.strerror or e}); "
                             f"choose a writable directory") from None
        self.path = os.path.join(self.dir, "state.bin")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self._size = 0
        self.records: dict[str, Record] = {}
        self._spare: dict[str, Record] = {}  # released records: their file ranges, reused by key
        # The folder goes with the store even if close() is never called.
        self._finalizer = weakref.finalize(self, _remove, self._fd, self.dir, root if created else "")

    def allocate(self, key: str, numel: int, dtype: torch.dtype) -> None:
        """Reserve record ``key`` at the end of the file (sparse until written)."""
        if key in self.records:
            raise ValueError(f"offload record {key!r} already exists")
        spare = self._spare.pop(key, None)
        if spare is not None and spare.nbytes >= numel * dtype.itemsize:  # its old range fits: no growth
            self.records[key] = Record(numel, dtype, spare.offset)
            return
        rec = Record(numel, dtype, self._size)
        self.records[key] = rec
        self._size += -(-rec.nbytes // _ALIGN) * _ALIGN
        os.ftruncate(self._fd, self._size)

    def host_view(self, key: str, lo: int, hi: int) -> None:
        return None  # nothing is addressable without a read

    def swap(self, a: str, b: str) -> None:
        """Exchange what records ``a`` and ``b`` hold (their file ranges; no data moves)."""
        self.records[a], self.records[b] = self.records[b], self.records[a]

    def release(self, key: str) -> None:
        """Forget record ``key``; its file range is kept for the next record of that key
        (the file never shrinks, so a repeated load does not grow it either)."""
        rec = self.records.pop(key, None)
        if rec is not None:
            self._spare[key] = rec

    def read(self, key: str, lo: int, hi: int, out: torch.Tensor) -> None:
        """Fill the CPU tensor ``out`` ([hi - lo] of the record's dtype) from the file.
        Raises OSError on a short read (a truncated or damaged file)."""
        rec = self.records[key]
        assert out.dtype == rec.dtype and out.numel() == hi - lo and 0 <= lo <= hi <= rec.numel
        view, pos, done = _bytes_view(out), rec.offset + lo * rec.dtype.itemsize, 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], pos + done)
            if n <= 0:
                raise OSError(f"offload file {self.path}: short read of record {key!r} "
                              f"({done} of {len(view)} bytes)")
            done += n

    def write(self, key: str, lo: int, src: torch.Tensor) -> None:
        """Write the CPU tensor ``src`` to elements [lo, lo + src.numel()) of the record."""
        rec = self.records[key]
        assert src.dtype == rec.dtype and 0 <= lo and lo + src.numel() <= rec.numel
        src = src.contiguous()
        view, pos, done = _bytes_view(src), rec.offset + lo * rec.dtype.itemsize, 0
        while done < len(view):
            done += os.pwritev(self._fd, [view[done:]], pos + done)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.records.values())

    def close(self) -> None:
        self._finalizer()


class NullStore:
    """Records with sizes only, no data: the planner runs the engine on fake tensors,
    where offload must allocate what it allocates on the device and move nothing."""

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self.records: dict[str, Record] = {}

    def allocate(self, key: str, numel: int, dtype: torch.dtype) -> None:
        if key in self.records:
            raise ValueError(f"offload record {key!r} already exists")
        self.records[key] = Record(numel, dtype)

    def host_view(self, key: str, lo: int, hi: int) -> None:
        return None

    def swap(self, a: str, b: str) -> None:
        self.records[a], self.records[b] = self.records[b], self.records[a]

    def release(self, key: str) -> None:
        self.records.pop(key, None)

    def read(self, key: str, lo: int, hi: int, out: torch.Tensor) -> None:
        pass

    def write(self, key: str, lo: int, src: torch.Tensor) -> None:
        pass

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.records.values())

    def close(self) -> None:
        pass


_CREATED = ".mct-created"
"""Marks an offload.dir that mct created: the last store to leave it empty removes it."""


def _make_root(root: str) -> bool:
    """Create the missing ``root`` (with parents) and mark it as mct's; the marker lists
    the folders created, deepest first. Returns whether mct made ``root`` (this call or
    another rank's store); raises ValueError naming the path when it cannot."""
    if os.path.isdir(root):
        return os.path.exists(os.path.join(root, _CREATED))
    why = not_a_directory(root)
    if why:
        raise ValueError(f"offload.dir = {root!r} is {why}; name a directory (mct creates a missing one), or "
                         f"leave it '' for the system temporary directory")
    path = os.path.abspath(root)
    missing = []
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    try:
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(root, _CREATED), "w") as f:
            f.write("".join(m + "\n" for m in missing))
    except OSError as e:
        raise ValueError(f"offload.dir = {root!r} does not exist and cannot be created ({e.strerror or e}); "
                         f"create it, or leave it '' for the system temporary directory") from None
    return True


def _remove(fd: int, folder: str, created_root: str = "") -> None:
    try:
        os.close(fd)
    except OSError:
        pass
    shutil.rmtree(folder, ignore_errors=True)
    if created_root:  # mct made offload.dir: remove it once no rank's folder is left in it
        marker = os.path.join(created_root, _CREATED)
        try:
            if set(os.listdir(created_root)) <= {_CREATED}:
                with open(marker) as f:
                    made = f.read().split("\n")
                os.unlink(marker)
                for d in [m for m in made if m]:  # deepest first; stops at one that holds something
                    os.rmdir(d)
        except OSError:
            pass  # another rank's store still uses it, removed it first, or a parent is not empty


def make_store(tier: str, *, root: str, device: torch.device, name: str,
               fake: bool = False) -> HostStore | DiskStore | NullStore:
    """The store of one tier ('cpu' or 'disk') for a run on ``device``; ``fake``: a
    dry run on fake tensors (a NullStore of that tier)."""
    if tier not in ("cpu", "disk"):
        raise ValueError(f"offload tier must be 'cpu' or 'disk', got {tier!r}")
    if fake:
        return NullStore(tier)
    if tier == "cpu":
        return HostStore(pin=device.type == "cuda")
    return DiskStore(root, name=name)


Store = HostStore | DiskStore | NullStore


class UnitState:
    """Which optimizer state a unit has: names of elementwise tensors (with dtype) and
    the per-tensor scalars (e.g. Adam's step), resident."""

    def __init__(self, elementwise: dict[str, torch.dtype], scalars: dict[str, Any]) -> None:
        self.elementwise, self.scalars = elementwise, scalars


def put_record(store: Store, key: str, t: torch.Tensor, chunk: int = 1 << 22, offset: int = 0) -> None:
    """Synchronously write a whole tensor (any device) into a record from element
    ``offset`` on, a chunk at a time."""
    flat = t.detach().reshape(-1)
    for a in range(0, flat.numel(), chunk):
        store.write(key, offset + a, flat[a:a + chunk].to("cpu"))
