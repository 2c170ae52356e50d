"""Context parallelism is exact: degree 2 and 3 (real gloo groups) give the loss and the
gradients of degree 1 within 1e-6 in fp32, for the built-in GPT and a transformers Llama,
with and without packed documents (documents crossing the split points), at ZeRO stages
0 and 3, with all-to-all, all-gather and ring attention, with recompute."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mct.config import EngineConfig
from mct.data.packing import pack_window
from mct.dist import DistContext
from mct.engine import Engine
from mct.models.gpt import GPT
from mct.task.tokens import token_loss
from tests.distributed import run_distributed

T, VOCAB, B, LR = 24, 97, 2, 0.5


def tiny_llama() -> torch.nn.Module:
    """4 query heads over 2 key/value heads: both attentions at degree 2, the gather at degree 3."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging
    logging.set_verbosity_error()
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=40, vocab_size=VOCAB, max_position_embeddings=T, use_cache=False,
                      attn_implementation="sdpa", tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def window(step: int, packed: bool) -> tuple[torch.Tensor, ...]:
    """One window per row, the same on every rank; packed: documents of 1-9 tokens, so
    every split point of degrees 2 and 3 falls inside some document."""
    rng = np.random.default_rng(step)
    tokens = rng.integers(0, VOCAB, size=(B, T + 1))
    if not packed:
        t = torch.from_numpy(tokens)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()
    docs = np.cumsum(rng.integers(1, 10, size=(B, T + 1)) == 1, axis=1)
    return pack_window(tokens, docs)


def config(degree: int, stage: int, attention: str, policy: str, model: str) -> EngineConfig:
    model_keys = ({"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": T, "vocab_size": VOCAB}
                  if model == "gpt" else {"seq_len": T, "source": "tests.context.test_context_parity:tiny_llama"})
    return EngineConfig.from_dict({"model": model_keys, "zero": {"stage": stage}, "train": {"grad_clip": 0.0},
                                   "checkpointing": {"policy": policy},
                                   "parallel": {"context": degree, "context_attention": attention}})


def train(cfg: EngineConfig, model_name: str, packed: bool, ctx: DistContext | None = None
          ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Two SGD steps; returns the losses and the first step's gradients (from the update)."""
    torch.manual_seed(0)
    model = GPT(cfg.model) if model_name == "gpt" else tiny_llama()
    engine = Engine(model, lambda groups: torch.optim.SGD(groups, lr=LR), cfg, ctx=ctx)
    before = engine.full_state_dict()
    losses = [engine.train_step(window(0, packed), token_loss).loss]
    after = engine.full_state_dict()
    losses.append(engine.train_step(window(1, packed), token_loss).loss)
    losses.append(engine.eval_loss(window(2, packed), token_loss))
    return losses, {k: (before[k] - after[k]) / LR for k in before}


CASES = [("gpt", False, 0, "all_to_all", "none"), ("gpt", True, 0, "all_gather", "all"),
         ("gpt", True, 3, "all_to_all", "none"), ("llama", False, 3, "all_to_all", "all"),
         ("llama", True, 0, "auto", "none"), ("llama", True, 3, "all_to_all", "none"),
         ("gpt", True, 3, "ring", "all"), ("llama", True, 0, "ring", "none"), ("llama", False, 3, "ring", "all")]
"""(model, packed, stage, attention at degree 2, checkpointing policy); at degree 3 the heads
(2; 4 and 2) do not divide, and every case but the ring's runs the gather."""


def _worst_differences(rank: int, world: int) -> dict:
    """Every case at degree ``world`` on this group; rank 0 also runs degree 1 alone and
    returns each case's worst loss and gradient differences."""
    out = {}
    for model_name, packed, stage, attention, policy in CASES:
        if world == 3 and attention != "ring":
            attention = "all_gather"
        losses, grads = train(config(world, stage, attention, policy, model_name), model_name, packed)
        if rank == 0:
            ref_losses, ref_grads = train(config(1, stage, "auto", policy, model_name), model_name, packed,
                                          ctx=DistContext())
            out[(model_name, packed, stage, attention, policy)] = (
                max(abs(a - b) for a, b in zip(losses, ref_losses)),
                max(float((grads[k] - ref_grads[k]).abs().max()) for k in ref_grads))
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("degree", [2, 3])
def test_context_parallel_matches_degree_one_fp32(degree):
    worst = run_distributed(_worst_differences, degree, timeout=300)[0]
    for case, (loss_diff, grad_diff) in worst.items():
        assert loss_diff < 1e-6 and grad_diff < 1e-6, (case, loss_diff, grad_diff)


def _measured_and_predicted(rank: int, world: int) -> dict:
    """The second step's tracked peak of this rank, and (rank 0) the planner's prediction."""
    from mct.planner import predict_peak
    out = {}
    for model_name, stage, attention in (("gpt", 0, "auto"), ("llama", 3, "auto"), ("gpt", 0, "ring"),
                                         ("llama", 3, "ring")):
        cfg = config(world, stage, attention, "none", model_name)
        torch.manual_seed(0)
        model_fn = (lambda: GPT(cfg.model)) if model_name == "gpt" else tiny_llama
        engine = Engine(model_fn(), lambda groups: torch.optim.SGD(groups, lr=LR), cfg)
        peaks = [engine.train_step(window(s, True), token_loss).metrics["peak_bytes"] for s in range(2)]
        predicted = (predict_peak(model_fn, token_loss, window(0, True), cfg, world_size=world,
                                  optimizer=lambda groups: torch.optim.SGD(groups, lr=LR)) if rank == 0 else None)
        out[model_name, attention] = (peaks[-1], predicted)
    return out


@pytest.mark.multirank
def test_planner_predicts_the_context_parallel_peak():
    measured = run_distributed(_measured_and_predicted, 2, timeout=300)[0]
    for name, (peak, predicted) in measured.items():
        # equal when run alone; once, in the whole suite on a loaded machine, the gather's GPT row
        # measured 9,216 B (2.2%) above (a [48, 48] fp32 buffer alive at the peak): 3% for those rows
        assert abs(predicted - peak) <= 0.03 * peak, (name, peak, predicted)
        if name[1] == "ring":  # the ring's buffers (its own block, the one in flight) simulated alike
            assert predicted == peak, (name, peak, predicted)


def _ignored_middle(rank: int, world: int) -> tuple:
    """Degree 2, a window whose middle half (rank 1's chunks 1 and 2) has no counted target:
    rank 1's share is 0, not nan; losses and gradients still those of degree 1."""
    from mct.context.parallel import IGNORE_INDEX
    x, y = window(0, False)
    y = y.clone()
    y[:, T // 4:3 * T // 4] = IGNORE_INDEX
    cfg = config(world, 0, "all_gather", "none", "gpt")

    def run(c, ctx=None):
        torch.manual_seed(0)
        engine = Engine(GPT(c.model), lambda groups: torch.optim.SGD(groups, lr=LR), c, ctx=ctx)
        before = engine.full_state_dict()
        loss = engine.train_step((x, y), token_loss).loss
        after = engine.full_state_dict()
        return loss, {k: (before[k] - after[k]) / LR for k in before}
    loss, grads = run(cfg)
    if rank:
        return None
    ref_loss, ref_grads = run(config(1, 0, "auto", "none", "gpt"), DistContext())
    return loss, ref_loss, max(float((grads[k] - ref_grads[k]).abs().max()) for k in ref_grads)


@pytest.mark.multirank
def test_a_rank_without_counted_targets_adds_nothing_rather_than_nan():
    loss, ref_loss, grad_diff = run_distributed(_ignored_middle, 2, timeout=300)[0]
    assert abs(loss - ref_loss) < 1e-6 and grad_diff < 1e-6, (loss, ref_loss, grad_diff)


def _composed(rank: int, world: int, offload_dir: str) -> dict | None:
    """LoRA adapters, the chunked loss (through the task's own loss) and activation offload to
    disk with recompute, at stage 3, packed documents: degree ``world`` against degree 1."""
    from mct.task import build_model, task_for

    def run(degree: int, ctx: DistContext | None = None):
        cfg = EngineConfig.from_dict({
            "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": T, "vocab_size": VOCAB},
            "zero": {"stage": 3}, "train": {"grad_clip": 0.0, "loss_chunk_tokens": 8},
            "checkpointing": {"policy": "all", "offload": "disk"}, "offload": {"dir": f"{offload_dir}/{degree}"},
            "adapter": {"kind": "lora", "rank": 4}, "parallel": {"context": degree, "context_attention": "all_gather"}})
        task = task_for(cfg)
        model, _ = build_model(task, cfg, on_meta=False)
        engine = Engine(model, lambda groups: torch.optim.SGD(groups, lr=LR), cfg, ctx=ctx)
        losses = [engine.train_step(window(s, True), task.loss_fn).loss for s in range(3)]
        return losses, engine.full_state_dict()
    losses, state = run(world)
    if rank:
        return None
    ref_losses, ref_state = run(1, DistContext())
    return {"loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "param": max(float((state[k] - ref_state[k]).abs().max()) for k in ref_state),
            "trained": min(float(v.abs().max()) for k, v in state.items() if "lora_B" in k)}


@pytest.mark.multirank
def test_context_parallel_composes_with_adapters_chunked_loss_and_activation_offload(tmp_path):
    out = run_distributed(_composed, 2, str(tmp_path), timeout=300)[0]
    assert out["loss"] < 1e-6 and out["param"] < 1e-6, out
    assert out["trained"] > 0, out  # every adapter's B moved off zero: the adapters did train


def _ring_with_and_without_recompute(rank: int, world: int) -> tuple:
    """The ring at degree ``world``, packed GPT, every block recomputed or none: (the two
    runs' losses, the names of the gradients that differ in any bit)."""
    (losses, grads), (re_losses, re_grads) = (train(config(world, 0, "ring", policy, "gpt"), "gpt", True)
                                              for policy in ("none", "all"))
    return losses, re_losses, [k for k in grads if not torch.equal(grads[k], re_grads[k])]


@pytest.mark.multirank
def test_recompute_reruns_the_ring_with_the_same_bits():
    losses, re_losses, differ = run_distributed(_ring_with_and_without_recompute, 2, timeout=300)[0]
    assert losses == re_losses and not differ, (losses, re_losses, differ)
