"""Checkpointing with any loss: transformers' GPT-2 and Llama, dropout on, KV cache on in
their configs (as from_config builds them), trained through ``mct.Engine`` with the loss
every transformers user writes, ``model(input_ids=x, labels=y).loss``: every policy at
stages 0 and 3 matches the fp32 reference, and ``mct.predict_peak`` plans them within 2%
of a measured run. The engine turns the cache off (``disable_kv_cache``), not the loss."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

pytest.importorskip("transformers")

import mct  # noqa: E402
from mct.checkpointing import disable_kv_cache  # noqa: E402
from mct.config import EngineConfig  # noqa: E402
from mct.verify.reference import ReferenceTrainer  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from tests.helpers import max_rel_diff  # noqa: E402

V, T, B = 128, 16, 2
POLICIES = ("none", "selective", "sqrt", "all", "every_k")


def cached(kind: str) -> nn.Module:
    """A tiny HF causal LM with dropout 0.1 and ``use_cache=True`` (the configs' default)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging
    logging.set_verbosity_error()
    if kind == "llama":
        cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                          attention_dropout=0.1, tie_word_embeddings=False)
    else:
        cfg = GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=3, n_head=2, bos_token_id=0,
                         eos_token_id=0)  # dropout 0.1 everywhere (the default)
    assert cfg.use_cache
    return (LlamaForCausalLM if kind == "llama" else GPT2LMHeadModel)(cfg)


def labels_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    """What a transformers user writes (the model shifts the labels itself); the
    dropout stream seeded per micro-batch so the reference draws the same."""
    x, seed = batch
    torch.manual_seed(seed)
    return model(input_ids=x, labels=x).loss


def _batch(step: int, rank: int) -> tuple:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, V, (B, T), generator=g), 1000 * step + rank


def _vs_reference(rank: int, world: int, kind: str, stage: int, policy: str, steps: int = 2):
    cfg = EngineConfig.from_dict({"zero": {"stage": stage}, "checkpointing": {"policy": policy, "k": 2}})
    torch.manual_seed(0)
    model = cached(kind)
    ref = ReferenceTrainer(copy.deepcopy(model), lambda g: torch.optim.AdamW(g, lr=1e-2)) if rank == 0 else None
    engine = mct.Engine(model, lambda g: torch.optim.AdamW(g, lr=1e-2), cfg)
    losses, ref_losses = [], []
    for step in range(steps):
        losses.append(engine.train_step(_batch(step, rank), labels_loss).loss)
        if ref is not None:
            ref_losses.append(ref.step([[_batch(step, r)] for r in range(world)], labels_loss).loss)
    state = engine.full_state_dict()
    if ref is None:
        return None
    rel, name = max_rel_diff(state, ref.state_dict())
    return max(abs(a - b) / b for a, b in zip(losses, ref_losses)), rel, name


def _every_policy(rank: int, world: int, kind: str, stage: int) -> dict:
    return {policy: _vs_reference(rank, world, kind, stage, policy) for policy in POLICIES}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_labels_loss_of_a_cached_hf_model_matches_the_reference_every_policy(kind, policy):
    loss_rel, param_rel, name = _vs_reference(0, 1, kind, 0, policy)
    assert loss_rel <= 1e-5 and param_rel <= 1e-5, (kind, policy, loss_rel, param_rel, name)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.multirank
def test_labels_loss_of_a_cached_hf_model_matches_the_reference_every_policy_stage3_two_ranks(kind):
    """Every policy in one 2-rank job per model (one spawn, not five)."""
    for policy, (loss_rel, param_rel, name) in run_distributed(_every_policy, 2, kind, 3, timeout=600)[0].items():
        assert loss_rel <= 1e-5 and param_rel <= 1e-5, (kind, policy, loss_rel, param_rel, name)


def test_without_disabling_the_cache_selective_crashes_in_backward(monkeypatch):
    """The failure the engine prevents (so the test above can fail without it)."""
    import mct.engine
    monkeypatch.setattr(mct.engine, "disable_kv_cache", lambda model: [])
    with pytest.raises(Exception, match="not found in storage|saved|recompute"):
        _vs_reference(0, 1, "gpt2", 0, "selective", steps=1)


def test_disable_kv_cache_turns_off_every_config_once():
    model = cached("gpt2")
    assert disable_kv_cache(model) == [""] and model.config.use_cache is False
    assert disable_kv_cache(model) == [] and disable_kv_cache(nn.Linear(2, 2)) == []


@pytest.mark.parametrize("kind,policy", [("gpt2", "selective"), ("llama", "all")])
def test_predict_peak_plans_the_labels_loss_within_2_percent(kind, policy):
    from tests.storage_count import measure
    cfg = EngineConfig.from_dict({"checkpointing": {"policy": policy}})
    real = measure(lambda: cached(kind), labels_loss, _batch, cfg, 0, steps=3)
    pred = mct.predict_peak(lambda: cached(kind), labels_loss, _batch(0, 0), cfg, world_size=1)
    meas = min(real["steps"][1:])
    assert abs(pred - meas) <= 0.02 * meas, (pred, meas)
