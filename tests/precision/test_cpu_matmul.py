"""Low-precision matmuls on fp32 kernels (``precision.cpu_matmul``): the choice per CPU,
the values (a native kernel's, up to summation order), and the engine using it in
forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mct.precision import cpu_matmul
from mct.precision.cpu_matmul import UpcastMatmul, use_fp32_kernels
from tests.helpers import engine_run, tiny_config


def test_choice_per_device_dtype_and_cpu(monkeypatch):
    monkeypatch.setattr(cpu_matmul, "cpu_has_native_low_precision", lambda dtype: False)
    assert use_fp32_kernels("auto", "cpu", torch.bfloat16)
    assert use_fp32_kernels("auto", "cpu", torch.float16)
    assert not use_fp32_kernels("auto", "cpu", torch.float32)
    assert not use_fp32_kernels("auto", "cuda", torch.bfloat16)
    assert not use_fp32_kernels("native", "cpu", torch.bfloat16)
    monkeypatch.setattr(cpu_matmul, "cpu_has_native_low_precision", lambda dtype: True)
    assert not use_fp32_kernels("auto", "cpu", torch.bfloat16)
    assert use_fp32_kernels("fp32", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="precision.cpu_matmul = 'fast'"):
        use_fp32_kernels("fast", "cpu", torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_forward_and_backward_equal_fp32_math_rounded(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, 24, generator=g).to(dtype).requires_grad_()
    w = torch.randn(40, 24, generator=g).to(dtype).requires_grad_()
    b = torch.randn(40, generator=g).to(dtype).requires_grad_()
    mode = UpcastMatmul()
    with mode:
        y = F.linear(x, w, b)
        y.float().square().sum().backward()
    assert mode.calls >= 3  # forward addmm, two backward mm
    assert y.dtype == x.grad.dtype == w.grad.dtype == dtype
    # the same math in fp64 from the same low-precision inputs, rounded once
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    y64 = F.linear(x64, w64, b64)
    torch.testing.assert_close(y, y64.to(dtype), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(y.double(), y64, rtol=1e-2, atol=2e-2)


def test_attention_forward_and_backward_run_in_fp32_and_return_bf16():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 17, 8, generator=g).bfloat16().requires_grad_() for _ in range(3))
    mode = UpcastMatmul()
    with mode:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y.float().sum().backward()
    assert y.dtype == q.grad.dtype == torch.bfloat16 and mode.calls >= 2
    ref = F.scaled_dot_product_attention(*(t.detach().double() for t in (q, k, v)), is_causal=True)
    assert (y.double() - ref).abs().max() < 2e-2


def test_engine_bf16_on_fp32_kernels_tracks_native_kernels():
    """The same bf16 training, once on fp32 kernels and once on torch's native bf16
    ones: the losses agree at the bf16 tolerance (they differ by summation order)."""
    runs = {}
    for choice in ("fp32", "native"):
        cfg = tiny_config(precision={"mode": "bf16", "cpu_matmul": choice})
        runs[choice] = engine_run(cfg, rank=0, steps=3)[0]
    for a, b in zip(runs["fp32"], runs["native"]):
        assert abs(a - b) <= 2e-2 * abs(b)


def test_engine_enters_the_mode_in_forward_and_backward(monkeypatch):
    seen = []
    real = UpcastMatmul.__torch_dispatch__

    def spy(self, func, types, args=(), kwargs=None):
        if func in cpu_matmul.UPCAST_OPS:
            seen.append(func)
        return real(self, func, types, args, kwargs)

    monkeypatch.setattr(UpcastMatmul, "__torch_dispatch__", spy)
    engine_run(tiny_config(precision={"mode": "bf16", "cpu_matmul": "fp32"}), rank=0, steps=1)
    names = {f.__name__ for f in seen}
    assert "addmm.default" in names and "mm.default" in names  # forward and backward
    seen.clear()
    engine_run(tiny_config(precision={"mode": "fp32", "cpu_matmul": "fp32"}), rank=0, steps=1)
    assert not seen  # fp32 runs never enter it
