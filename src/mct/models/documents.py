"""Packed documents in one window (``data.packing = 'documents'``): from per-token
document ids to the position ids and the block-causal mask attention takes.

A window's ``segments`` [B, T] int64 number its documents 0, 1, 2, ... from the left
(contiguous runs: a document is one run). A token attends to the earlier tokens of its
own run only, and its position counts from the first token of its run, so a document
that continues from the previous window restarts at position 0 like any other.
"""

from __future__ import annotations

import torch


def document_positions(segments: torch.Tensor) -> torch.Tensor:
    """segments int64 [B, T] -> position ids int64 [B, T]: each token's offset from the
    first token of its run. Pure; works on fake and meta tensors."""
    T = segments.shape[-1]
    idx = torch.arange(T, device=segments.device).expand_as(segments)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=-1).values
    return idx - first


def block_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """segments int64 [B, T] -> bool [B, 1, T, T], True where query t may attend key s
    (s <= t and the same document): the ``attn_mask`` SDPA takes. T*T bytes a row."""
    T = segments.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=segments.device).tril_()
    same = segments[:, :, None] == segments[:, None, :]
    return (same & causal).unsqueeze(1)
