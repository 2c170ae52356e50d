"""Files for offloaded checkpoint inputs: one file per parked tensor, in a private folder.

The folder (``tempfile.mkdtemp`` inside ``root``, '' = the system temporary directory) is
made at the first write, so a run that never parks anything (a dry run on fake tensors)
creates nothing. A missing ``root`` is created, and removed again by ``close`` once empty.
``close`` (also when the store is garbage collected or the interpreter exits) removes the
folder and every file left in it. Reads and writes move a contiguous tensor's bytes
(``write``/``read_into``): no pickling, so a read gives back exactly the bytes written.
Every ``OSError`` becomes one ``ValueError`` naming the path, the direction and the fix.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import weakref

import torch

from mct.errors import READ, WRITE, describe, not_a_directory


class ActivationStore:
    """Raw tensor bytes in files under a private folder of ``root``. Thread-safe: the
    folder is made once under a lock; each file is touched by one call at a time."""

    def __init__(self, root: str = "", *, name: str = "act") -> None:
        self.root, self.name = root, name
        self.dir: str | None = None
        self._made_root = ""
        self._seq = 0
        self._lock = threading.Lock()
        self._finalizer: weakref.finalize | None = None

    def new_path(self) -> str:
        """A fresh file path in the folder (the folder is made on the first call).
        Raises ValueError when ``root`` cannot hold a folder."""
        with self._lock:
            if self.dir is None:
                self._open()
            self._seq += 1
            return os.path.join(self.dir, f"{self._seq}.bin")  # type: ignore[arg-type]

    def _open(self) -> None:
        root = self.root
        if root and not_a_directory(root):
            raise ValueError(f"checkpointing.offload = 'disk': offload.dir = {root!r} is {not_a_directory(root)}; "
                             f"name a directory (mct creates a missing one)")
        try:
            if root and not os.path.isdir(root):
                try:
                    os.makedirs(root)
                    self._made_root = root
                except FileExistsError:  # another rank sharing offload.dir made it first
                    if not os.path.isdir(root):
                        raise
            self.dir = tempfile.mkdtemp(prefix="mct-act-", suffix=f"-{self.name}", dir=root or None)
        except OSError as e:
            raise ValueError(f"checkpointing.offload = 'disk': {describe(e, e.filename or root or None, WRITE)}; "
                             f"set offload.dir to a writable directory") from None
        self._finalizer = weakref.finalize(self, _remove, self.dir, self._made_root)

    @staticmethod
    def write(path: str, t: torch.Tensor) -> None:
        """Write the bytes of the contiguous CPU tensor ``t`` to ``path``. Raises ValueError."""
        try:
            with open(path, "wb") as f:
                f.write(memoryview(_bytes_of(t)))
        except OSError as e:
            _unlink(path)
            raise ValueError(f"checkpointing.offload = 'disk': {describe(e, path, WRITE)}; "
                             f"set offload.dir to a directory with room for the checkpointed inputs") from None

    @staticmethod
    def read_into(path: str, out: torch.Tensor) -> None:
        """Fill the contiguous CPU tensor ``out`` from ``path``, then remove the file.
        Raises ValueError when the file is missing or short."""
        try:
            with open(path, "rb") as f:
                got = f.readinto(memoryview(_bytes_of(out)))
        except OSError as e:
            raise ValueError(f"checkpointing.offload = 'disk': {describe(e, path, READ)}") from None
        _unlink(path)
        if got != out.numel() * out.element_size():
            raise ValueError(f"checkpointing.offload = 'disk': {path!r} holds {got} bytes, expected "
                             f"{out.numel() * out.element_size()} (was it changed by another process?)")

    @staticmethod
    def discard(path: str) -> None:
        """Remove ``path`` if it exists. Never raises."""
        _unlink(path)

    def close(self) -> None:
        """Remove the folder, the files left in it and a ``root`` this store created."""
        if self._finalizer is not None:
            self._finalizer()
        self.dir = None


def _bytes_of(t: torch.Tensor):
    """The numpy uint8 view of a contiguous CPU tensor's bytes (any dtype, bf16 too)."""
    assert t.is_contiguous() and t.device.type == "cpu", (t.shape, t.device)
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _remove(folder: str, made_root: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    if made_root:
        try:
            os.rmdir(made_root)  # only when empty: another run may use it too
        except OSError:
            pass
