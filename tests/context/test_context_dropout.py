"""Dropout under context parallelism draws degree 1's masks: with dropout > 0, degree 2
(real gloo groups) gives the losses and gradients of degree 1 within 1e-6 in fp32, for the
built-in GPT (embedding, attention and residual dropout) with both attentions, packed and
with recompute, and for a transformers Llama's attention dropout; and a rank's share of a
whole-window draw is the rows of degree 1's mask it holds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mct.config import EngineConfig
from mct.context.dropout import WindowDropout
from mct.context.layout import shard_batch
from mct.dist import DistContext
from mct.engine import Engine
from mct.models.gpt import GPT
from mct.task.seeding import seeded
from mct.task.tokens import token_loss
from tests.context.test_context_parity import LR, T, VOCAB, window
from tests.distributed import run_distributed

P = 0.25


def dropout_llama(attention_dropout: float = P) -> torch.nn.Module:
    """The parity test's tiny Llama (4 query, 2 key/value heads) with attention dropout."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging
    logging.set_verbosity_error()
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=40, vocab_size=VOCAB, max_position_embeddings=T, use_cache=False,
                      attn_implementation="sdpa", tie_word_embeddings=False, attention_dropout=attention_dropout)
    return LlamaForCausalLM(cfg)


def config(degree: int, attention: str, policy: str, model: str, dropout: float = P) -> EngineConfig:
    model_keys = ({"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": T, "vocab_size": VOCAB, "dropout": dropout}
                  if model == "gpt" else {"seq_len": T, "source": "tests.context.test_context_dropout:dropout_llama"})
    return EngineConfig.from_dict({"model": model_keys, "zero": {"stage": 0}, "train": {"grad_clip": 0.0},
                                   "checkpointing": {"policy": policy},
                                   "parallel": {"context": degree, "context_attention": attention}})


def train(cfg: EngineConfig, model_name: str, packed: bool, ctx: DistContext | None = None, dropout: float = P
          ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Two SGD steps with dropout (each micro-batch seeded, as the trainer seeds it; the
    Llama's attention dropout ``dropout``, the GPT's the config's); the losses and the first
    step's gradients."""
    torch.manual_seed(0)
    model = GPT(cfg.model) if model_name == "gpt" else dropout_llama(dropout)
    engine = Engine(model, lambda groups: torch.optim.SGD(groups, lr=LR), cfg, ctx=ctx)
    loss_fn = seeded(token_loss)
    before = engine.full_state_dict()
    losses = [engine.train_step((*window(0, packed), 11), loss_fn).loss]
    after = engine.full_state_dict()
    losses.append(engine.train_step((*window(1, packed), 12), loss_fn).loss)
    return losses, {k: (before[k] - after[k]) / LR for k in before}


CASES = [("gpt", False, "all_gather", "none"), ("gpt", True, "all_to_all", "all"), ("gpt", True, "all_gather", "all"),
         ("llama", True, "all_gather", "none"), ("llama", False, "all_to_all", "all")]
"""(model, packed, attention, checkpointing policy) at degree 2."""


def _worst_differences(rank: int, world: int) -> dict:
    out = {}
    for model_name, packed, attention, policy in CASES:
        losses, grads = train(config(world, attention, policy, model_name), model_name, packed)
        if rank == 0:
            ref_losses, ref_grads = train(config(1, "auto", policy, model_name), model_name, packed,
                                          ctx=DistContext())
            _, plain = train(config(1, "auto", policy, model_name, dropout=0.0), model_name, packed, ctx=DistContext(),
                             dropout=0.0)
            out[(model_name, packed, attention, policy)] = (
                max(abs(a - b) for a, b in zip(losses, ref_losses)),
                max(float((grads[k] - ref_grads[k]).abs().max()) for k in ref_grads),
                max(float((plain[k] - ref_grads[k]).abs().max()) for k in ref_grads))
    return out


@pytest.mark.multirank
def test_degree_2_with_dropout_draws_degree_1s_masks_fp32():
    worst = run_distributed(_worst_differences, 2, timeout=300)[0]
    for case, (loss_diff, grad_diff, dropout_effect) in worst.items():
        assert loss_diff < 1e-6 and grad_diff < 1e-6, (case, loss_diff, grad_diff)
        assert dropout_effect > 1e-3, (case, dropout_effect)  # the dropout did drop: not a 0 = 0 pass


def test_each_rank_keeps_its_tokens_rows_of_degree_1s_whole_window_mask():
    x = torch.randn(2, 8, 4)
    batch = (torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    torch.manual_seed(3)
    whole = F.dropout(x, P)
    parts = torch.empty_like(x)
    for rank in range(2):
        _, shard = shard_batch(batch, 2, rank)
        torch.manual_seed(3)
        parts[:, shard.index] = WindowDropout(P, lambda: shard)(x[:, shard.index])
    assert torch.equal(parts, whole)
