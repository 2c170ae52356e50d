"""The two attention implementations agree, and ``model.attention = 'auto'`` picks one
per device and dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mct.models import gpt
from mct.models.gpt import attention_impl, explicit_attention
from tests.helpers import tiny_config


def _qkv(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 3, 17, 8, generator=g).to(dtype).requires_grad_() for _ in range(3)]


def test_explicit_attention_matches_sdpa_forward_and_backward_fp64():
    a, b = _qkv(torch.float64), _qkv(torch.float64)
    y1 = explicit_attention(*a, 0.0)
    y2 = F.scaled_dot_product_attention(*b, is_causal=True)
    torch.testing.assert_close(y1, y2, rtol=1e-10, atol=1e-12)
    y1.square().sum().backward()
    y2.square().sum().backward()
    for x1, x2 in zip(a, b):
        torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-10, atol=1e-12)


def test_explicit_bf16_softmax_is_fp32_and_close_to_fp64():
    ref = F.scaled_dot_product_attention(*_qkv(torch.float64), is_causal=True)
    y = explicit_attention(*_qkv(torch.bfloat16), 0.0)
    assert y.dtype == torch.bfloat16
    assert (y.double() - ref).abs().max() < 3e-2  # bf16 inputs and matmuls, fp32 softmax


def test_auto_picks_explicit_only_for_low_precision_on_a_native_cpu(monkeypatch):
    monkeypatch.setattr(gpt, "cpu_has_native_low_precision", lambda dtype: True)
    assert attention_impl("auto", "cpu", torch.bfloat16) == "explicit"
    assert attention_impl("auto", "cpu", torch.float32) == "sdpa"
    assert attention_impl("auto", "cuda", torch.bfloat16) == "sdpa"
    assert attention_impl("sdpa", "cpu", torch.bfloat16) == "sdpa"
    monkeypatch.setattr(gpt, "cpu_has_native_low_precision", lambda dtype: False)
    assert attention_impl("auto", "cpu", torch.bfloat16) == "sdpa"
    assert attention_impl("explicit", "cuda", torch.float32) == "explicit"


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_gpt_losses_agree_between_implementations(mode):
    losses = {}
    for impl in ("sdpa", "explicit"):
        cfg = tiny_config(model={"attention": impl, "dropout": 0.0})
        torch.manual_seed(0)
        model = gpt.GPT(cfg.model)
        if mode == "bf16":
            model = model.to(torch.bfloat16)
        x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
            loss = gpt.gpt_loss(model, (x, x.roll(-1, 1)))
        loss.backward()
        losses[impl] = (loss.item(), model.wte.weight.grad.float().norm().item())
    (l1, g1), (l2, g2) = losses["sdpa"], losses["explicit"]
    tol = 1e-5 if mode == "fp32" else 2e-2
    assert abs(l1 - l2) <= tol * abs(l1) and abs(g1 - g2) <= 5 * tol * abs(g1)


def test_attention_choice_is_validated():
    with pytest.raises(ValueError, match="model.attention = 'flash'"):
        tiny_config(model={"attention": "flash"})
