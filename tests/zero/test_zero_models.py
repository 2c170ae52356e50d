"""ZeRO stages 0-3 on awkward models (2 gloo ranks, fp32): parameter sizes not divisible
by the world size, frozen parameters, tied weights, a block called twice, a block never
called (its unit gets no gradient), a Hugging Face-style model; and ranks that build
different models.

Metric: as in test_zero.py, SGD with momentum against the reference within 1e-6
(per tensor, relative), AdamW against the reference that sums in the stage's own
order (stages 2/3 reduce per micro-batch) within 1e-6.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mct.config import EngineConfig
from mct.engine import Engine
from mct.models.gpt import GPT, gpt_loss
from tests.distributed import run_distributed
from tests.helpers import (TINY_MODEL, adamw, engine_run, max_rel_diff, reference_run, sgd_momentum, shared_work,
                           tiny_config)

STEPS = 4
N_MICRO = 2
VOCAB = 256  # tests.helpers.batches draws token ids below 256


class OddBlock(nn.Module):
    """13-wide: every parameter's size is odd, so no unit splits evenly over ranks."""

    def __init__(self, d: int = 13) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.ln(x)))


class OddModel(nn.Module):
    """Odd sizes, a tied head, optionally a frozen block parameter and a frozen root
    parameter, optionally block 0 called twice in one forward, optionally the last
    block never called (its parameters get no gradient: the optimizer must still
    see zeros, so weight decay and momentum act on them as in the reference)."""

    def __init__(self, *, frozen: bool = False, tied: bool = False, twice: bool = False, unused: bool = False,
                 d: int = 13) -> None:
        super().__init__()
        self.twice, self.unused = twice, unused
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(OddBlock(d) for _ in range(3))
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.gain = nn.Parameter(torch.full((d,), 1.5), requires_grad=not frozen)
        if tied:
            self.head.weight = self.emb.weight
        if frozen:
            self.blocks[1].fc.bias.requires_grad_(False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for i, block in enumerate(self.blocks):
            if self.unused and i == len(self.blocks) - 1:
                continue
            x = block(x)
            if self.twice and i == 0:
                x = block(x)  # the same module again: its gradients sum over both uses
        return self.head(x * self.gain)


class HFStyleLayer(nn.Module):
    """A decoder layer called the Hugging Face way: keyword arguments, tuple output."""

    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.input_layernorm = nn.LayerNorm(d)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))
        self.post_attention_layernorm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                output_attentions: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T, C = hidden_states.shape
        h = self.input_layernorm(hidden_states)
        q, k, v = (p(h).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = q @ k.transpose(-1, -2) / (C // self.n_head) ** 0.5 + attention_mask
        weights = scores.softmax(-1)
        y = (weights @ v).transpose(1, 2).reshape(B, T, C)
        hidden_states = hidden_states + self.o_proj(y)
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, (weights if output_attentions else None)


class HFStyleModel(nn.Module):
    """Tied embeddings, a registered position-id buffer, an additive attention mask."""

    def __init__(self, d: int = 24, n_head: int = 2, n_layer: int = 2, seq_len: int = 16) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, d)
        self.embed_positions = nn.Embedding(seq_len, d)
        self.register_buffer("position_ids", torch.arange(seq_len), persistent=False)
        self.layers = nn.ModuleList(HFStyleLayer(d, n_head) for _ in range(n_layer))
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[1]
        h = self.embed_tokens(input_ids) + self.embed_positions(self.position_ids[:T])
        causal = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()
        keep = causal[None, None] & attention_mask.bool()[:, None, None, :]
        mask = torch.zeros(keep.shape, dtype=h.dtype, device=h.device).masked_fill(~keep, float("-inf"))
        for layer in self.layers:
            h = layer(h, attention_mask=mask, output_attentions=False)[0]
        return self.lm_head(self.norm(h))


def hf_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Padding mask from the tokens (position 0 always kept, so no row is all -inf)."""
    x, y = batch
    attention_mask = (x % 5 != 0).long()
    attention_mask[:, 0] = 1
    logits = model(x, attention_mask=attention_mask)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))


MODELS = {
    "non_divisible": lambda: OddModel(),
    "frozen": lambda: OddModel(frozen=True),
    "tied": lambda: OddModel(tied=True),
    "block_twice": lambda: OddModel(twice=True),
    "unused_block": lambda: OddModel(unused=True),
}
OPTIMIZERS = {"adamw": adamw, "sgd": sgd_momentum}


def _compare(rank: int, world: int, model_fn, loss_fn, stages, policy: str) -> dict:
    cfg0 = tiny_config(train={"grad_clip": 1.0}, memory={"track": False})
    refs = shared_work(rank, world, {
        (o, order): (lambda opt=opt, order=order:
                     reference_run(cfg0, world, STEPS, opt, N_MICRO, model_fn, loss_fn, order=order)[1])
        for o, opt in OPTIMIZERS.items() for order in ("rank", "micro")})
    out = {}
    for stage in stages:
        cfg = tiny_config(train={"grad_clip": 1.0}, zero={"stage": stage}, checkpointing={"policy": policy},
                          memory={"track": False})
        for o, opt in OPTIMIZERS.items():
            _, state, _, _ = engine_run(cfg, rank, STEPS, opt, N_MICRO, model_fn, loss_fn)
            if refs is not None:
                order = "micro" if stage >= 2 else "rank"
                out[(stage, o)] = {"rank_ref": max_rel_diff(state, refs[(o, "rank")]),
                                   "order_ref": max_rel_diff(state, refs[(o, order)])}
    return out


def _mismatch(rank: int, world: int, variant: str) -> tuple[str, float]:
    """Rank 1 builds a different GPT; returns (the error message, seconds to raise)."""
    model_cfg = dict(TINY_MODEL)
    if rank == 1 and variant == "extra_layer":
        model_cfg["n_layer"] += 1
    if rank == 1 and variant == "shape":
        model_cfg["seq_len"] = 32  # wpe.weight is [32, d] here, [16, d] on rank 0
    cfg = EngineConfig.from_dict({"model": model_cfg})
    model = GPT(cfg.model)
    t0 = time.perf_counter()
    try:
        Engine(model, adamw, tiny_config())
    except ValueError as e:
        return str(e), time.perf_counter() - t0
    return "", time.perf_counter() - t0


def _all_checks(rank: int, world: int) -> dict:
    out = {name: _compare(rank, world, fn, gpt_loss, (0, 1, 2, 3), "none") for name, fn in MODELS.items()}
    out["hf_style"] = _compare(rank, world, HFStyleModel, hf_loss, (3,), "all")
    for name in ("tied", "block_twice"):
        out[f"{name}_ckpt_all"] = _compare(rank, world, MODELS[name], gpt_loss, (3,), "all")
    out["mismatch"] = {v: _mismatch(rank, world, v) for v in ("extra_layer", "shape")}
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_all_checks, 2)


def _assert_parity(per_stage: dict) -> None:
    for (stage, opt), r in per_stage.items():
        if opt == "sgd":
            assert r["rank_ref"][0] <= 1e-6, (stage, opt, r)
        assert r["order_ref"][0] <= 1e-6, (stage, opt, r)


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(MODELS))
def test_awkward_model_trains_like_the_reference_at_every_stage(results, name):
    per_stage = results[0][name]
    assert sorted(per_stage) == [(s, o) for s in range(4) for o in sorted(OPTIMIZERS)]
    _assert_parity(per_stage)


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["tied", "block_twice"])
def test_tied_weight_and_block_called_twice_survive_stage3_recompute(results, name):
    per_stage = results[0][f"{name}_ckpt_all"]
    assert sorted(per_stage) == [(3, "adamw"), (3, "sgd")]
    _assert_parity(per_stage)


@pytest.mark.multirank
def test_hf_style_model_trains_like_the_reference_at_stage3_with_checkpointing(results):
    per_stage = results[0]["hf_style"]
    assert sorted(per_stage) == [(3, "adamw"), (3, "sgd")]
    _assert_parity(per_stage)


@pytest.mark.multirank
@pytest.mark.parametrize("variant,first", [("extra_layer", "blocks.2."), ("shape", "wpe.weight")])
def test_ranks_with_different_models_fail_fast_naming_the_first_mismatch(results, variant, first):
    for rank, r in enumerate(results):
        message, seconds = r["mismatch"][variant]
        assert "ranks disagree" in message and first in message, (rank, message)
        assert seconds < 30, (rank, seconds)
