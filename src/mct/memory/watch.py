"""``memory.enforce`` on the figure the kernel counts: the process's resident set (CPU) or,
on CUDA, the caching allocator's reserved bytes plus the context (what ``nvidia-smi`` shows).

The tracker counts tensor bytes at every allocation; the resident set also holds the
interpreter, torch, the allocator's cached chunks and whatever a kernel allocates outside
tensors. ``ResidentWatch`` reads it where the tracker sees growth, every ``STRIDE`` bytes of
new tensor storage (``/proc/self/statm``: one small read, a few microseconds), at each phase's
start, and before the optimizer step with the step's headroom, and reports it once it comes
within ``STRIDE`` of the budget: the margin is what the next stride may add before the next
read, so a run is stopped before its resident set reaches the budget (a container's limit),
not after. One allocation larger than the stride can still cross it before it is seen.
"""

from __future__ import annotations

import os

import torch

from mct.memory.process_peak import CUDA_CONTEXT

STRIDE = 4 * 2**20
"""Bytes of new tensor storage between two reads of the resident set, and the margin kept
below the budget (docs/memory.md, "The budget counts the process")."""


def resident_bytes() -> int | None:
    """This process's resident set now (VmRSS, from ``/proc/self/statm``); None where there is
    no such file (not Linux)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class ResidentWatch:
    """The process figure of one device against ``budget`` bytes: ``check`` after ``nbytes``
    of new tensor storage returns the figure when it is within ``stride`` of the budget (None
    otherwise, or when it cannot be read). ``cuda_context``: the bytes the CUDA context is
    taken to hold (``mct.memory.process_peak.CUDA_CONTEXT``; not measured here). Mutates only
    its own stride counter."""

    def __init__(self, budget: int, device: torch.device | str = "cpu", *, stride: int = STRIDE,
                 cuda_context: int = CUDA_CONTEXT) -> None:
        assert budget > 0 and stride >= 0
        self.budget, self.stride = budget, stride
        self.device = torch.device(device)
        self.cuda_context = cuda_context
        self._since = 0

    @property
    def figure_name(self) -> str:
        """What ``figure`` reads, in words (for the error)."""
        if self.device.type == "cuda":
            return "the process's device memory (CUDA reserved + context)"
        return "the process's resident set (VmRSS)"

    def figure(self) -> int | None:
        """The process figure now: VmRSS on CPU, reserved + context on CUDA."""
        if self.device.type == "cuda":
            return torch.cuda.memory_reserved(self.device) + self.cuda_context
        return resident_bytes()

    def check(self, nbytes: int = 0, extra: int = 0, *, force: bool = False) -> int | None:
        """After ``nbytes`` of new storage: the figure (plus ``extra`` bytes about to be
        allocated) when a read is due (``force``, or a stride's worth since the last one) and
        it is within the margin of the budget; else None."""
        self._since += nbytes
        if not force and self._since < self.stride:
            return None
        self._since = 0
        now = self.figure()
        if now is None or now + extra + self.stride <= self.budget:
            return None
        return now + extra
