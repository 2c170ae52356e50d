"""Attention across a context group: each rank holds queries, keys and values of its
tokens (``layout``) and gets the exact attention output of its queries over the window.

- ``gather_attention``: every rank gathers all keys and values, puts them in global order,
  and attends each of its two chunks to the keys before its end under the mask its shard
  builds. Any mask, any head count; holds the window's keys and values ([B, Hkv, T, D]
  twice) during attention. What Llama 3 used for document masks.
- ``all_to_all_attention`` (Ulysses): one all-to-all turns q, k, v from "my tokens, all
  heads" into "all tokens, my H / N heads", each rank attends the whole window for its
  heads, and one more all-to-all turns the output back. Needs the head count and the
  key/value head count divisible by the degree; moves 4 tensors of this rank's size
  instead of the gather's whole-window keys and values.

Both take q [B, H, t, D] and k, v [B, Hkv, t, D] (Hkv divides H: grouped-query attention)
and return [B, H, t, D]; SDPA computes, with the additive mask each shard builds once. With
attention dropout each rank draws degree 1's mask of the whole window and uses its part
(``mct.context.dropout``).
"""

from __future__ import annotations

import torch

from mct.context.comm import ContextComm
from mct.context.dropout import attend, window_noise
from mct.context.layout import ContextShard


def gather_attention(comm: ContextComm, shard: ContextShard, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     *, scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """This rank's queries over the gathered keys and values (see the module docstring): the
    keys put in global order, each of the rank's two chunks attends only the causal prefix
    of keys up to its last token (at degree N, (2N + 1) / 4N of the window's rows x keys)."""
    to_global = torch.argsort(shard.order)
    k, v = (_repeat_heads(comm.all_gather(t, dim=2)[:, :, to_global], q.shape[1]) for t in (k, v))
    T = shard.order.shape[0]
    noise = window_noise((q.shape[0], q.shape[1], T, T), dropout_p, q) if dropout_p else None  # degree 1's draw
    out = [attend(q[:, :, rows], k[:, :, :end], v[:, :, :end], shard.chunk_mask(h, q.dtype), scale,
                  None if noise is None else noise[:, :, shard.index[rows], :end])
           for h, (rows, end) in enumerate(shard.chunks())]
    return torch.cat(out, dim=2)


def all_to_all_attention(comm: ContextComm, shard: ContextShard, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, *, scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Ulysses (see the module docstring). Asserts the head counts divide the degree
    (``heads_divide`` is the check callers make first)."""
    assert heads_divide(q.shape[1], k.shape[1], comm.degree), (q.shape, k.shape, comm.degree)
    q, k, v = (_to_heads(comm, t) for t in (q, k, v))
    k, v = (_repeat_heads(t, q.shape[1]) for t in (k, v))
    noise = None
    if dropout_p:  # degree 1's draw of all heads; mine, keys and queries in gathered order
        T, h = shard.order.shape[0], q.shape[1]
        whole = window_noise((q.shape[0], h * comm.degree, T, T), dropout_p, q)
        noise = whole[:, comm.rank * h:(comm.rank + 1) * h][:, :, shard.order][:, :, :, shard.order]
    y = attend(q, k, v, shard.heads_mask(q.dtype), scale, noise)
    return _to_tokens(comm, y)


def heads_divide(heads: int, kv_heads: int, degree: int) -> bool:
    """Can Ulysses split these heads over ``degree`` ranks?"""
    return heads % degree == 0 and kv_heads % degree == 0


def _to_heads(comm: ContextComm, x: torch.Tensor) -> torch.Tensor:
    """[B, H, t, D] (my tokens, all heads) -> [B, H / N, T, D] (all tokens in gathered order, my heads)."""
    B, H, t, D = x.shape
    n = comm.degree
    blocks = x.reshape(B, n, H // n, t, D).movedim(1, 0)  # block j: the heads rank j attends
    got = comm.all_to_all(blocks.contiguous())  # got[i]: rank i's tokens of my heads
    return got.movedim(0, 2).reshape(B, H // n, n * t, D)


def _to_tokens(comm: ContextComm, y: torch.Tensor) -> torch.Tensor:
    """The inverse of ``_to_heads``: [B, H / N, T, D] -> [B, H, t, D]."""
    B, h, T, D = y.shape
    n = comm.degree
    blocks = y.reshape(B, h, n, T // n, D).movedim(2, 0)  # block i: rank i's tokens
    got = comm.all_to_all(blocks.contiguous())  # got[j]: my tokens of rank j's heads
    return got.movedim(0, 1).reshape(B, n * h, T // n, D)


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, Hkv, T, D] -> [B, heads, T, D], each key/value head repeated for its query group."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)
