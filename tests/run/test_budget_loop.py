"""The budget loop: an `auto` run whose enforced budget is overrun at run time moves
to the planner's next, more frugal configuration; nothing left: one ValueError."""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path

import pytest

from mct.config import EngineConfig
from mct.reporting.events import read_events
from mct.run.trainer import train

plan_module = importlib.import_module("mct.planner.plan")  # the package's plan() shadows the module name



def config(corpus_dir: Path, policy: str, budget: str) -> EngineConfig:
    # activations dominate (seq 64 x batch 8): predicted peaks none 10.6 MB, sqrt 5.4 MB, all 3.6 MB
    return EngineConfig.from_dict({
        "seed": 5, "model": {"n_layer": 4, "n_head": 2, "d_model": 32, "seq_len": 64, "dropout": 0.1},
        "data": {"path": str(corpus_dir), "micro_batch_size": 8}, "checkpointing": {"policy": policy},
        "memory": {"budget": budget, "enforce": True, "budget_counts": "tensors"},  # budgets: tensor bytes
        "train": {"steps": 3, "warmup_steps": 1, "eval_every": 0, "log_every": 1}})


def underpredict(monkeypatch, factors: dict[str, float]) -> None:
    """Make the planner optimistic about some policies, as a wrong prediction would be."""
    real = plan_module.predict

    def optimistic(work, cfg, world):
        p, f = real(work, cfg, world), factors.get(cfg.checkpointing.policy, 1.0)
        # the steady and the first step alike: auto's pick must fit both
        return dataclasses.replace(p, peak=int(p.peak * f), first_step_peak=int(p.first_step_peak * f))
    monkeypatch.setattr(plan_module, "predict", optimistic)


@pytest.mark.slow  # in make test, not make test-fast
def test_overrun_under_auto_moves_to_the_next_frugal_configuration(tmp_path, corpus_dir, monkeypatch):
    underpredict(monkeypatch, {"none": 0.4})  # 'none' looks like 4.3 MB: chosen for a 5 MB budget, then overruns
    train(config(corpus_dir, "auto", "5MB"), tmp_path / "auto", progress=False)
    monkeypatch.undo()
    train(config(corpus_dir, "all", "5MB"), tmp_path / "all", progress=False)
    meta = json.loads((tmp_path / "auto" / "metadata.json").read_text())
    assert meta["plan"]["checkpointing.policy"] == "none"
    [change] = meta["config_changes"]
    assert change["step"] == 0 and change["from"]["checkpointing.policy"] == "none"
    assert change["to"]["checkpointing.policy"] == "all" and "budget" in change["reason"]
    assert [(e["kind"], e["action"]) for e in read_events(tmp_path / "auto")] == [
        ("budget_fallback", "zero.stage=0 checkpointing.policy=all")]
    # the failed step modified nothing: the run equals one planned right from the start
    assert (tmp_path / "auto" / "model.safetensors").read_bytes() == \
        (tmp_path / "all" / "model.safetensors").read_bytes()


@pytest.mark.slow  # in make test, not make test-fast
def test_nothing_more_frugal_left_is_one_value_error(tmp_path, corpus_dir, monkeypatch):
    underpredict(monkeypatch, {"none": 0.25, "all": 0.25, "sqrt": 0.25})  # none 2.7, sqrt 1.4, all 0.9 MB
    with pytest.raises(ValueError, match="no configuration predicted to need less is left") as e:
        train(config(corpus_dir, "auto", "3MB"), tmp_path / "run", progress=False)
    assert "\n" not in str(e.value)
    kinds = [e["kind"] for e in read_events(tmp_path / "run")]
    assert kinds == ["budget_fallback"]  # none -> all, then nothing below all's prediction


def test_fallback_plans_the_runs_own_activation_offload(monkeypatch):
    """The fallback's candidate rows are dry-run with the running config's
    checkpointing.offload ('disk' here, as `auto` picks it when nothing fits without it;
    the `auto` config as given says 'none'), and the next configuration keeps it: no row
    planned without it, and no policy 'none', which has no regions to offload."""
    from mct.run.budget_loop import BudgetLoop
    from mct.task import gpt_task
    auto = EngineConfig.from_dict({"model": {"n_layer": 2, "n_head": 2, "d_model": 16, "vocab_size": 101,
                                             "seq_len": 13}, "data": {"micro_batch_size": 2},
                                   "checkpointing": {"policy": "auto"}, "memory": {"budget": "1GiB", "enforce": True}})
    d = auto.to_dict()
    d["checkpointing"].update(policy="all", offload="disk")
    current = EngineConfig.from_dict(d)
    planned = []
    real = plan_module.predict

    def spy(work, cfg, world):
        planned.append((cfg.checkpointing.policy, cfg.checkpointing.offload))
        return real(work, cfg, world)
    monkeypatch.setattr(plan_module, "predict", spy)
    loop = BudgetLoop(auto, 1, gpt_task(auto), peak=2**40, tried={(0, "all")})
    new, change = loop.next_config(current, "over budget")
    assert planned and {tier for _, tier in planned} == {"disk"} and "none" not in {p for p, _ in planned}, planned
    assert (new.checkpointing.policy, new.checkpointing.offload) == ("sqrt", "disk")
    assert change["to"]["checkpointing.policy"] == "sqrt"


def test_fallback_frees_a_kept_root_first_then_plans_with_it_freed(monkeypatch):
    """`auto` kept the stage-3 root gathered into backward (zero.reshard_root_after_forward
    false, the user's config at its default): the first step down is the same stage and
    policy with the root freed after forward, predicted below; the next one plans the
    other configurations with the root freed (no row keeps it)."""
    from mct.run.budget_loop import BudgetLoop
    from mct.task import gpt_task
    # the loss's [tokens, vocab] temporaries set the peak, with the root kept on top of them
    auto = EngineConfig.from_dict({"model": {"n_layer": 2, "n_head": 2, "d_model": 64, "vocab_size": 4001,
                                             "seq_len": 64}, "data": {"micro_batch_size": 8},
                                   "zero": {"stage": "auto"}, "checkpointing": {"policy": "auto"},
                                   "memory": {"budget": "1GiB", "enforce": True}})
    d = auto.to_dict()
    d["zero"].update(stage=3, reshard_root_after_forward=False)
    d["checkpointing"]["policy"] = "none"
    kept = EngineConfig.from_dict(d)
    work = gpt_task(auto)
    kept_peak = plan_module.predict(work, kept, 2).peak
    loop = BudgetLoop(auto, 2, work, peak=kept_peak, tried={(3, "none")})
    freed, change = loop.next_config(kept, "over budget")
    assert (freed.zero.stage, freed.checkpointing.policy, freed.zero.reshard_root_after_forward) == (3, "none", True)
    assert change["from"]["zero.reshard_root_after_forward"] is False
    assert change["to"]["zero.reshard_root_after_forward"] is True
    assert change["to"]["predicted_peak_bytes"] == plan_module.predict(work, freed, 2).peak < kept_peak
    planned = []
    real = plan_module.predict

    def spy(work, cfg, world):
        planned.append(cfg.zero.reshard_root_after_forward)
        return real(work, cfg, world)
    monkeypatch.setattr(plan_module, "predict", spy)
    nxt, change = loop.next_config(freed, "over budget")
    assert planned and all(planned), planned
    assert nxt.zero.reshard_root_after_forward and "zero.reshard_root_after_forward" not in change["to"]
    assert change["to"]["predicted_peak_bytes"] < change["from"]["predicted_peak_bytes"]
