"""What the process keeps resident on the host beyond live tensors: glibc malloc's
retained free memory, and the setting that returns it.

With glibc's defaults, a freed block above the mmap threshold (128 KiB at start) is
unmapped, but each such free *raises* the threshold to the block's size (up to 32 MiB
on 64-bit), so later blocks of that size come from the heap arenas, and freed heap
memory stays resident until the top of an arena is free. A training process that
builds and frees parameter-sized temporaries (initialization, gathers, gradient
buffers, optimizer chunks) then holds far more resident memory than it has live
tensors, and the amount differs from process to process with the order of frees.

Modes (``memory.host_malloc``):
  lean    while the model and engine are built, ``mallopt(M_MMAP_THRESHOLD, 64 KiB)``
          (every block of 64 KiB and up is its own mapping, returned when freed; the
          dynamic raise is off); for training, 32 MiB (glibc's own ceiling for the
          dynamic threshold: unit-sized flat buffers are mapped, smaller blocks are
          reused from the heap without page faults); ``malloc_trim(0)`` after
          construction and after every step gives free heap pages back.
  frugal  64 KiB throughout, and the same trims: the least resident memory, the most
          page faults (every large temporary is a fresh mapping).
  default glibc as it is.
Same effect as ``MALLOC_MMAP_THRESHOLD_`` in the environment, but applied from inside
the process, for any launcher. Not glibc (musl, macOS): a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from typing import Any

M_MMAP_THRESHOLD = -3
BUILD_THRESHOLD = 64 * 1024
TRAIN_THRESHOLD = {"lean": 32 * 2**20, "frugal": 64 * 1024}
HOST_MALLOC = ("auto", "default", "lean", "frugal")


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # glibc only
        return libc
    except (OSError, AttributeError):
        return None


def resolve(setting: str, *, offload: bool, device: str) -> str:
    """``memory.host_malloc`` -> 'default', 'lean' or 'frugal'. 'auto' is 'lean' when
    offload is on with the CPU as the compute device (host memory is the budget there)
    and MALLOC_MMAP_THRESHOLD_ is not set by the user; 'default' otherwise."""
    if setting != "auto":
        return setting
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return "default"  # the user's own allocator setting wins
    return "lean" if offload and device == "cpu" else "default"


def mode_of(cfg: Any, device: str) -> str:
    """The resolved mode of an ``EngineConfig`` for a compute device type."""
    return resolve(cfg.memory.host_malloc, offload=cfg.offload.enabled, device=device)


def _mmap_threshold(nbytes: int) -> bool:
    libc = _libc()
    return libc is not None and libc.mallopt(M_MMAP_THRESHOLD, nbytes) == 1


def for_building(mode: str) -> bool:
    """Set malloc up for construction under ``mode`` (process-wide). Returns whether the
    engine should trim and switch to ``for_training`` afterwards (a glibc mode other
    than 'default')."""
    return mode in TRAIN_THRESHOLD and _mmap_threshold(BUILD_THRESHOLD)


def for_training(mode: str) -> None:
    """After construction: the training threshold of ``mode``, then give free heap back."""
    if mode in TRAIN_THRESHOLD:
        _mmap_threshold(TRAIN_THRESHOLD[mode])
        trim()


def trim() -> None:
    """Give free heap memory back to the OS (glibc ``malloc_trim(0)``); a no-op elsewhere."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
