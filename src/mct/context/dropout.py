"""Dropout under context parallelism that draws exactly what degree 1 draws.

Every rank of a context group holds the same generator state (the micro-batch's dropout
seed, not offset by rank) and, at each dropout site, draws the mask of the *whole window*
with the call degree 1 makes (``torch.empty(shape).bernoulli_(1 - p)``, as
``F.dropout`` and the math path of SDPA do on a CPU), then keeps its own tokens' part.
Each site advances the generator as degree 1's does, so every later site stays in step,
and a recomputed block (torch's checkpoint restores the generator) replays the same bits.
The price: every rank generates the whole window's masks (the attention's [B, H, T, T] at
each layer, transient), which degree 1 alone would; docs/parallel.md measures it.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from mct.context.layout import ContextShard


def window_noise(shape: tuple[int, ...], p: float, like: torch.Tensor) -> torch.Tensor:
    """The keep mask x 1 / (1 - p) of a whole-window tensor of ``shape`` in ``like``'s dtype
    and device: the draw degree 1's dropout makes on a tensor of that shape (it advances the
    generator alike). Asserts 0 < p < 1."""
    assert 0.0 < p < 1.0, p
    return torch.empty(shape, dtype=like.dtype, device=like.device).bernoulli_(1 - p).div_(1 - p)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None,
           noise: torch.Tensor | None) -> torch.Tensor:
    """SDPA with the additive ``mask`` [.., rows, keys]; with ``noise`` (this rank's part of
    ``window_noise`` of the window's [B, H, T, T] scores) the attention probabilities
    dropped by it, as SDPA's math path computes (softmax, x noise, @ v)."""
    if noise is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = (q @ k.transpose(-2, -1)) * (scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    return (torch.softmax(scores + mask, dim=-1) * noise) @ v


class WindowDropout(nn.Module):
    """``nn.Dropout`` on [B, t, ...] token tensors of this rank (tokens on dim 1): the whole
    window's mask drawn (``window_noise`` of [B, T, ...]) and this rank's tokens' rows kept.
    Outside a split micro-batch (``shard()`` None: evaluation at degree 1 shapes) or on a
    tensor without this rank's tokens on dim 1, it is the ``nn.Dropout`` it replaces."""

    def __init__(self, p: float, shard: Callable[[], ContextShard | None]) -> None:
        super().__init__()
        self.p, self.shard = p, shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shard = self.shard()
        if not self.training or self.p == 0.0:
            return x
        if shard is None or x.dim() < 2 or x.shape[1] != shard.index.shape[0]:
            return F.dropout(x, self.p, True)
        whole = (x.shape[0], shard.order.shape[0], *x.shape[2:])
        return x * window_noise(whole, self.p, x)[:, shard.index]

    def extra_repr(self) -> str:
        return f"p={self.p}, whole window"


def replace_dropout(model: nn.Module, shard: Callable[[], ContextShard | None]) -> int:
    """Swap every ``nn.Dropout`` of ``model`` for a ``WindowDropout`` of the same p (mutates
    the model; no parameters change); returns how many were swapped."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Dropout:
                setattr(parent, name, WindowDropout(child.p, shard))
                swapped += 1
    return swapped
