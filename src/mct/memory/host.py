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
  cache   for training, every block under 1 GiB comes from the heap
          (``M_MMAP_THRESHOLD`` 1 GiB) and freed heap memory is never given back
          (``M_TRIM_THRESHOLD`` at its maximum): after the first steps a step's
          temporaries reuse pages already mapped, so it takes no page faults (0.67-0.93x
          the step time of ``default`` on the CPU measured, ``benchmarks/host_malloc.py``
          and docs/performance.md), and the process stays at its heap's high-water mark,
          which fragmentation put 2-50% above ``default``'s peak resident memory there
          (torch's CUDA caching allocator makes the same trade on a GPU). Construction
          runs under glibc's defaults; no trims. Process-wide, and it stays set: a later
          engine in ``default`` mode does not undo it.
  default glibc as it is.
Same effect as ``MALLOC_MMAP_THRESHOLD_`` in the environment, but applied from inside
the process, for any launcher. Not glibc (musl, macOS): a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from typing import Any, Callable

import torch

try:
    import resource
except ImportError:  # not Unix: no page fault counts
    resource = None  # type: ignore[assignment]

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MADV_HUGEPAGE = 14
HUGE_PAGE = 2 * 2**20
"""Linux's transparent huge page on x86-64 and most arm64 kernels (4 KiB base pages)."""
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
BUILD_THRESHOLD = 64 * 1024
TRAIN_THRESHOLD = {"lean": 32 * 2**20, "frugal": 64 * 1024, "cache": 2**30}
TRIMMED = ("lean", "frugal")
"""The modes that give free heap memory back after construction and after every step."""
NEVER_TRIM = 2**31 - 1
"""``M_TRIM_THRESHOLD`` for 'cache': mallopt takes an int; glibc trims the heap's top only when
more than this is free there."""


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # glibc only
        return libc
    except (OSError, AttributeError):
        return None


def user_tuned() -> bool:
    """Has the user set glibc malloc's mmap or trim threshold in the environment
    (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, or either in ``GLIBC_TUNABLES``)?"""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return ("MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ
            or "glibc.malloc.mmap_threshold" in tunables or "glibc.malloc.trim_threshold" in tunables)


def resolve(setting: str, *, offload: bool, device: str) -> str:
    """``memory.host_malloc`` -> 'default', 'lean', 'frugal' or 'cache'. 'auto' is 'lean' when
    offload is on with the CPU as the compute device (host memory is the budget there)
    and the user has not tuned malloc in the environment (``user_tuned``); 'default' otherwise."""
    if setting != "auto":
        return setting
    if user_tuned():
        return "default"  # the user's own allocator setting wins
    return "lean" if offload and device == "cpu" else "default"


def mode_of(cfg: Any, device: str) -> str:
    """The resolved mode of an ``EngineConfig`` for a compute device type."""
    return resolve(cfg.memory.host_malloc, offload=cfg.offload.enabled, device=device)


def _mallopt(param: int, value: int) -> bool:
    libc = _libc()
    return libc is not None and libc.mallopt(param, value) == 1


def for_building(mode: str) -> bool:
    """Set malloc up for construction under ``mode`` (process-wide). Returns whether the
    engine should switch to ``for_training`` afterwards (a glibc mode other than
    'default'); ``trims_steps`` says whether it also trims after each step."""
    if mode == "cache":
        return _libc() is not None  # glibc's defaults while building
    return mode in TRAIN_THRESHOLD and _mallopt(M_MMAP_THRESHOLD, BUILD_THRESHOLD)


def trims_steps(mode: str) -> bool:
    """Does ``mode`` give free heap memory back after every step?"""
    return mode in TRIMMED


def for_training(mode: str) -> None:
    """After construction: the training threshold of ``mode``, then (lean, frugal) give
    free heap back, or (cache) keep it for good."""
    if mode in TRAIN_THRESHOLD:
        _mallopt(M_MMAP_THRESHOLD, TRAIN_THRESHOLD[mode])
        if mode == "cache":
            _mallopt(M_TRIM_THRESHOLD, NEVER_TRIM)
        else:
            trim()


def minor_faults() -> int | None:
    """This process's minor page faults so far (``getrusage``: every thread's, each first
    touch of a freshly mapped page); None where the platform does not count them."""
    if resource is None:
        return None
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def trim() -> None:
    """Give free heap memory back to the OS (glibc ``malloc_trim(0)``); a no-op elsewhere."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def trim_between(mode: str) -> None:
    """A trim between the steps, where a run does something else (a validation pass, a
    checkpoint save, the export): the steps' freed temporaries are given back before that
    work adds its own (the checkpoint writer's first import: about 30 MiB), so its resident
    set lands on a trimmed heap instead of on top of the steps' retained one. Every mode but
    'cache' (which keeps its heap for good); rare (once per such event), so its page faults
    cost nothing measurable. ``mode``: the resolved ``memory.host_malloc``. No-op off glibc."""
    if mode != "cache":
        trim()


Advise = Callable[[torch.Tensor], torch.Tensor]
"""What is called on a fresh buffer before its first write and returns it (``HugePages``,
``as_is``)."""


def as_is(t: torch.Tensor) -> torch.Tensor:
    """No advice: ``t`` as it is (the default ``Advise`` wherever none is given)."""
    return t


def thp_setting(path: str = THP_SETTING) -> str:
    """The kernel's transparent huge page mode: 'always', 'madvise' or 'never' (the bracketed
    word of ``/sys/kernel/mm/transparent_hugepage/enabled``); '' where there is none (not
    Linux, no THP, unreadable)."""
    try:
        text = open(path).read()
    except OSError:
        return ""
    return text[text.find("[") + 1:text.find("]")] if "[" in text else ""


class HugePages:
    """``memory.huge_pages``: ask the kernel for 2 MiB pages on a fresh buffer before its first
    write (``madvise(MADV_HUGEPAGE)`` on the 2 MiB-aligned part of its storage), so filling it
    faults a page per 2 MiB instead of per 4 KiB. Under glibc's defaults every block of 32 MiB
    and up is a fresh mapping, and mct's own stage-3 gathers, flat gradients and collective
    temporaries are such blocks: each first write of them otherwise faults 8,192 pages per 32
    MiB. Only where the kernel's THP mode is 'madvise' (with 'always' the kernel does this
    already; with 'never' it refuses); no-op off glibc/Linux, on CUDA, in a dry run (fake
    tensors), and for buffers under ``MIN_BYTES``. The bytes, their values and the tensors'
    lifetimes do not change: only the page size the kernel backs them with."""

    MIN_BYTES = 2 * HUGE_PAGE
    """A buffer smaller than this may hold no whole aligned 2 MiB page: not worth the call."""

    def __init__(self, enabled: bool, device: torch.device | str = "cpu") -> None:
        libc = _libc() if enabled and torch.device(device).type == "cpu" else None
        self.on = libc is not None and thp_setting() == "madvise"
        if self.on:
            self._madvise = libc.madvise
            self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            self._madvise.restype = ctypes.c_int

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """``t``, its storage's whole 2 MiB pages advised; returned for chaining."""
        if self.on and type(t) in _PLAIN and t.device.type == "cpu":
            st = t.untyped_storage()
            n = st.nbytes()
            if n >= self.MIN_BYTES:
                ptr = st.data_ptr()
                lo, hi = -(-ptr // HUGE_PAGE) * HUGE_PAGE, (ptr + n) // HUGE_PAGE * HUGE_PAGE
                if hi > lo:
                    self._madvise(lo, hi - lo, MADV_HUGEPAGE)  # advice: a refusal changes nothing
        return t


_PLAIN = (torch.Tensor, torch.nn.Parameter)
