"""``mct.planner.isolate``: fake-tensor work in a forked child, its answer here."""

from __future__ import annotations

import os
import sys

import pytest

from mct.planner import isolate
from mct.planner.pool import can_fork

pytestmark = pytest.mark.skipif(not can_fork(), reason="forks a child")


@pytest.fixture
def dynamo_not_loaded(monkeypatch):
    """This process as a training rank sees it: torch._dynamo not imported (so it forks)."""
    monkeypatch.delitem(sys.modules, "torch._dynamo", raising=False)


def test_run_forked_computes_in_a_child_and_returns_its_answer_here(dynamo_not_loaded):
    parent = os.getpid()
    assert isolate.keeps_dynamo_out()
    assert isolate.run_forked(lambda: (os.getpid() != parent, [1, 2])) == (True, [1, 2])


def test_run_forked_raises_the_childs_error_here(dynamo_not_loaded):
    def fails() -> None:
        raise ValueError("model.n_head = 3: must divide d_model")
    with pytest.raises(ValueError, match="must divide"):
        isolate.run_forked(fails)


def test_a_child_that_dies_without_an_answer_is_run_here_instead(dynamo_not_loaded):
    parent = os.getpid()

    def dies_in_a_child() -> str:
        if os.getpid() != parent:
            os._exit(9)  # killed, out of memory: no answer comes back
        return "here"
    assert isolate.run_forked(dies_in_a_child) == "here"


def test_with_torch_dynamo_loaded_it_runs_here(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch._dynamo", object())
    assert not isolate.keeps_dynamo_out()
    assert isolate.run_forked(os.getpid) == os.getpid()


def test_the_runs_flop_count_and_step_work_are_the_same_in_the_child(dynamo_not_loaded):
    """What a training rank counts on fake tensors (``Utilization.for_run``'s work) is
    the same forked as here: FLOPs, and the dry run's op counts the time model prices."""
    import torch

    from mct.config import EngineConfig
    from mct.models.gpt import GPT, gpt_loss
    from mct.planner.flops import step_flops
    from mct.run.utilization import step_work
    from mct.task.spec import Task

    cfg = EngineConfig.from_dict({"model": {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16,
                                            "vocab_size": 64}, "checkpointing": {"policy": "all"}})
    batch = (torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long))
    task = Task(lambda: GPT(cfg.model), gpt_loss, batch)

    def counts():
        return step_flops(task, cfg, 1), step_work(task, cfg, 1, "cpu")
    forked = isolate.run_forked(counts)
    here = counts()
    assert forked[0].method == "flop_counter" and forked[0].hardware > forked[0].model > 0
    assert forked[1] is not None and forked[1].n_ops > 0
    assert (forked[0].model, forked[0].hardware, forked[1]) == (here[0].model, here[0].hardware, here[1])


def test_a_daemonic_process_runs_it_here(dynamo_not_loaded, monkeypatch):
    import multiprocessing
    monkeypatch.setattr(multiprocessing.current_process(), "daemon", True, raising=False)
    assert isolate.run_forked(os.getpid) == os.getpid()
