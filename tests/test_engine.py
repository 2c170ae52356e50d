"""Engine at ZeRO stage 0 (data parallel, fp32) against the reference trainer."""

from __future__ import annotations

import pytest
import torch

from mct.engine import Engine
from mct.models.gpt import GPT, gpt_loss
from tests.distributed import run_distributed
from tests.helpers import adamw, batches, engine_vs_reference, sgd_momentum, tiny_config


def test_stage0_one_rank_matches_reference_after_10_steps():
    cfg = tiny_config(train={"grad_clip": 1.0})
    losses, ref_losses, rel, name = engine_vs_reference(cfg, 0, 1, steps=10)
    assert rel <= 1e-6, f"{name} differs by {rel:.2e}"
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-6 * abs(b)


def _two_rank_parity(rank: int, world: int):
    out = {}
    for opt_name, opt in (("adamw", adamw), ("sgd", sgd_momentum)):
        cfg = tiny_config(train={"grad_clip": 1.0})
        out[opt_name] = engine_vs_reference(cfg, rank, world, steps=4, optimizer=opt, n_micro=2)
    return out


@pytest.mark.multirank
def test_stage0_two_ranks_match_reference_adamw_and_sgd():
    results = run_distributed(_two_rank_parity, 2)
    for opt_name, (losses, ref_losses, rel, name) in results[0].items():
        assert rel <= 1e-6, f"{opt_name}: {name} differs by {rel:.2e}"
        for a, b in zip(losses, ref_losses):
            assert abs(a - b) <= 1e-6 * abs(b), (opt_name, losses, ref_losses)
    # every rank reports the same (global) loss
    assert results[0]["sgd"][0] == results[1]["sgd"][0]


def test_eval_loss_changes_nothing():
    cfg = tiny_config()
    torch.manual_seed(0)
    engine = Engine(GPT(cfg.model), adamw, cfg)
    before = engine.full_state_dict()
    rng = torch.get_rng_state()
    loss = engine.eval_loss(batches(0, 0)[0], gpt_loss)
    assert loss > 0
    assert torch.equal(rng, torch.get_rng_state())
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert engine.optimizer.state == {} or all(len(s) == 0 for s in engine.optimizer.state.values())


def test_full_state_dict_keeps_parameter_names_and_fp32():
    cfg = tiny_config(precision={"mode": "bf16"})
    torch.manual_seed(0)
    model = GPT(cfg.model)
    names = [n for n, _ in model.named_parameters()]
    engine = Engine(model, adamw, cfg)
    sd = engine.full_state_dict()
    assert list(sd) == names
    assert all(v.dtype == torch.float32 for v in sd.values())
    assert [n for n, _ in model.named_parameters()] == names


def test_non_elementwise_optimizer_is_rejected():
    cfg = tiny_config()
    with pytest.raises(ValueError, match="not elementwise"):
        Engine(GPT(cfg.model), lambda g: torch.optim.LBFGS(g[0]["params"]), cfg)


def test_parameter_missing_from_optimizer_is_an_error():
    cfg = tiny_config()
    model = GPT(cfg.model)
    with pytest.raises(ValueError, match="in no optimizer param group"):
        Engine(model, adamw, cfg, param_groups=[{"params": [model.wte.weight]}])


def test_zero_units_are_chosen_apart_from_checkpointing_blocks():
    """zero.units = the attention and MLP modules while checkpointing recomputes whole
    blocks: stage 3 gathers per sub-module and still matches the reference."""
    cfg = tiny_config(zero={"stage": 3, "units": ["CausalSelfAttention", "MLP"]}, checkpointing={"policy": "all"})
    engine = Engine(GPT(cfg.model), adamw, cfg)
    assert sorted(engine.sharded.units_by_block) == sorted(
        ["root"] + [f"blocks.{i}.{m}" for i in range(2) for m in ("attn", "mlp")])
    assert engine.recompute.checkpointed_blocks == ["blocks.0", "blocks.1"]
    losses, ref_losses, rel, name = engine_vs_reference(cfg, 0, 1, steps=3)
    assert rel <= 1e-6, f"{name} differs by {rel:.2e}"


@pytest.mark.parametrize("stage,policy", [(0, "none"), (2, "all"), (3, "all")])
def test_a_dropped_engine_is_freed_with_its_buffers(stage, policy):
    """Nothing outside the engine and its model keeps them alive once a step has run: the
    gradient hooks on the parameters reach their engine weakly, so the garbage collector frees
    both (on a GPU, their device memory) once the caller drops them, as ``mct train``'s budget
    fallback does before it builds the next engine."""
    import gc
    import weakref

    def build():
        cfg = tiny_config(zero={"stage": stage}, checkpointing={"policy": policy})
        model = GPT(cfg.model)
        engine = Engine(model, adamw, cfg)
        engine.train_step(batches(0, 0), gpt_loss)
        return weakref.ref(engine), weakref.ref(model), [weakref.ref(u.working) for u in engine.sharded.units]

    engine, model, buffers = build()
    gc.collect()
    assert engine() is None and model() is None
    assert buffers and all(b() is None for b in buffers)
