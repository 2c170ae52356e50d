"""Which tokens of a window each rank of a context group holds, and what each may attend to.
Pure functions of shapes and document ids; no collectives.

A window of T tokens is cut into 2N chunks of T / 2N tokens (N = ``parallel.context``); rank
r holds chunks r and 2N-1-r. Under a causal mask a query's work grows with its position, so
an early chunk paired with a late one gives every rank the same attention work (the causal
load balance of Megatron's and torchtitan's context parallelism). The *gathered order* is the
order a gather over the group lays tokens out in: rank 0's tokens, then rank 1's, ...; keys
and values reach attention in that order and the mask is built for it, so nothing is permuted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mct.models.documents import document_positions


def rank_indices(window: int, degree: int, rank: int) -> torch.Tensor:
    """Global positions (int64 [window // degree]) of the tokens rank ``rank`` holds:
    chunks ``rank`` and ``2 * degree - 1 - rank`` of ``2 * degree``. Asserts the window
    splits evenly (the config checks model.seq_len)."""
    assert window % (2 * degree) == 0 and 0 <= rank < degree, (window, degree, rank)
    c = window // (2 * degree)
    first, second = rank * c, (2 * degree - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])


def gathered_order(window: int, degree: int) -> torch.Tensor:
    """Global positions (int64 [window]) of the tokens in gathered order (rank by rank)."""
    return torch.cat([rank_indices(window, degree, r) for r in range(degree)])


@dataclass(frozen=True)
class ContextShard:
    """One micro-batch's split as one rank sees it: what attention and the model's
    positions read while that micro-batch's forward and backward (recompute) run."""

    index: torch.Tensor
    """int64 [t]: global positions of this rank's tokens (t = T / degree)."""
    order: torch.Tensor
    """int64 [T]: global positions of the window's tokens in gathered order."""
    positions: torch.Tensor
    """int64 [B, t]: the position ids of this rank's tokens (packed: offsets in their documents)."""
    segments: torch.Tensor | None
    """int64 [B, T]: the window's document ids in global order (packed), or None (one sequence)."""
    rank: int = 0
    """This rank's place in its context group (it holds chunks ``rank`` and ``2N - 1 - rank``)."""
    masks: dict[tuple, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    """The masks built so far, by kind and dtype: built by the first layer, shared by every layer."""

    def chunks(self) -> list[tuple[slice, int]]:
        """This rank's two chunks: (their rows of the local tokens, the end of the causal
        prefix of keys they may attend: the global position after their last token). From
        the sizes alone (no tensor values: the planner's fake tensors have none)."""
        c, n, r = self.index.shape[0] // 2, self.order.shape[0] // self.index.shape[0], self.rank
        return [(slice(0, c), (r + 1) * c), (slice(c, 2 * c), (2 * n - r) * c)]

    def chunk_mask(self, h: int, dtype: torch.dtype) -> torch.Tensor:
        """``additive(mask(...))`` of chunk ``h``'s queries over the keys of global positions
        0 .. its prefix end (built once)."""
        if ("chunk", h, dtype) not in self.masks:
            rows, end = self.chunks()[h]
            keys = torch.arange(end, device=self.index.device)
            self.masks["chunk", h, dtype] = additive(self.mask(self.index[rows], keys), dtype)
        return self.masks["chunk", h, dtype]

    def heads_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """``additive(mask(order, order))``: the window's queries over its keys, both in gathered
        order (built once)."""
        if ("heads", dtype) not in self.masks:
            self.masks["heads", dtype] = additive(self.mask(self.order, self.order), dtype)
        return self.masks["heads", dtype]

    def mask(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """bool [B or 1, 1, len(queries), len(keys)]: True where the query at global
        position ``queries[i]`` may attend the key at ``keys[j]`` (not later, and in the
        same document when packed): SDPA's ``attn_mask``. Every query sees itself."""
        allowed = (keys[None, :] <= queries[:, None]).to(self.index.device)[None, None]
        if self.segments is None:
            return allowed
        same = self.segments[:, queries, None] == self.segments[:, None, keys]
        return allowed & same[:, None]


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask -> SDPA's additive form in ``dtype`` (0 where allowed, -inf elsewhere).
    SDPA converts a bool mask to this on every call and keeps the copy for backward: one
    conversion per layer; built here once, every layer shares it (measured: 256 MiB a layer
    at 8192 tokens, docs/parallel.md)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def shard_batch(batch: tuple, degree: int, rank: int) -> tuple[tuple, ContextShard]:
    """A token batch (input_ids, targets[, segments][, anything else, e.g. a dropout seed]),
    the first ones int64 [B, T], -> (the batch with this rank's columns of every [B, T]
    tensor, the rest as it is; its ``ContextShard``). Raises ValueError for another batch
    shape or a window that does not split into 2 x degree chunks."""
    if (not isinstance(batch, (tuple, list)) or len(batch) < 2
            or not all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in batch[:2])
            or batch[0].shape != batch[1].shape):
        raise ValueError("parallel.context > 1 splits token batches: (input_ids, targets[, segments]), int64 "
                         "[B, T] each; give the engine such batches or set parallel.context = 1")
    B, T = batch[0].shape
    if T % (2 * degree):
        raise ValueError(f"a window of {T} tokens does not split into 2 x parallel.context = {2 * degree} chunks: "
                         f"use a multiple of {2 * degree} tokens (model.seq_len)")
    windowed = [isinstance(t, torch.Tensor) and t.shape == (B, T) for t in batch]
    device = batch[0].device
    index, order = rank_indices(T, degree, rank).to(device), gathered_order(T, degree).to(device)
    segments = batch[2] if len(batch) > 2 and windowed[2] else None
    whole = (document_positions(segments) if segments is not None
             else torch.arange(T, device=device).expand(B, T))
    shard = ContextShard(index=index, order=order, positions=whole[:, index], segments=segments, rank=rank)
    return tuple(t[:, index] if w else t for t, w in zip(batch, windowed)), shard
