"""``ContextParallel``: a rank's context group, the split of the micro-batch in flight,
and the loss of a window split over ranks; ``NoContext`` is the same interface at degree 1.

The loss of a window is the mean over all its counted targets. Each rank computes its
loss function on its own tokens (a mean over its counted targets, as every default loss
is) and rescales it by ``degree * mine / counted`` (``counted``: the window's counted
targets, known on every rank since each holds the whole batch before the split). The
engine averages gradients over all ``world`` ranks; the collectives' backward has
already summed each rank's gradient contributions across its group, so the average is
the mean over context groups of each window's gradient: what degree 1 computes, each
data-parallel rank holding one group's windows. The engine's reported loss (the mean
over ranks) is likewise the mean over groups of the windows' losses.

Dropout: every rank of the group draws degree 1's masks of the whole window from the
micro-batch's seed and keeps its own tokens' part (``mct.context.dropout``), so a run with
dropout draws what degree 1 draws.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from mct.context.attention import all_to_all_attention, gather_attention, heads_divide
from mct.context.comm import ContextComm
from mct.context.layout import ContextShard, shard_batch
from mct.context.ring import ring_attention

IGNORE_INDEX = -100
"""Targets that do not count (``F.cross_entropy``'s default, the packed windows' boundaries)."""


class NoContext:
    """Degree 1: the loss function on the whole batch, nothing installed."""

    degree = 1

    def loss(self, loss_fn: Callable[[nn.Module, tuple], torch.Tensor], model: nn.Module, batch) -> torch.Tensor:
        return loss_fn(model, batch)


class ContextParallel:
    """A rank of a context group. ``shard`` is the split of the micro-batch whose forward
    ran last: set by ``loss``, read by the installed attention and position hook until the
    next ``loss`` call, so a checkpointed block recomputed in backward attends exactly as
    its forward did (same shard, same collectives)."""

    def __init__(self, comm: ContextComm, attention: str) -> None:
        """``attention``: 'auto', 'all_to_all', 'all_gather' or 'ring' (``parallel.context_attention``)."""
        self.comm, self.attention = comm, attention
        self.shard: ContextShard | None = None

    @property
    def degree(self) -> int:
        return self.comm.degree

    def attention_for(self, heads: int, kv_heads: int) -> Callable[..., torch.Tensor]:
        """The attention one module with these head counts runs: ``attend(q, k, v, *,
        scale=None, dropout_p=0.0)``. Raises ValueError when 'all_to_all' is asked for and
        the heads do not divide the degree."""
        divides = heads_divide(heads, kv_heads, self.degree)
        if self.attention == "all_to_all" and not divides:
            raise ValueError(f"parallel.context_attention = 'all_to_all' splits heads over the context group, but "
                             f"{heads} heads ({kv_heads} key/value heads) do not divide parallel.context = "
                             f"{self.degree}: set parallel.context_attention = 'all_gather' or 'auto'")
        impl = {"all_to_all": all_to_all_attention, "ring": ring_attention}.get(self.attention, gather_attention)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                   dropout_p: float = 0.0) -> torch.Tensor:
            assert self.shard is not None, "context attention outside ContextParallel.loss"
            return impl(self.comm, self.shard, q, k, v, scale=scale, dropout_p=dropout_p)
        attend.__qualname__ = f"context_{impl.__name__}"
        return attend

    def loss(self, loss_fn: Callable[[nn.Module, tuple], torch.Tensor], model: nn.Module, batch) -> torch.Tensor:
        """This rank's share of the window loss of ``batch`` (input_ids, targets[, segments])
        (see the module docstring); sets ``shard``. Raises ValueError for another batch shape."""
        # the trainer's dropout seed (a trailing int) as it is: every rank of the group draws the
        # whole window's masks from it and keeps its part (mct.context.dropout), as degree 1 draws
        local, self.shard = shard_batch(batch, self.degree, self.comm.rank)
        loss = loss_fn(model, local)
        mine = (local[1] != IGNORE_INDEX).sum()
        counted = (batch[1] != IGNORE_INDEX).sum()
        share = loss * (self.degree * mine.to(loss.dtype) / counted.to(loss.dtype))
        # a rank none of whose tokens is counted (a window's end all padding or ignored): the
        # mean over nothing is nan; its share is 0, its graph kept (the collectives in backward)
        return torch.where(mine > 0, share, torch.zeros_like(share))
