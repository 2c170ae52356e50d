"""``Engine.train_step(track_memory=False)``: the steps ``mct train`` does not log run
without the tracker's per-op counting, and a counted step after them reports exactly the
peaks it reports when every step is counted; nothing trained changes."""

from __future__ import annotations

import pytest
import torch

from mct.engine import Engine
from mct.models.gpt import GPT, gpt_loss
from tests.helpers import adamw, batches, tiny_config

COUNTED = (True, False, True)


@pytest.mark.parametrize("stage,mode,policy", [(0, "fp32", "none"), (3, "bf16", "all")])
def test_counted_steps_between_uncounted_ones_report_the_peaks_of_always_counted_steps(stage, mode, policy):
    cfg = tiny_config(zero={"stage": stage}, precision={"mode": mode}, checkpointing={"policy": policy})
    engines = []
    for _ in range(2):
        torch.manual_seed(0)
        engines.append(Engine(GPT(cfg.model), adamw, cfg))
    always, sampled = engines
    for step, counted in enumerate(COUNTED):
        a = always.train_step(batches(step, 0, n_micro=2), gpt_loss)
        s = sampled.train_step(batches(step, 0, n_micro=2), gpt_loss, track_memory=counted)
        assert (a.loss, a.grad_norm, a.skipped) == (s.loss, s.grad_norm, s.skipped)
        if counted:  # the books of the uncounted steps were kept: the same live bytes and peaks
            assert s.metrics["live"] == a.metrics["live"], step
            assert s.metrics["peak_bytes"] == a.metrics["peak_bytes"] > 0, step
            assert s.metrics["peaks"] == a.metrics["peaks"], step
        else:
            assert s.metrics["peak_bytes"] is None and s.metrics["peaks"] == {}, step
    full_a, full_s = always.full_state_dict(), sampled.full_state_dict()
    assert all(torch.equal(full_a[k], full_s[k]) for k in full_a)


def test_track_memory_false_is_ignored_under_an_enforced_budget():
    cfg = tiny_config(memory={"budget": "1GiB", "enforce": True, "budget_counts": "tensors"})
    torch.manual_seed(0)
    engine = Engine(GPT(cfg.model), adamw, cfg)
    out = engine.train_step(batches(0, 0), gpt_loss, track_memory=False)
    assert out.metrics["peak_bytes"] > 0 and "forward" in out.metrics["peaks"]
