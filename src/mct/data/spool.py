"""Where a text corpus's tokens go as its files are read: one unnamed file in mct's cache
directory, read back with ``pread`` (``DocumentSpans``), so a training process holds
neither its corpus nor, while loading, more than one file of it.

The file has no name (``tempfile.TemporaryFile``: ``O_TMPFILE`` on Linux), so it goes away
when the process ends, however it ends. Its pages live in the kernel's page cache, outside
the process's resident set, and go back to the disk under memory pressure. The folder is
mct's cache directory (``$MCT_CACHE_DIR``, else ``$XDG_CACHE_HOME/mct``, else
``~/.cache/mct``), a disk in practice, never a memory-backed /tmp. Where no file can be
created or written there (a read-only home, a full disk), the tokens stay in memory, as
they always did before.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from mct.data.dataset import DocumentSpans, pread_into
from mct.machine.cache import cache_file


def spool_dir() -> Path:
    """The folder of the spool file: mct's cache directory (see the module docstring)."""
    return cache_file().parent


class TokenSpool:
    """Byte tokens appended one document at a time (``add``), then read as ``DocumentSpans``
    (``spans``). ``on_disk``: whether they went to the unnamed file (else to memory)."""

    def __init__(self) -> None:
        self.size = 0
        self._memory = bytearray()
        self._file: Any = None
        try:
            folder = spool_dir()
            folder.mkdir(parents=True, exist_ok=True)
            self._file = tempfile.TemporaryFile(dir=folder, prefix="mct-corpus-", buffering=0)
        except OSError:
            self._file = None

    @property
    def on_disk(self) -> bool:
        return self._file is not None

    def add(self, data: bytes) -> None:
        """Append ``data``. A write that fails (the disk filled up) moves what the file holds
        into memory and goes on there; never raises for that."""
        if self._file is not None:
            try:
                view = memoryview(data)
                while view:
                    view = view[self._file.write(view):]
                self.size += len(data)
                return
            except OSError:
                self._to_memory()
        self._memory += data
        self.size += len(data)

    def _to_memory(self) -> None:
        """The bytes added so far (``size``: a failed write's part is not among them) read
        from the file into memory; the file closed."""
        self._memory = bytearray(self.size)
        pread_into(self._file, memoryview(self._memory), 0)
        self._file.close()
        self._file = None

    def read(self, start: int, n: int, out: np.ndarray | None = None) -> np.ndarray:
        """Bytes ``[start, start + n)`` as uint8 (into ``out[:n]`` when given)."""
        buf = np.empty(n, np.uint8) if out is None else out[:n]
        if self._file is not None:
            pread_into(self._file, memoryview(buf), start)
        else:
            buf[:] = np.frombuffer(self._memory, np.uint8, count=n, offset=start)
        return buf

    def spans(self, starts: np.ndarray, lengths: np.ndarray) -> DocumentSpans:
        """The documents at ``starts``/``lengths`` (bytes), read from the file with
        ``pread``, or from memory. Call after the last ``add``."""
        if self._file is None:
            return DocumentSpans(np.frombuffer(self._memory, np.uint8), starts, lengths)
        return DocumentSpans(np.memmap(self._file, dtype=np.uint8, mode="r"), starts, lengths, file=self._file)
