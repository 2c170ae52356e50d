"""``memory.enforce`` watches the process's resident set when the budget counts the process
(mct.memory.watch): read every stride of new tensor storage, at each phase's start and before
the optimizer step, failing with MemoryBudgetExceeded naming the figure and the budget."""

from __future__ import annotations

import pytest
import torch

from mct import Engine
from mct.memory.tracker import MemoryBudgetExceeded, MemoryTracker
from mct.memory.watch import STRIDE, ResidentWatch, resident_bytes
from mct.models.gpt import GPT, gpt_loss
from tests.helpers import adamw, batches, tiny_config

MiB = 2**20


def test_resident_bytes_reads_this_process_and_grows_with_a_written_buffer():
    before = resident_bytes()
    assert before is not None and before > 50 * MiB  # python + torch
    x = torch.ones(64 * MiB // 4)  # written: its pages are resident
    assert resident_bytes() >= before + 48 * MiB
    del x


def test_watch_reads_once_a_stride_and_reports_the_figure_within_the_margin():
    reads = []
    watch = ResidentWatch(1000 * MiB, stride=4 * MiB)
    watch.figure = lambda: reads.append(1) or 997 * MiB  # type: ignore[method-assign]
    assert watch.check(1 * MiB) is None and not reads  # under a stride since the last read: no read
    assert watch.check(3 * MiB) == 997 * MiB and len(reads) == 1  # 997 + the 4 MiB margin passes 1000
    watch.figure = lambda: 996 * MiB  # type: ignore[method-assign]
    assert watch.check(force=True) is None  # 996 + 4: exactly at the budget is within it
    watch.figure = lambda: 900 * MiB  # type: ignore[method-assign]
    assert watch.check(force=True) is None
    assert watch.check(extra=97 * MiB, force=True) == 997 * MiB  # what is about to be allocated counts


def test_tracker_with_a_watch_fails_naming_the_resident_set_and_the_budget():
    with MemoryTracker().phase("warm-up"):  # the dispatch mode's first use imports what it needs
        torch.ones(4).sum()
    budget = resident_bytes() + 8 * MiB
    tracker = MemoryTracker(budget_bytes=budget, watch=ResidentWatch(budget),
                            suggestion=lambda: "raise memory.budget")
    kept: list[torch.Tensor] = []
    with pytest.raises(MemoryBudgetExceeded) as info:
        with tracker.phase("forward"):
            for _ in range(16):  # 64 MiB written, 4 MiB at a time
                kept.append(torch.ones(STRIDE // 4))
    e = info.value
    assert e.phase == "forward" and e.resident is not None and e.resident + STRIDE > budget
    assert e.resident <= budget + STRIDE  # caught within a stride of new storage
    text = str(e)
    assert "resident set" in text and "budget_counts" in text and "raise memory.budget" in text
    assert e.live["total"] < budget and len(kept) < 16  # stopped early; the tensors alone far under it


def test_engine_enforcing_a_process_budget_watches_the_resident_set_and_a_tensor_budget_does_not():
    """A budget counting the process that the resident set has reached stops the step at its
    first phase; the same budget counting tensor bytes has no watch, and the step runs."""
    budget = str(resident_bytes() + 256 * MiB)
    for counts in ("process", "tensors"):
        cfg = tiny_config(memory={"budget": budget, "enforce": True, "budget_counts": counts})
        torch.manual_seed(0)
        engine = Engine(GPT(cfg.model), adamw, cfg)
        if counts == "process":  # the engine is built (its heap trimmed): tighten to the resident set now
            engine.tracker.watch.budget = resident_bytes() + MiB
            with pytest.raises(MemoryBudgetExceeded, match="resident set") as info:
                engine.train_step(batches(0, 0, 1, B=8), gpt_loss)
            assert info.value.phase == "forward" and info.value.live["total"] < info.value.budget
        else:
            assert engine.tracker.watch is None
            assert not engine.train_step(batches(0, 0, 1, B=8), gpt_loss).skipped
