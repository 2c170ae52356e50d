"""What the process keeps resident on the host beyond live tensors: glibc malloc's
retained free memory, and the setting that returns it.

With glibc's defaults, a freed block above the mmap threshold (128 KiB at start) is
unmapped, but each such free *raises* the threshold to the block's size (up to 32 MiB
on 64-bit), so later blocks of that size come from the heap arenas, and freed heap
memory stays resident until the top of an arena is free. A training process that
builds and frees parameter-sized temporaries (initialization, gathers, gradient
buffers, optimizer chunks) then holds far more resident memory than it has live
tensors, and the amount differs from process to process with the order of frees.

``frugal`` pins the threshold (``mallopt(M_MMAP_THRESHOLD, 64 KiB)``, which also
turns off the dynamic raise): every block of 64 KiB and up is its own mapping and
goes back to the OS when freed; ``trim()`` (``malloc_trim(0)``) releases what the
arenas still hold, and runs after the engine is built and after each step. The
price is page faults on reused large blocks (measured in benchmarks/offload.py).
Same effect as ``MALLOC_MMAP_THRESHOLD_=65536`` in the environment, but applied from
inside the process, for any launcher. Not glibc (musl, macOS): a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

M_MMAP_THRESHOLD = -3
FRUGAL_THRESHOLD = 64 * 1024
HOST_MALLOC = ("auto", "default", "frugal")


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # glibc only
        return libc
    except (OSError, AttributeError):
        return None


def resolve(setting: str, *, offload: bool, device: str) -> str:
    """``memory.host_malloc`` -> 'default' or 'frugal'. 'auto' is 'frugal' when offload
    is on with the CPU as the compute device (host memory is the budget there) and when
    MALLOC_MMAP_THRESHOLD_ is not set by the user; 'default' otherwise."""
    if setting != "auto":
        return setting
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return "default"  # the user's own allocator setting wins
    return "frugal" if offload and device == "cpu" else "default"


_applied = False


def apply(mode: str) -> bool:
    """Set the process's malloc behaviour for ``mode`` ('frugal'; 'default' leaves it
    as it is). Process-wide and idempotent. Returns whether frugal mode is active."""
    global _applied
    if mode == "frugal" and not _applied:
        libc = _libc()
        if libc is not None and libc.mallopt(M_MMAP_THRESHOLD, FRUGAL_THRESHOLD) == 1:
            _applied = True
    return _applied


def trim() -> None:
    """Give free heap memory back to the OS (glibc ``malloc_trim(0)``); a no-op elsewhere."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
