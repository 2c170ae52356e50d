"""Token-tiled RMSNorm (with ``checkpointing.mlp_tile_tokens``): each RMSNorm of the model
runs forward and backward over tiles of its tokens, keeping only its input and the fp32
reciprocal RMS of each token (``rstd``, one float per token).

transformers' RMSNorms upcast: ``h = x.float(); h * rsqrt(h.pow(2).mean(-1) + eps)``, then
``weight * h.to(x.dtype)``. Autograd keeps the fp32 copy of the input and the normalized
tensor for backward, and backward makes about five full-size fp32 temporaries: for an 8B
Llama at 8192 tokens, 128 MiB each, at the backward peak (docs/planner.md). Here forward
computes the same ops in the same order, tile by tile (bit-identical output), and backward
recomputes ``h`` per tile from the saved input and ``rstd``: no fp32 tensor larger than a
tile exists. The weight's gradient is a sum over tiles (fp32), reaching the weight once,
as an ordinary autograd input's: only its summation order changes.

Which modules: any module with a one-dimensional ``weight`` Parameter, a float
``variance_epsilon`` or ``eps``, no other parameters or children, whose class's
``forward`` computes exactly the formula above (``is_standard_rms_norm`` runs it on small
probes and compares bits; Gemma's ``1 + weight``, T5's cast to the weight's dtype or a
module without an ``eps`` fail it and are left alone).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable
from torch.utils._python_dispatch import _disable_current_modes

from mct.checkpointing.tiled import PatchedForwards, token_spans

EPS_NAMES = ("variance_epsilon", "eps")
"""Attributes an RMSNorm keeps its epsilon in (transformers' spellings)."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference formula (transformers' LlamaRMSNorm.forward), op for op."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _eps_of(module: nn.Module) -> tuple[str, float] | None:
    for name in EPS_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, float):
            return name, value
    return None


def is_standard_rms_norm(module: nn.Module) -> bool:
    """True when ``module`` is an RMSNorm whose forward is ``rms_norm`` bit for bit: by
    structure (see the module docstring), then by running its class's ``forward`` on a
    stand-in (random weights, fp32 and bf16 inputs and weights, on the CPU outside any
    dispatch mode: fake tensors have no values). Mutates nothing."""
    weight, eps = getattr(module, "weight", None), _eps_of(module)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or eps is None or "forward" in module.__dict__:
        return False
    if len(list(module.parameters())) != 1 or next(module.children(), None) is not None:
        return False
    forward = type(module).forward
    with _disable_current_modes(), torch.no_grad(), torch.autocast("cpu", enabled=False):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(3, 16, generator=gen) * 4
        w = torch.randn(16, generator=gen)
        for x_dtype in (torch.float32, torch.bfloat16):
            for w_dtype in (torch.float32, torch.bfloat16):
                stand_in = types.SimpleNamespace(weight=w.to(w_dtype), **{eps[0]: eps[1]})
                try:
                    got = forward(stand_in, x.to(x_dtype))
                except Exception:  # it needs more than a weight and an eps: not the formula
                    return False
                want = rms_norm(x.to(x_dtype), w.to(w_dtype), eps[1])
                if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or not torch.equal(got, want):
                    return False
    return True


def find_rms_norms(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified_name, module)`` of every standard RMSNorm in ``model`` (each module once)."""
    return [(name, m) for name, m in model.named_modules() if is_standard_rms_norm(m)]


class TiledNorms(PatchedForwards):
    """The RMSNorms whose ``forward`` runs over tiles of ``tile_tokens`` tokens.

    ``install(norms)`` patches each module's instance ``forward`` (``_TiledRMSNorm``);
    ``remove()`` restores it. A call with more than one argument, or in evaluation (no
    grad), runs the module's own forward."""

    def __init__(self, tile_tokens: int) -> None:
        assert tile_tokens > 0, tile_tokens
        super().__init__()
        self.tile_tokens = tile_tokens

    def install(self, norms: list[tuple[str, nn.Module]]) -> None:
        for name, module in norms:
            original, eps = module.forward, _eps_of(module)
            assert eps is not None, name

            def patched(*args: Any, _module: nn.Module = module, _fn: Any = original, _eps: float = eps[1],
                        **kwargs: Any) -> Any:
                if len(args) != 1 or kwargs or not torch.is_grad_enabled():
                    return _fn(*args, **kwargs)
                return _TiledRMSNorm.apply(args[0], _module.weight, _eps, self.tile_tokens)
            self.patch(name, module, patched)

    def metrics(self) -> dict[str, Any]:
        return {"norm_tiled_modules": len(self.names)}


class _TiledRMSNorm(torch.autograd.Function):
    """y = rms_norm(x, weight, eps), tile by tile; saves x, weight and the fp32 rstd [tokens]."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, tile: int) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = torch.empty(flat.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
        rstd = torch.empty(flat.shape[0], 1, dtype=torch.float32, device=x.device)
        for a, b in token_spans(flat.shape[0], tile):
            h = flat[a:b].to(torch.float32)
            torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps, out=rstd[a:b])
            out[a:b] = weight * (h * rstd[a:b]).to(x.dtype)
            del h
        ctx.tile = tile
        ctx.save_for_backward(x, weight, rstd)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight, rstd = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        flat, g = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        grad_x = torch.empty_like(flat) if need_x else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for a, b in token_spans(flat.shape[0], ctx.tile):
            h, r, gt = flat[a:b].to(torch.float32), rstd[a:b], g[a:b]
            if grad_w is not None:  # y = weight * n.to(dtype): the product in y's dtype, as autograd's
                grad_w += (gt * (h * r).to(x.dtype)).to(torch.float32).sum(0)
            if grad_x is not None:
                # through .to(dtype), n = h * r, r = rsqrt(mean(h^2) + eps) and h = x.float()
                gn = (gt * weight).to(x.dtype).to(torch.float32)
                c = (gn * h).sum(-1, keepdim=True) * r.pow(3) / h.shape[-1]
                grad_x[a:b] = gn * r - h * c
            del h, gt
        return (None if grad_x is None else grad_x.view(x.shape),
                None if grad_w is None else grad_w.to(weight.dtype), None, None)
