"""Collectives: the only module that calls torch.distributed.

Every collective is timed and its bytes counted, so the engine can report
communication time and volume per step. With one process every operation is a
local copy or a no-op, so the same engine code runs with and without a process group.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mct.dist import DistContext
from mct.zero.partition import bucket_slices

# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names warn on every
# call); same signatures. Older torch has only the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class CommStats:
    time_s: float = 0.0
    bytes: int = 0
    calls: int = 0
    by_op: dict[str, int] = field(default_factory=dict)

    def add(self, op: str, nbytes: int, seconds: float) -> None:
        self.time_s += seconds
        self.bytes += nbytes
        self.calls += 1
        self.by_op[op] = self.by_op.get(op, 0) + nbytes


class Pending:
    """An async collective: ``wait()`` blocks until done, counts its time, then runs
    ``then`` (e.g. accumulate a reduced shard)."""

    def __init__(self, works: list, stats: CommStats, op: str, nbytes: int, then=None,
                 keep: list | None = None) -> None:
        self._works, self._stats, self._op, self._nbytes, self._then = works, stats, op, nbytes, then
        self._keep = keep  # temporaries the collective reads or writes: alive until wait()
        self._t0 = time.perf_counter()

    def wait(self) -> None:
        if self._works is None:
            return
        t = time.perf_counter()
        for w in self._works:
            w.wait()
        self._stats.add(self._op, self._nbytes, time.perf_counter() - t)
        self._works = self._keep = None
        if self._then is not None:
            self._then()


class Comm:
    """Bucketed collectives over the default process group (or none)."""

    def __init__(self, ctx: DistContext, bucket_bytes: int) -> None:
        self.ctx = ctx
        self.world = ctx.world_size
        self.rank = ctx.rank
        self.bucket_bytes = bucket_bytes
        self.stats = CommStats()

    def reset_stats(self) -> None:
        self.stats = CommStats()

    def all_reduce_(self, t: torch.Tensor, op: str = "sum") -> None:
        """In place: t <- op over ranks of t (chunked by bucket size)."""
        if self.world == 1:
            return
        red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        t0 = time.perf_counter()
        flat = t.view(-1)
        step = max(1, self.bucket_bytes // t.element_size())
        for a in range(0, flat.numel(), step):
            dist.all_reduce(flat[a:a + step], op=red)
        self.stats.add("all_reduce", t.numel() * t.element_size(), time.perf_counter() - t0)

    def reduce_scatter(self, full: torch.Tensor, out: torch.Tensor, async_op: bool = False,
                       then=None) -> Pending | None:
        """Sum ``full`` [world * S] over ranks; this rank's slice [S] lands in ``out``."""
        if self.world == 1:
            out.copy_(full)
            if then is not None:
                then()
            return None
        S = out.numel()
        view = full.view(self.world, S)
        works, keep = [], [full]
        for a, b in bucket_slices(S, self.world, full.element_size(), self.bucket_bytes):
            src = view if (a, b) == (0, S) else view[:, a:b].contiguous()
            keep.append(src)
            works.append(_reduce_scatter(out[a:b], src.view(-1), async_op=True))
        p = Pending(works, self.stats, "reduce_scatter", full.numel() * full.element_size(), then, keep)
        if not async_op:
            p.wait()
            return None
        return p

    def all_gather(self, shard: torch.Tensor, full: torch.Tensor, async_op: bool = False) -> Pending | None:
        """``full`` [world * S] <- concatenation of every rank's ``shard`` [S]."""
        if self.world == 1:
            full.copy_(shard)
            return None
        S = shard.numel()
        chunks = bucket_slices(S, self.world, full.element_size(), self.bucket_bytes)
        if len(chunks) == 1:
            works = [_all_gather(full, shard, async_op=True)]
            p = Pending(works, self.stats, "all_gather", full.numel() * full.element_size(), keep=[shard])
        else:
            view = full.view(self.world, S)
            tmps = [(a, b, torch.empty(self.world * (b - a), dtype=full.dtype, device=full.device))
                    for a, b in chunks]
            works = [_all_gather(t, shard[a:b].contiguous(), async_op=True) for a, b, t in tmps]

            def scatter_back() -> None:
                for a, b, t in tmps:
                    view[:, a:b].copy_(t.view(self.world, b - a))
            p = Pending(works, self.stats, "all_gather", full.numel() * full.element_size(), scatter_back)
        if not async_op:
            p.wait()
            return None
        return p

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def check_ranks_agree(comm: Comm, what: str, items: list[tuple[str, str]]) -> None:
    """Raise ValueError on every rank if ranks disagree on ``items`` (a list of
    (name, description) pairs), naming the first mismatch. One small all-gather of
    a digest; the full lists are exchanged only on mismatch."""
    digest = hashlib.sha256(repr(items).encode()).hexdigest()
    digests = comm.all_gather_object(digest)
    if len(set(digests)) == 1:
        return
    lists = comm.all_gather_object(items)
    for r, other in enumerate(lists):
        if other == lists[0]:
            continue
        for i in range(max(len(other), len(lists[0]))):
            a = lists[0][i] if i < len(lists[0]) else ("<missing>", "")
            b = other[i] if i < len(other) else ("<missing>", "")
            if a != b:
                raise ValueError(
                    f"ranks disagree on the {what}: entry {i} is {a[0]} {a[1]} on rank 0 but "
                    f"{b[0]} {b[1]} on rank {r}. Build the same model (same config and seed) on every rank.")
    raise ValueError(f"ranks disagree on the {what} (digests {digests})")
