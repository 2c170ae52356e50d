"""Chunked linear cross-entropy (``train.loss_chunk_tokens``): the unchunked loss and
gradients to 1e-6 relative in fp32 (the built-in GPT, HF Llama untied, HF GPT-2 tied;
ZeRO stages 0-3 on 2 gloo ranks), no [tokens, vocab] tensor ever allocated, bf16
tracking fp32, the planner's prediction of its smaller peak within 2% of a measured run,
and one-line errors for models whose head cannot be chunked."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import mct
from mct.config import EngineConfig
from mct.engine import Engine
from mct.models.gpt import GPT, gpt_loss
from mct.task import chunked_token_loss, linear_cross_entropy
from mct.task.tokens import causal_lm_loss, loss_for
from tests.distributed import run_distributed
from tests.helpers import TINY_MODEL, batches, max_rel_diff

V, C = 256, 32


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _inputs(n: int, dtype=torch.float32, bias: bool = False):
    g = torch.Generator().manual_seed(n)
    h = torch.randn(n, C, generator=g, dtype=dtype).requires_grad_()
    w = (0.3 * torch.randn(V, C, generator=g, dtype=dtype)).requires_grad_()
    b = torch.randn(V, generator=g, dtype=dtype).requires_grad_() if bias else None
    y = torch.randint(0, V, (n,), generator=g)
    y[::7] = -100  # ignored tokens do not count in the mean
    return h, w, b, y


def _grads(loss: torch.Tensor, *tensors) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, [t for t in tensors if t is not None]))


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_cross_entropy_equals_the_unchunked_loss_and_gradients_fp32(chunk):
    h, w, b, y = _inputs(61, bias=True)
    ref = F.cross_entropy(F.linear(h, w, b), y)
    got = linear_cross_entropy(h, w, b, y, chunk)
    assert abs(float(got) - float(ref)) <= 1e-6 * abs(float(ref))
    for g, r in zip(_grads(got, h, w, b), _grads(ref, h, w, b)):
        assert float((g - r).norm() / r.norm()) <= 1e-6


def test_chunked_cross_entropy_passes_gradcheck_in_float64():
    g = torch.Generator().manual_seed(0)
    h, w, b = (torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_() for shape in ((9, 4), (11, 4), (11,)))
    y = torch.randint(0, 11, (9,), generator=g)
    y[2] = -100
    assert torch.autograd.gradcheck(lambda h, w, b: linear_cross_entropy(h, w, b, y, 4), (h, w, b))


def test_no_tensor_of_tokens_x_vocab_exists_in_forward_or_backward():
    h, w, _, y = _inputs(256)
    with LargestTensor() as mode:
        loss = linear_cross_entropy(h, w, None, y, 32)
        loss.backward()
    assert mode.largest <= 32 * V < 256 * V, mode.largest
    with LargestTensor() as unchunked:
        F.cross_entropy(h @ w.t(), y).backward()
    assert unchunked.largest == 256 * V  # the count sees the logits when they exist


def test_bf16_autocast_tracks_fp32_and_all_ignored_is_nan_as_unchunked():
    h, w, _, y = _inputs(40)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(h, w, None, y, 8)
        ref = F.cross_entropy((h @ w.t()).float(), y)
    assert got.dtype == torch.float32 and abs(float(got) - float(ref)) <= 2e-2 * float(ref)
    gh, gw = _grads(got, h, w)
    assert gh.dtype == h.dtype and gw.dtype == w.dtype
    rh, rw = _grads(F.cross_entropy(h @ w.t(), y), h, w)
    assert float((gw - rw).norm() / rw.norm()) <= 2e-2
    none = torch.full_like(y, -100)
    assert torch.isnan(linear_cross_entropy(h, w, None, none, 8)) and torch.isnan(F.cross_entropy(h @ w.t(), none))


# ---- through the engine: GPT, HF Llama (untied), HF GPT-2 (tied), stages 0-3 ----

def _hf(kind: str) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging
    logging.set_verbosity_error()
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=C, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                            tie_word_embeddings=False))
    return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=32, n_embd=C, n_layer=2, n_head=2, bos_token_id=0,
                                      eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return GPT(EngineConfig.from_dict({"model": TINY_MODEL}).model) if kind == "gpt" else _hf(kind)


def _grad_of_one_step(kind: str, stage: int, chunk: int, rank: int, policy: str = "none",
                      mode: str = "fp32", offload: dict | None = None) -> tuple[float, dict[str, torch.Tensor]]:
    """(loss, gradient) of one step: SGD with lr 1, so old - new parameters = gradient."""
    cfg = EngineConfig.from_dict({"zero": {"stage": stage}, "checkpointing": {"policy": policy},
                                  "precision": {"mode": mode}, "train": {"loss_chunk_tokens": chunk},
                                  "offload": offload or {}})
    loss_fn = loss_for(cfg, gpt_loss if kind == "gpt" else causal_lm_loss)
    engine = Engine(_model(kind), lambda g: torch.optim.SGD(g, lr=1.0), cfg)
    before = engine.full_state_dict()
    out = engine.train_step(batches(0, rank, B=2, T=16)[0], loss_fn)
    after = engine.full_state_dict()
    return out.loss, {k: before[k] - after[k] for k in before}


def _global_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over every tensor at once (the whole gradient)."""
    diff = sum(float((a[k].double() - b[k].double()).square().sum()) for k in b)
    return (diff / sum(float(b[k].double().square().sum()) for k in b)) ** 0.5


def _chunked_vs_unchunked(rank: int, world: int) -> list:
    rows = []
    for kind in ("gpt", "llama", "gpt2"):
        for stage in (0, 1, 2, 3):
            ref_loss, ref = _grad_of_one_step(kind, stage, 0, rank)
            loss, grad = _grad_of_one_step(kind, stage, 5, rank)  # 32 tokens per rank: 7 chunks, one short
            rows.append((kind, stage, abs(loss - ref_loss) / ref_loss, _global_rel(grad, ref),
                         *max_rel_diff(grad, ref)))
    return rows


@pytest.mark.multirank
def test_chunked_loss_equals_unchunked_through_the_engine_every_stage_two_ranks():
    """The whole gradient within 1e-6; single tensors within 1e-5 (a small gradient
    behind the attention softmax, e.g. a 2-layer Llama's last q_proj, carries the
    loss's last-bit rounding differences 10x amplified)."""
    pytest.importorskip("transformers")
    for kind, stage, loss_rel, grad_rel, worst, name in run_distributed(_chunked_vs_unchunked, 2, timeout=900)[0]:
        assert loss_rel <= 1e-6 and grad_rel <= 1e-6 and worst <= 1e-5, (kind, stage, loss_rel, grad_rel, worst, name)


@pytest.mark.parametrize("kind,mode", [("gpt", "bf16"), ("llama", "bf16"), ("gpt", "fp16")])
def test_chunked_loss_low_precision_and_checkpointing_track_fp32(kind, mode):
    pytest.importorskip("transformers")
    ref_loss, ref = _grad_of_one_step(kind, 0, 0, 0)
    loss, grad = _grad_of_one_step(kind, 0, 8, 0, policy="selective", mode=mode)
    rel, name = max_rel_diff(grad, ref)
    assert abs(loss - ref_loss) <= 2e-2 * ref_loss and rel <= 5e-2, (loss, ref_loss, rel, name)


def test_chunked_loss_with_offloaded_parameters_at_stage_3_equals_unchunked():
    ref_loss, ref = _grad_of_one_step("gpt", 3, 0, 0, policy="all", offload={"optimizer": "cpu", "params": "cpu"})
    loss, grad = _grad_of_one_step("gpt", 3, 5, 0, policy="all", offload={"optimizer": "cpu", "params": "cpu"})
    assert abs(loss - ref_loss) <= 1e-6 * ref_loss and _global_rel(grad, ref) <= 1e-6


def test_planner_predicts_the_chunked_peak_within_2_percent_and_below_the_unchunked():
    from mct.planner import dry_run
    from tests.storage_count import measure
    backward = {}
    for chunk in (0, 32):
        cfg = EngineConfig.from_dict({"model": {**TINY_MODEL, "vocab_size": 4096, "seq_len": 64},
                                      "train": {"loss_chunk_tokens": chunk}})
        loss_fn = loss_for(cfg, gpt_loss)
        batch_fn = lambda s, r: batches(s, r, B=4, T=64)[0]  # noqa: E731
        real = measure(lambda: GPT(cfg.model), loss_fn, batch_fn, cfg, 0, steps=3)
        pred = mct.predict_peak(lambda: GPT(cfg.model), loss_fn, batch_fn(0, 0), cfg, world_size=1)
        meas = min(real["steps"][1:])
        assert abs(pred - meas) <= 0.02 * meas, (chunk, pred, meas)
        run = dry_run(lambda: GPT(cfg.model), loss_fn, batch_fn(0, 0), cfg, 1)
        backward[chunk] = max(run.phases[p]["total"] for p in ("forward", "backward"))
    logits = 4 * 64 * 4096 * 4  # fp32 [tokens, vocab]
    assert backward[0] - backward[32] >= 1.5 * logits, (backward, logits)  # the logits and their gradient


class _Softcapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, C)
        self.lm_head = nn.Linear(C, V, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 30.0 * torch.tanh(self.lm_head(self.embed(x)) / 30.0)


class _Headless(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(C, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.zeros(*x.shape, C))


def test_models_whose_head_cannot_be_chunked_are_one_line_errors():
    x, y = batches(0, 0, B=2, T=8)[0]
    loss = chunked_token_loss(4)
    with pytest.raises(ValueError, match="transformed after it"):
        loss(_Softcapped(), (x, y))
    with pytest.raises(ValueError, match="exposes its output head"):
        loss(_Headless(), (x, y))
    with pytest.raises(ValueError, match="train.loss_chunk_tokens"):
        EngineConfig.from_dict({"train": {"loss_chunk_tokens": -1}})


def test_plan_has_loss_chunking_rows_and_auto_chooses_it_when_nothing_fits_without():
    from mct.planner import Grid, make_plan, resolve_auto
    from mct.task import gpt_task
    cfg = EngineConfig.from_dict({"model": {**TINY_MODEL, "vocab_size": 4096, "seq_len": 64},
                                  "data": {"micro_batch_size": 4}})
    grid = Grid((0,), ("none",), ("fp32",), loss_chunks=(0, 32))
    plan = make_plan(gpt_task(cfg), cfg, 1, None, grid)
    off, on = plan.rows
    assert (off["loss_chunk_tokens"], on["loss_chunk_tokens"]) == (0, 32)
    assert off["peak"] - on["peak"] >= 1.5 * 4 * 64 * 4096 * 4 and on["cost"] > off["cost"]
    budget = (off["peak"] + on["peak"]) // 2
    auto = EngineConfig.from_dict({**cfg.to_dict(), "zero": {"stage": "auto"}, "memory": {"budget": str(budget),
                                                                                    "budget_counts": "tensors"}})
    resolved, choice = resolve_auto(auto, 1, gpt_task(auto))
    assert resolved.train.loss_chunk_tokens > 0 and choice["train.loss_chunk_tokens"] > 0
    assert choice["predicted_peak_bytes"] <= budget
    with pytest.raises(ValueError, match="own loss_fn"):
        from dataclasses import replace
        make_plan(replace(gpt_task(cfg), loss_for_chunk=None), cfg, 1, None, grid)


class _ConfiguredLM(nn.Module):
    """A user's token model that keeps a ``config`` attribute but takes ids positionally."""

    def __init__(self) -> None:
        super().__init__()
        self.config = {"vocab": V}
        self.wte, self.head = nn.Embedding(V, C), nn.Linear(C, V, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.wte(idx))

    def get_output_embeddings(self) -> nn.Module:
        return self.head


def test_a_users_model_with_a_config_attribute_is_called_as_in_training():
    from mct.task.sample import _logits
    torch.manual_seed(0)
    model, x = _ConfiguredLM(), torch.randint(0, V, (1, 8))
    assert torch.equal(_logits(model, x), model(x)[0, -1])  # as model(x), not model(input_ids=..., use_cache=...)
    y = torch.randint(0, V, (1, 8))
    chunked, full = chunked_token_loss(3)(model, (x, y)), F.cross_entropy(model(x)[0], y[0])
    assert abs(chunked.item() - full.item()) <= 1e-6 * abs(full.item())
