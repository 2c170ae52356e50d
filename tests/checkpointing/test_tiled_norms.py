"""Token-tiled RMSNorm (with ``checkpointing.mlp_tile_tokens``): the forward bit-identical to
the module's own, the gradients to 1e-6 relative in fp32, only standard RMSNorms tiled, the
fp32 temporaries gone from the backward peak (bytes), the dry run equal to a real tracked
run, and ``mct verify`` passing."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn

pytest.importorskip("transformers")

from mct.checkpointing import apply as apply_module  # noqa: E402
from mct.checkpointing.norms import TiledNorms, find_rms_norms, is_standard_rms_norm  # noqa: E402
from mct.config import EngineConfig  # noqa: E402
from mct.engine import Engine  # noqa: E402
from mct.planner import dry_run  # noqa: E402
from mct.task.tokens import causal_lm_loss  # noqa: E402
from tests.helpers import batches  # noqa: E402


def _llama(layers: int = 2, hidden: int = 32, vocab: int = 256) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging
    logging.set_verbosity_error()
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=88,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=256, tie_word_embeddings=False, use_cache=False))


def _norm(hidden: int, w_dtype: torch.dtype) -> nn.Module:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    norm = LlamaRMSNorm(hidden, eps=1e-5).to(w_dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden) * 0.5 + 1)
    return norm


def _run(norm: nn.Module, x: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, input gradient, weight gradient) of sum(out * fixed random) through ``norm``,
    tiled when ``tile`` > 0."""
    tiled = TiledNorms(tile) if tile else None
    if tiled is not None:
        tiled.install([("norm", norm)])
    x = x.detach().requires_grad_()
    norm.weight.grad = None
    out = norm(x)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(g)
    if tiled is not None:
        tiled.remove()
    return out.detach(), x.grad, norm.weight.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_tiled_rms_norm_forward_is_bit_identical_and_fp32_gradients_match(x_dtype, w_dtype):
    """37 tokens x 2 in tiles of 7 (the last short). fp32: gradients to 1e-6 relative; with
    a bf16 input or weight the module's own backward rounds its products to bf16 where the
    tiles sum in fp32: they agree to bf16's precision."""
    torch.manual_seed(0)
    norm = _norm(64, w_dtype)
    x = (torch.randn(2, 37, 64) * 3).to(x_dtype)
    ref_out, ref_gx, ref_gw = _run(norm, x, 0)
    out, gx, gw = _run(norm, x, 7)
    assert out.dtype == ref_out.dtype and torch.equal(out, ref_out)
    assert gx.dtype == ref_gx.dtype and gw.dtype == ref_gw.dtype
    tol = 1e-6 if x_dtype == w_dtype == torch.float32 else 1e-2
    assert _rel(gx, ref_gx) <= tol and _rel(gw, ref_gw) <= tol, (_rel(gx, ref_gx), _rel(gw, ref_gw))
    assert "forward" not in norm.__dict__


def test_tiled_rms_norm_under_autocast_is_bit_identical():
    norm = _norm(32, torch.float32)
    x = torch.randn(3, 20, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, got = _run(norm, x, 0)[0], _run(norm, x, 6)[0]
    assert torch.equal(got, ref)


class _ScaledNorm(nn.Module):
    """RMSNorm-shaped, another formula (the weight plus one, as Gemma's)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(8))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return ((1 + self.weight) * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def test_only_standard_rms_norms_are_tiled():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm
    assert [n for n, _ in find_rms_norms(_llama())] == [
        "model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
        "model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm", "model.norm"]
    assert is_standard_rms_norm(Qwen2RMSNorm(8))
    for other in (GemmaRMSNorm(8), T5LayerNorm(8), nn.RMSNorm(8), nn.LayerNorm(8), _ScaledNorm(), nn.Linear(8, 8)):
        assert not is_standard_rms_norm(other), other


def _engine_step(tile: int, norms: bool, monkeypatch, stage: int = 3, mode: str = "fp32") -> dict:
    """One tracked step of a 2-layer Llama, 2 x 128 tokens; ``norms=False``: the MLP alone tiled."""
    if not norms:
        monkeypatch.setattr(apply_module, "find_rms_norms", lambda model: [])
    cfg = EngineConfig.from_dict({"zero": {"stage": stage}, "precision": {"mode": mode},
                                  "checkpointing": {"policy": "all", "mlp_tile_tokens": tile}})
    torch.manual_seed(0)
    engine = Engine(_llama(hidden=64, vocab=64), lambda g: torch.optim.SGD(g, lr=1.0), cfg)
    out = engine.train_step(tuple(t % 64 for t in batches(0, 0, B=2, T=128)[0]), causal_lm_loss)
    engine.close()
    monkeypatch.undo()
    return out.metrics


def test_tiled_norms_take_the_fp32_temporaries_out_of_the_backward_peak(monkeypatch):
    """The same tiled MLP with and without the tiled norms: the backward peak drops by at
    least two of a norm's [tokens, hidden] fp32 tensors (measured: 2.4; the module's own
    backward makes about five at once, but at this size the attention's and the loss's
    tensors are near the peak too; at an 8B Llama's the drop is 0.5 GiB: docs/planner.md)."""
    with_norms = _engine_step(8, True, monkeypatch)
    without = _engine_step(8, False, monkeypatch)
    assert (with_norms["norm_tiled_modules"], without["norm_tiled_modules"]) == (5, 0)
    one = 2 * 128 * 64 * 4  # [tokens, hidden] fp32
    drop = without["peaks"]["backward"]["total"] - with_norms["peaks"]["backward"]["total"]
    assert drop >= 2 * one, (drop, one)


@pytest.mark.slow  # dry runs beside real tracked runs; verify trains every configuration
@pytest.mark.parametrize("stage,policy", [(3, "all"), (0, "selective")])
def test_dry_run_equals_the_real_tracked_run_with_tiled_norms(stage, policy):
    batch = batches(0, 0, B=2, T=64)[0]
    cfg = EngineConfig.from_dict({"zero": {"stage": stage}, "precision": {"mode": "bf16"},
                                  "checkpointing": {"policy": policy, "mlp_tile_tokens": 16}})

    def model_fn() -> nn.Module:
        torch.manual_seed(0)
        return _llama(layers=3, hidden=64)
    pred = dry_run(model_fn, causal_lm_loss, batch, cfg, 1)
    engine = Engine(model_fn(), None, cfg)
    for _ in range(2):
        out = engine.train_step(batch, causal_lm_loss)
    engine.close()
    assert out.metrics["norm_tiled_modules"] == 7
    real = max(v["total"] for k, v in out.metrics["peaks"].items() if k in ("forward", "backward", "optimizer"))
    assert pred.peak == real, (pred.peak, real)  # the engine's own code on fake tensors: to the byte


@pytest.mark.slow  # dry runs beside real tracked runs; verify trains every configuration
def test_mct_verify_passes_with_tiled_norms(tmp_path):
    """The reference is the untiled Llama (copied before the engine tiles it)."""
    from mct.verify.compare import run_verify
    from tests.task.test_task_hf import save_tiny
    rnd = random.Random(0)
    (tmp_path / "c.txt").write_text("".join(rnd.choice("abcdefgh ijkl\n") for _ in range(50_000)))
    cfg = EngineConfig.from_dict({"model": {"source": f"hf:{save_tiny('llama', tmp_path / 'llama')}", "seq_len": 16},
                                  "data": {"path": str(tmp_path / "c.txt"), "micro_batch_size": 2, "grad_accum": 2},
                                  "train": {"warmup_steps": 0}, "zero": {"stage": 3},
                                  "checkpointing": {"policy": "all", "mlp_tile_tokens": 5}})
    report = run_verify(cfg, 3)
    assert report.passed, report.table()


@pytest.mark.slow  # full dry runs of a deep model, as the other extrapolation equivalences
def test_depth_extrapolation_stays_exact_with_tiled_norms(tmp_path):
    """Tiled MLPs and norms, the final norm (outside the blocks) too: the shallow copies'
    extrapolation still equals the full dry run (the one such check for tiling: a Llama
    has both)."""
    import json

    from mct.planner.grid import prepare_work
    from mct.planner.plan import predict
    from mct.task import task_for
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 88,
        "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False}))
    cfg = EngineConfig.from_dict({"model": {"source": f"hf:{tmp_path}", "seq_len": 32}, "zero": {"stage": 3},
                                  "precision": {"mode": "bf16"}, "checkpointing": {"policy": "all", "mlp_tile_tokens": 96}})
    task = task_for(cfg)
    full, ext = predict(task, cfg, 2), predict(prepare_work(task, cfg), cfg, 2)
    assert (ext.peak, ext.first_step_peak, ext.phases) == (full.peak, full.first_step_peak, full.phases)
