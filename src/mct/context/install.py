"""Route a model's attention and positions through a ``ContextParallel``.

- mct's GPT (and any model built alike): every submodule with a ``context_attention``
  attribute calls it instead of its own attention, and the model's forward gets
  ``positions`` (the shard's global positions) instead of segments.
- a Hugging Face causal LM: its attention modules run the attention function registered
  as ``mct_context`` in transformers' ``AttentionInterface`` (the model's
  ``config._attn_implementation``), and its forward gets the shard's ``position_ids``
  (RoPE at the tokens' global positions). transformers builds no mask for an
  implementation without a registered mask function; the shard builds it.

Either way every ``nn.Dropout`` becomes a ``mct.context.dropout.WindowDropout`` (degree 1's
masks), and the attention's dropout probability reaches the context attention, which
draws degree 1's mask too.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn

from mct.context.dropout import replace_dropout
from mct.context.parallel import ContextParallel

HF_ATTENTION = "mct_context"
"""The name the context attention is registered under in transformers' ``AttentionInterface``."""


def install(model: nn.Module, cp: ContextParallel) -> None:
    """Make ``model`` attend through ``cp``, take its positions from ``cp.shard`` and draw
    degree 1's dropout masks (mutates the model: attributes, its ``nn.Dropout`` modules
    swapped, one forward pre-hook; parameters untouched).
    Raises ValueError for a model that takes neither Hugging Face's ``position_ids`` nor
    ``positions``, or that has no attention to route."""
    params = inspect.signature(model.forward).parameters
    if "position_ids" in params and "use_cache" in params:
        routed = _install_hf(model, cp)
        key = "position_ids"
    elif "positions" in params:
        routed = 0
        for m in model.modules():
            if hasattr(m, "context_attention") and hasattr(m, "n_head"):
                m.context_attention = cp.attention_for(m.n_head, m.n_head)
                routed += 1
        key = "positions"
    else:
        raise ValueError(f"parallel.context > 1 needs a model whose forward takes the tokens' positions: "
                         f"{type(model).__name__}.forward takes neither Hugging Face's position_ids nor positions "
                         f"(mct's GPT); set parallel.context = 1")
    if not routed:
        raise ValueError(f"parallel.context > 1 found no attention to split in {type(model).__name__}: "
                         f"set parallel.context = 1")
    replace_dropout(model, lambda: cp.shard)  # degree 1's masks: the whole window's, this rank's part kept
    model.register_forward_pre_hook(_positions_hook(cp, key), with_kwargs=True)


def _positions_hook(cp: ContextParallel, key: str):
    """A forward pre-hook giving the model the shard's positions under ``key`` (and, for
    'positions', dropping the segments: the shard's mask keeps attention in documents)."""
    def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        if cp.shard is None:
            return None
        if key == "positions":
            kwargs.pop("segments", None)
            return args[:1], {**kwargs, "positions": cp.shard.positions}
        return args, {**kwargs, key: cp.shard.positions}
    return hook


def _install_hf(model: nn.Module, cp: ContextParallel) -> int:
    """Register ``mct_context`` and point the model's attention modules at ``cp``; returns their count."""
    from transformers import AttentionInterface
    AttentionInterface.register(HF_ATTENTION, _hf_attention)
    routed = 0
    for m in model.modules():
        config = getattr(m, "config", None)
        if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx") and config is not None:
            heads = config.num_attention_heads
            m.context_attention = cp.attention_for(heads, getattr(config, "num_key_value_heads", None) or heads)
            routed += 1
    model.config._attn_implementation = HF_ATTENTION
    return routed


def _hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q [B, H, t, D], k, v [B, Hkv, t, D] ->
    ([B, t, H, D], no weights). The mask transformers passes (none is built) is ignored."""
    y = module.context_attention(query, key, value, scale=scaling, dropout_p=dropout)
    return y.transpose(1, 2).contiguous(), None
