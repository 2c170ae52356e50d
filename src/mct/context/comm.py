"""The context group's collectives: the only module of ``mct.context`` that calls
torch.distributed. Each is an autograd function whose backward is the adjoint collective,
so gradients are exact: an all-gather's backward reduce-scatters (sums) the gradients of
the gathered copies into their owner; an all-to-all's backward is the same all-to-all.
gloo (CPU) and nccl (CUDA) both run ``all_gather_single``, ``reduce_scatter_single`` and
``all_to_all_single`` (checked on gloo with torch 2.13). ``exchange`` is the ring's
point-to-point step (``batch_isend_irecv``), asynchronous so the ring overlaps it with compute.

``SimulatedContextComm`` has the same methods on fake tensors (the planner's dry run):
outputs of the real shapes and dtypes, no data moved, and ``calls`` counting what the real
group would move (the time model prices it, as ``mct.zero.comm.SimulatedCollectives``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor-in/tensor-out collectives; older torch has only the old names
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

GROUP_COLLECTIVES: dict[str, Any] = {"all_gather": _all_gather, "reduce_scatter": _reduce_scatter,
                                     "all_to_all": dist.all_to_all_single}
"""The raw calls ``(out, inp, group=...)`` behind each kind this module counts: what
``mct.machine.collectives.measure_group_collectives`` times for the time model."""


class _Gather(torch.autograd.Function):
    """[t, ...] on each rank -> [degree * t, ...], rank by rank; backward: reduce-scatter."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, degree: int) -> torch.Tensor:
        ctx.group = group
        out = x.new_empty((degree * x.shape[0], *x.shape[1:]))
        _all_gather(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        degree = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // degree, *grad.shape[1:]))
        _reduce_scatter(out, grad.contiguous(), group=ctx.group)
        return out, None, None


class _AllToAll(torch.autograd.Function):
    """[degree, ...]: block j goes to rank j, block i of the output came from rank i; its own adjoint."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)  # after contiguous(): empty_like keeps a strided input's strides
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class PendingExchange:
    """A ring exchange in flight: ``wait()`` returns the received tensor once it has arrived
    (the sent one is kept alive until then)."""

    def __init__(self, works: list, sent: torch.Tensor, received: torch.Tensor) -> None:
        self.works, self.sent, self.received = works, sent, received

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        self.works, self.sent = [], None
        return self.received


class ContextComm:
    """The collectives of one context group (``degree`` ranks, this one ``rank`` in it)."""

    def __init__(self, group: Any, degree: int, rank: int) -> None:
        self.group, self.degree, self.rank = group, degree, rank

    def exchange(self, x: torch.Tensor, tag: int) -> PendingExchange:
        """Start sending ``x`` to the next rank of the ring (rank + 1) and receiving the
        previous rank's tensor of the same shape: returns at once, ``wait()`` for the result.
        Not differentiable (the ring attention's own backward passes gradients back). gloo
        runs the transfer on its own threads, so the caller computes meanwhile; on nccl the
        transfer runs on nccl's stream and ``wait()`` makes the current stream wait for it."""
        x = x.contiguous()
        received = torch.empty_like(x)
        peer = lambda i: dist.get_global_rank(self.group, i % self.degree)  # noqa: E731
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer(self.rank + 1), self.group, tag),
                                        dist.P2POp(dist.irecv, received, peer(self.rank - 1), self.group, tag)])
        return PendingExchange(works, x, received)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """``x`` of every rank concatenated along ``dim`` in rank order. Differentiable."""
        return _Gather.apply(x.movedim(dim, 0), self.group, self.degree).movedim(0, dim)

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [degree, ...]: block j to rank j; returns the blocks received, by source rank. Differentiable."""
        return _AllToAll.apply(x, self.group)


class _CountedGather(torch.autograd.Function):
    """``_Gather``'s shapes without a group: counts the all-gather (forward) and its
    reduce-scatter (backward) in ``calls`` as (kind, bytes of the gathered tensor, 1)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, calls: Counter, degree: int) -> torch.Tensor:
        ctx.calls, ctx.degree = calls, degree
        out = torch.cat([x] * degree, dim=0)
        calls["all_gather", out.numel() * out.element_size(), 1, degree] += 1
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.calls["reduce_scatter", grad.numel() * grad.element_size(), 1, ctx.degree] += 1
        return grad[: grad.shape[0] // ctx.degree].clone(), None, None


class _CountedAllToAll(torch.autograd.Function):
    """``_AllToAll``'s shapes without a group: counts it forward and backward in ``calls``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, calls: Counter, degree: int) -> torch.Tensor:
        ctx.calls, ctx.degree = calls, degree
        calls["all_to_all", x.numel() * x.element_size(), 1, degree] += 1
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.calls["all_to_all", grad.numel() * grad.element_size(), 1, ctx.degree] += 1
        return grad.clone(), None, None


class SimulatedContextComm(ContextComm):
    """Rank 0 of a group that does not exist: the outputs' shapes, dtypes and lifetimes of
    the real collectives (fake tensors in the planner's dry run), no data exchanged.
    ``calls``: (kind, bytes, buckets, group size) -> calls the real group would issue,
    forward and backward (a recomputed block's again): the keys ``SimulatedCollectives.calls``
    uses and the group's size, which the time model prices them at."""

    def __init__(self, degree: int) -> None:
        super().__init__(None, degree, 0)
        self.calls: Counter[tuple[str, int, int, int]] = Counter()

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return _CountedGather.apply(x.movedim(dim, 0), self.calls, self.degree).movedim(0, dim)

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        return _CountedAllToAll.apply(x, self.calls, self.degree)

    def exchange(self, x: torch.Tensor, tag: int) -> PendingExchange:
        """The real exchange's buffers (``x`` kept until ``wait()``, the received tensor),
        counted as ('send_recv', bytes sent, 1, degree)."""
        x = x.contiguous()
        self.calls["send_recv", x.numel() * x.element_size(), 1, self.degree] += 1
        return PendingExchange([], x, torch.empty_like(x))


def context_comm(degree: int, rank: int, world: int, simulated: bool) -> ContextComm:
    """This rank's context group: ranks ``[g * degree, (g + 1) * degree)`` share one window.
    Creates every group (collective: every rank calls it, in the same order); simulated:
    no group. Asserts ``degree`` divides ``world`` (the caller raises the user's error)."""
    assert world % degree == 0, (world, degree)
    if simulated:
        return SimulatedContextComm(degree)
    group, _ = dist.new_subgroups(group_size=degree)
    return ContextComm(group, degree, rank % degree)
