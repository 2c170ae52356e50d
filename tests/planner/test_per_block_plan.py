"""The planner on mixed stacks (``checkpointing.per_block``): a plan's per_block row lies
between its 'none' and 'all' rows and is the peak a real run holds; a mixed stack's
depth extrapolation equals its full dry run to the byte; `mct plan` shows and
recommends it."""

from __future__ import annotations

import json

import pytest

import mct
from mct.cli import main
from mct.config import EngineConfig
from mct.planner import token_loss
from mct.planner.depth import MixedShape, Prepared, extrapolated, shape_for
from mct.planner.dry_run import DryRunHooks, dry_run
from mct.planner.grid import micro_batches, prepare_work
from mct.task import builds_on_meta, gpt_task
from tests.helpers import one_thread, tiny_config  # noqa: F401 (one_thread: autouse fixture)
from tests.planner_models import hf_gpt2, random_batch
from tests.storage_count import measure

B = 3
MIXED = ["all", "selective", "none", "all"]


def _gpt2() -> object:
    return hf_gpt2(n_layer=len(MIXED))


@pytest.mark.slow
def test_mixed_row_lies_between_none_and_all_and_is_the_measured_peak():
    """A held-out model (transformers' GPT-2, dropout 0.1): the per_block row's steady,
    first-step and init peaks against every live storage of a real run (2%, as the
    planner's accuracy tests), and the engine tracker's own peak of the same step."""
    cfg = tiny_config(zero={"stage": 2}, checkpointing={"per_block": MIXED})
    plan = mct.plan(_gpt2, token_loss, random_batch(0, 0, B), cfg, world_size=1, stages=(2,),
                    policies=("none", "all", "per_block"), precisions=("fp32",), workers=1)
    rows = {r["policy"]: r for r in plan.rows}
    assert rows["per_block"]["per_block"] == MIXED and rows["all"]["per_block"] is None
    peaks = {k: r["peak"] for k, r in rows.items()}
    assert peaks["all"] < peaks["per_block"] < peaks["none"], peaks
    # 2 of 4 blocks recompute fully, 1 half: between the uniform rows' costs
    assert rows["none"]["cost"] < rows["per_block"]["cost"] < rows["all"]["cost"]
    real = measure(_gpt2, token_loss, lambda s, r: random_batch(s, r, B), cfg, 0, steps=3)
    mixed = rows["per_block"]
    for name, pred, meas in (("steady", mixed["peak"], min(real["steps"][1:])),
                             ("first step", mixed["first_step_peak"], real["steps"][0]),
                             ("init", mixed["init_peak"], real["init"])):
        assert abs(pred - meas) <= 0.02 * meas, (name, pred, meas)
    assert mixed["peak"] == real["tracker"][1]


# (per_block, stage, precision, world): runs of 5+ blocks are cut, a short run is kept whole;
# stage 3 prefetches across run boundaries; stage 1 on 3 ranks peaks at backward's end.
MIXED_STACKS = [({"all": 5, "selective": 2}, 3, "bf16", 2),
                pytest.param(["none"] * 5 + ["all"] * 2 + ["selective"] * 5, 1, "fp32", 3, marks=pytest.mark.slow)]


@pytest.mark.parametrize("per_block,stage,precision,world", MIXED_STACKS)
@pytest.mark.slow
def test_mixed_stack_depth_extrapolation_equals_the_full_dry_run_to_the_byte(per_block, stage, precision, world):
    cfg = EngineConfig.from_dict({"model": {"n_layer": 12, "d_model": 16, "n_head": 2, "vocab_size": 101,
                                            "seq_len": 13, "dropout": 0.1}, "data": {"micro_batch_size": B},
                                  "zero": {"stage": stage}, "precision": {"mode": precision},
                                  "checkpointing": {"per_block": per_block}})
    work = gpt_task(cfg)
    planned = prepare_work(work, cfg)
    assert isinstance(planned, Prepared)
    shape = shape_for(planned.stack, cfg, cheaper_only=False)  # 12 blocks: not cheaper, exact all the same
    assert isinstance(shape, MixedShape) and len(shape.grown) == 2, shape
    batch, meta_init = micro_batches(work.batch, cfg.data.grad_accum), builds_on_meta(cfg)
    ext = extrapolated(planned, cfg, world, batch, meta_init=meta_init, shape=shape)
    full = dry_run(work.model_fn, work.loss_fn, batch, cfg, world, optimizer=work.optimizer,
                   param_groups=work.param_groups, hooks=DryRunHooks(meta_init=meta_init))
    assert ext is not None
    assert (ext.peak, ext.phase, ext.first_step_peak, ext.init_peak, ext.n_params) == \
        (full.peak, full.phase, full.first_step_peak, full.init_peak, full.n_params)
    assert ext.phases == full.phases and ext.first_step_phases == full.first_step_phases


def test_deep_mixed_stack_is_extrapolated_from_shallow_copies():
    """At 64 blocks the copies hold far fewer blocks than the model: the plan uses them."""
    cfg = EngineConfig.from_dict({"model": {"n_layer": 64, "d_model": 16, "n_head": 2, "vocab_size": 101, "seq_len": 13},
                                  "checkpointing": {"per_block": {"all": 40, "selective": 8}}})
    planned = prepare_work(gpt_task(cfg), cfg)
    shape = shape_for(planned.stack, cfg)
    assert isinstance(shape, MixedShape) and shape.runs == (("all", 40), ("selective", 8), ("none", 16))
    assert shape.blocks == 4 * 9 + 3 < 64


@pytest.mark.slow
def test_mct_plan_shows_and_recommends_the_config_per_block(capsys):
    argv = ["plan", "--set", "model.n_layer=4", "--set", "model.d_model=16", "--set", "model.n_head=2",
            "--set", "model.seq_len=16", "--set", "data.micro_batch_size=2", "--set",
            "checkpointing.per_block=all=1,selective=2", "--stages", "0", "--precisions", "fp32", "--workers", "1"]
    assert main([*argv, "--json"]) == 0
    rows = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert set(rows) == {"none", "selective", "sqrt", "all", "per_block"}  # the config's own joins the default grid
    assert rows["per_block"]["per_block"] == {"all": 1, "selective": 2}
    budget = (rows["per_block"]["peak"] + rows["none"]["peak"]) // 2  # fits per_block, not none
    assert main([*argv, "--policies", "none,per_block", "--budget", str(budget), "--set",
                 "memory.budget_counts=tensors"]) == 0
    out = capsys.readouterr().out
    assert "all*1,selective*2" in out  # the table names each row's blocks
    assert "recommended: zero.stage=0 checkpointing.policy=per_block checkpointing.per_block=all=1,selective=2" in out
    assert main(["plan", "--policies", "per_block", "--stages", "0"]) == 2
    assert "sets none: set it" in capsys.readouterr().err
