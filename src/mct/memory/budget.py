"""Enforcing a per-rank memory budget inside the engine.

CPU: the tracker raises ``MemoryBudgetExceeded`` at the allocation that crosses the
budget. The optimizer step must not fail half-way (some masters updated, Adam's lazy
state half-created), so before it modifies anything the engine asks the tracker for
the step's headroom: the bytes a fake-tensor trial of the same optimizer allocates
(state on the first step, temporaries after), or more if a real step grew more.
CUDA: ``torch.cuda.set_per_process_memory_fraction`` caps the caching allocator at
the budget, and a CUDA out-of-memory error becomes the same exception.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from mct.config import EngineConfig
from mct.memory.tracker import MemoryBudgetExceeded, MemoryTracker, format_bytes


def default_suggestion(cfg: EngineConfig) -> Callable[[], str]:
    """What to change, for an engine built without a plan (Python API)."""
    def text() -> str:
        return (f"zero.stage is {cfg.zero.stage} and checkpointing.policy {cfg.checkpointing.policy!r}: raise the "
                f"stage, recompute blocks (policy 'all'), lower data.micro_batch_size, or run "
                f"`mct plan --budget {cfg.memory.budget.text if cfg.memory.budget else 'SIZE'}` for a configuration predicted to fit")
    return text


def optimizer_step_bytes(factory: Callable, hyper: list[dict], groups: list[int],
                         masters: list[torch.Tensor]) -> tuple[int, int]:
    """Bytes (first step, later steps) that ``factory``'s optimizer allocates in one
    step over tensors shaped like ``masters`` (``groups[i]``: group of master i),
    measured on fake tensors. (0, 0) if the optimizer cannot run on fake tensors."""
    tracker = MemoryTracker("cpu", count_fake=True)
    try:
        with FakeTensorMode():
            fakes = [nn.Parameter(torch.empty(m.shape, dtype=m.dtype)) for m in masters]
            for f in fakes:
                f.grad = torch.empty_like(f)
            opt = factory([{**h, "params": [f for f, g in zip(fakes, groups) if g == gi]}
                           for gi, h in enumerate(hyper)])
            growth = []
            for _ in range(2):  # the first step creates the state, later ones only temporaries
                tracker.reset_peaks()
                start = tracker.live()["total"]
                with tracker.phase("step", "other"):
                    opt.step()
                growth.append(tracker.peaks()["step"]["total"] - start)
    except Exception:  # an optimizer fake tensors cannot run: rely on measured steps
        return 0, 0
    return growth[0], growth[1]


class StepReserve:
    """Headroom the optimizer step needs; grows with what real steps measured."""

    def __init__(self, first: int, later: int, publish: int) -> None:
        self.first, self.later, self.publish = first, later, publish
        self.observed = 0

    def need(self, first_step: bool) -> int:
        return max(self.first if first_step else self.later, self.observed) + self.publish

    def observe(self, peak: int, start: int) -> None:
        self.observed = max(self.observed, peak - start - self.publish)


def apply_cuda_budget(device: torch.device, budget: int, context: int = 0) -> None:
    """Cap this process's CUDA caching allocator at ``budget`` bytes of the device, less
    ``context`` (the CUDA context's bytes, where the budget counts the process). Raises
    ValueError when the budget exceeds the device or leaves the allocator nothing."""
    if budget <= context:
        raise ValueError(f"memory.budget = {format_bytes(budget)} is not more than the CUDA context alone "
                         f"(about {format_bytes(context)}): raise it, or set memory.budget_counts=tensors")
    budget -= context
    total = torch.cuda.get_device_properties(device).total_memory
    if budget > total:
        raise ValueError(f"memory.budget = {format_bytes(budget)} is more than the device has "
                         f"({format_bytes(total)}): lower it or drop memory.enforce")
    torch.cuda.set_per_process_memory_fraction(budget / total, device)


@contextlib.contextmanager
def cuda_oom_as_budget_error(tracker: MemoryTracker, phase: Callable[[], str]) -> Iterator[None]:
    """Turn a CUDA out-of-memory error (the allocator hit the capped fraction) into
    ``MemoryBudgetExceeded`` naming the phase, the live bytes by category and the hint."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as e:
        hint = tracker.suggestion() if tracker.suggestion is not None else ""
        raise MemoryBudgetExceeded(phase(), tracker.live(), tracker.budget_bytes or 0, hint) from e


def step_reserve(factory: Callable, hyper: list[dict], groups: list[int], masters: list[torch.Tensor],
                 units: list, param_dtype: torch.dtype) -> StepReserve:
    """The headroom of an optimizer step over ``masters`` (what the step touches at once:
    the master shards, or offload's chunks), plus the largest all-gather a publish of
    persistent sharded ``units`` (flat units) needs in ``param_dtype``."""
    first, later = optimizer_step_bytes(factory, hyper, groups, masters)
    publish = max((u.master.numel() * param_dtype.itemsize for u in units if u.persistent and u.layout.world > 1),
                  default=0)
    return StepReserve(first, later, publish)
