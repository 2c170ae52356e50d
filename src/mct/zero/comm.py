"""Collectives: the only module that calls torch.distributed.

Every collective is timed and its bytes counted, so the engine can report
communication time and volume per step. With one process every operation is a
local copy or a no-op, so the same engine code runs with and without a process group.

``Comm`` does the bucketing, temporaries and bookkeeping; the raw collectives it
issues go through one small object: ``TorchCollectives`` (torch.distributed) or, for
a context made by ``DistContext.simulated(N)``, ``SimulatedCollectives``, whose
collectives check shapes and move no data. The planner runs the engine on fake
tensors through the simulated ones: every buffer and temporary of an N-rank run is
allocated as in the real run, by this same code. One shortcut: a collective split into
many buckets allocates its per-bucket temporaries as one tensor (the most of them ever
alive together, then those alive from issue to wait), so a 70B layer on 512 ranks costs a
handful of fake ops, not hundreds (same bytes, same lifetime).

A collective split into buckets may be given a ``window``: at most that many buckets in
flight, issuing one more first waits for the oldest (and frees its temporary), so it
holds that many buckets' copies whatever its size (an all-gather has none: each bucket
lands in place in its output; the window bounds what the backend holds in flight). The
root unit's collectives take ``IN_FLIGHT_BUCKETS`` (an 8B model's embedding + head, 1 B elements, would otherwise copy
all of its gradient at the end of backward); a block's keep every bucket in flight, so
its reduce-scatter overlaps the next block's backward. A bucketed reduce-scatter no
longer needs its input once the call returns (its buckets are copies).
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from mct.dist import DistContext
from mct.memory.host import Advise, as_is
from mct.zero.partition import bucket_slices

# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names warn on every
# call); same signatures. Older torch has only the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


BUCKETS_AS_ONE = True
"""Simulated collectives allocate a many-bucket collective's temporaries as one tensor
(False: bucket by bucket, as the real run; the same bytes, tests compare the two)."""

IN_FLIGHT_BUCKETS = 2
"""The window of the root unit's collectives: buckets in flight at once (double
buffering), whose temporaries are all such a collective holds besides its input and
output."""


def window_numels(sizes: list[int], k: int | None = IN_FLIGHT_BUCKETS) -> tuple[int, int]:
    """(most, last): the most elements of bucket temporaries alive at once when buckets of
    ``sizes`` elements are issued in order with at most ``k`` in flight (None: all), and
    those alive once the last is issued (until the collective is waited on)."""
    k = len(sizes) if k is None else k
    if k >= len(sizes):
        return sum(sizes), sum(sizes)
    most = max(sum(sizes[i - k + 1:i + 1]) for i in range(k - 1, len(sizes)))
    return most, sum(sizes[-k:])


def _one_tensor(most: int, last: int, like: torch.Tensor) -> torch.Tensor:
    """The simulated temporaries: one tensor of ``most`` elements (the peak), then one of
    ``last`` (what stays alive until the wait), as the real buckets come and go."""
    tmp = torch.empty(most, dtype=like.dtype, device=like.device)
    if last != most:
        del tmp
        tmp = torch.empty(last, dtype=like.dtype, device=like.device)
    return tmp


@dataclass
class CommStats:
    time_s: float = 0.0
    bytes: int = 0
    calls: int = 0

    def add(self, nbytes: int, seconds: float) -> None:
        self.time_s += seconds
        self.bytes += nbytes
        self.calls += 1


GLOO_P2P = True
"""On gloo, all-gathers and 2-rank reduce-scatters are point-to-point sends and receives
(``TorchCollectives``); False: gloo's collectives (the same bits; tests compare the two,
the machine profile times what the engine issues)."""

SUM_CHUNK = 2**18
"""Elements per chunk of a 2-rank exchange's sum (``Comm._exchange``: 1 MiB of fp32, so its
second pass over the chunk reads it from cache)."""

GATHER_TAG, REDUCE_TAG = 0x6d63, 0x6d64
"""The point-to-point tags of the gloo all-gather and reduce-scatter (``TorchCollectives``):
one per kind, so the two kinds in flight at once never match each other's messages."""


class TorchCollectives:
    """The raw collectives of torch.distributed on the default process group; each
    returns a work handle (``async_op=True``).

    ``reduce_scatter`` may overwrite its input (``Comm.reduce_scatter``'s callers hand
    it gradients they drop or zero afterwards). ``all_gather`` takes an output viewed as
    [world, n] whose rows need not be adjacent (a bucket's columns of a flat buffer):
    each rank's piece lands in its row.

    On gloo (CPU tensors) both are point-to-point sends and receives, not gloo's
    collectives (``p2p=False``, or ``GLOO_P2P`` false, keeps those):

    - all-gather: this rank's piece is sent to every other rank and each other rank's
      piece received straight into its row of the output. gloo's all-gather receives
      into a buffer of its own and copies out of it, and its ring moves each piece in
      ``world - 1`` hops; measured on 2 CPU ranks with 45 MB outputs it took 2.7x the
      time of the sends and receives, into the same output.
    - reduce-scatter, 2 ranks: the other rank's half for this rank is received into
      ``out`` and this rank's own half added to it: ``out = other + mine``, the one sum
      gloo's all-reduce computes (IEEE addition is commutative: the same bits). gloo's
      all-reduce also sends the sum back (its all-gather half), which a reduce-scatter
      does not need: 0.65-0.7x the time at 45 MB. At more ranks the sum of several
      pieces is gloo's all-reduce of the input, in place (its summation order, kept),
      and this rank's slice copied out: gloo's own reduce-scatter clones the whole input
      first, this skips the clone (the same call on the same values: the same bits).

    The sends and receives progress on gloo's transport thread like its collectives
    and time out as they do (the process group's timeout); every rank issues them in the
    same order, as collectives must be."""

    def __init__(self, p2p: bool | None = None) -> None:
        ready = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if ready else 0
        self.world = dist.get_world_size() if ready else 1
        self.gloo = ready and dist.get_backend() == "gloo"
        self.p2p = GLOO_P2P if p2p is None else p2p

    def _pairwise(self, t: torch.Tensor) -> bool:
        return self.gloo and self.p2p and t.device.type == "cpu"

    @property
    def pairs(self) -> bool:
        """Two ranks exchanging by sends and receives (``exchange``): gloo, ``p2p``, world 2."""
        return self.gloo and self.p2p and self.world == 2

    def exchange(self, recvs: list[torch.Tensor], sends: list[torch.Tensor]):
        """With the other of two ranks: each of ``recvs`` is received from it and each of
        ``sends`` sent to it, in order (its ``sends`` are this rank's ``recvs``: the same
        sizes, one tag, matched in order)."""
        peer = 1 - self.rank
        works = [dist.irecv(t, peer, tag=REDUCE_TAG) for t in recvs]
        works += [dist.isend(t, peer, tag=REDUCE_TAG) for t in sends]
        return _InFlight(works)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor):
        if self.gloo and inp.device.type == "cpu" and inp.is_contiguous():
            mine = inp.view(self.world, -1)[self.rank]
            if self.world == 2 and self._pairwise(inp) and out.is_contiguous():
                if out.numel() == 0:
                    return _InFlight()
                peer = 1 - self.rank
                works = [dist.irecv(out, peer, tag=REDUCE_TAG),
                         dist.isend(inp.view(2, -1)[peer], peer, tag=REDUCE_TAG)]
                return _InFlight(works, lambda: out.add_(mine))
            return _InFlight([dist.all_reduce(inp, async_op=True)], lambda: out.copy_(mine))
        return _reduce_scatter(out, inp, async_op=True)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor):
        if self._pairwise(inp) and inp.is_contiguous() and out.stride(-1) == 1:
            if inp.numel() == 0:
                return _InFlight()
            rows = out.view(self.world, -1)  # out: [world, n], each row one contiguous segment
            works = []
            for q in range(self.world):
                if q != self.rank:
                    works.append(dist.irecv(rows[q], q, tag=GATHER_TAG))
                    works.append(dist.isend(inp, q, tag=GATHER_TAG))
            rows[self.rank].copy_(inp)
            return _InFlight(works)
        if out.is_contiguous():
            return _all_gather(out.view(-1), inp, async_op=True)
        return dist.all_gather(list(out.unbind(0)), inp, async_op=True)

    def all_reduce(self, t: torch.Tensor, op: str) -> None:
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])

    def all_gather_object(self, obj: Any, world: int) -> list[Any]:
        out: list[Any] = [None] * world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        dist.barrier()


class _InFlight:
    """Raw operations in flight (none: done already); ``wait`` waits for all of them, then
    runs ``then`` once (a reduce-scatter's sum, or its slice copied out of an all-reduce)."""

    def __init__(self, works: list | tuple = (), then: Callable[[], Any] | None = None) -> None:
        self.works, self.then = works, then

    def wait(self) -> None:
        works, self.works = self.works, ()
        for w in works:
            w.wait()
        then, self.then = self.then, None  # dropped: the tensors it holds are freed
        if then is not None:
            then()


class SimulatedCollectives:
    """Collectives of an N-rank group that exists only on paper: shapes are checked,
    no data moves (outputs keep whatever they hold; on fake tensors they hold none),
    and every rank is taken to hold the same objects. Used by the planner.

    ``calls`` counts what the real group would have moved: ``(kind, bytes, buckets)``
    -> calls, ``bytes`` the collective's full size (the reduce-scatter's input, the
    all-gather's output, the all-reduced tensor), ``buckets`` how many raw collectives
    the real run issues for it (``zero.bucket_mb``); kind 'object' for an object
    all-gather or a barrier (latency only). The planner's time model reads it."""

    def __init__(self, world: int, pairs: bool = False) -> None:
        """``pairs``: the group stands for two gloo ranks, which ``Comm`` reduces by
        exchanges (``TorchCollectives.pairs``)."""
        self.world = world
        self.pairs = pairs and world == 2
        self.calls: Counter[tuple[str, int, int]] = Counter()

    def reduce_scatter(self, out: torch.Tensor, inp: Any, buckets: int = 1) -> _InFlight:
        assert inp.numel() == self.world * out.numel(), (inp.shape, out.shape, self.world)
        self.calls["reduce_scatter", inp.numel() * inp.element_size(), buckets] += 1
        return _InFlight()

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, buckets: int = 1) -> _InFlight:
        assert out.numel() == self.world * inp.numel(), (out.shape, inp.shape, self.world)
        self.calls["all_gather", out.numel() * out.element_size(), buckets] += 1
        return _InFlight()

    def all_reduce(self, t: torch.Tensor, op: str, buckets: int = 1) -> None:
        assert op in ("sum", "max"), op
        self.calls["all_reduce", t.numel() * t.element_size(), buckets] += 1

    def all_gather_object(self, obj: Any, world: int) -> list[Any]:
        self.calls["object", 0, 1] += 1
        return [obj] * world

    def barrier(self) -> None:
        self.calls["object", 0, 1] += 1


class Pending:
    """An async collective: ``wait()`` blocks until done, counts its time, then runs
    ``then`` (e.g. accumulate a reduced shard)."""

    def __init__(self, works: list, stats: CommStats, nbytes: int, then=None,
                 keep: list | None = None, waited_s: float = 0.0) -> None:
        """``waited_s``: time already spent waiting on earlier buckets while issuing."""
        self._works, self._stats, self._nbytes, self._then = works, stats, nbytes, then
        self._keep = keep  # temporaries the collective reads or writes: alive until wait()
        self._waited = waited_s
        self._t0 = time.perf_counter()

    def wait(self) -> None:
        if self._works is None:
            return
        t = time.perf_counter()
        for w in self._works:
            w.wait()
        self._stats.add(self._nbytes, time.perf_counter() - t + self._waited)
        self._works = self._keep = None
        if self._then is not None:
            self._then()


class Comm:
    """Bucketed collectives over the default process group (or none)."""

    def __init__(self, ctx: DistContext, bucket_bytes: int,
                 advise: Advise = as_is, *, simulated_gloo: bool = True) -> None:
        """``advise(t)``: called on each fresh buffer the collectives and the ZeRO units
        allocate, before its first write, returning it (``mct.memory.host.HugePages``).
        ``simulated_gloo``: a simulated context stands for a gloo run (False: NCCL), so
        it takes the same paths (``pairs``)."""
        self.advise = advise
        self.ctx = ctx
        self.world = ctx.world_size
        self.rank = ctx.rank
        self.bucket_bytes = bucket_bytes
        self.stats = CommStats()
        self.simulated = ctx.backend == "simulated"
        self.simulated_gloo = self.simulated and simulated_gloo
        self.ops = (SimulatedCollectives(self.world, pairs=simulated_gloo and GLOO_P2P) if self.simulated
                    else TorchCollectives())
        # two ranks on the host over gloo: a unit's held gradients are sent as they are
        # (``reduce_scatter`` of a sendable ``HeldGrads``), no flat gradient built
        self.pairs = self.ops.pairs and ctx.device.type == "cpu"

    def reset_stats(self) -> None:
        self.stats = CommStats()

    def all_reduce_(self, t: torch.Tensor, op: str = "sum") -> None:
        """In place: t <- op over ranks of t (chunked by bucket size)."""
        if self.world == 1:
            return
        if op not in ("sum", "max"):
            raise ValueError(f"all_reduce_ op must be 'sum' or 'max', got {op!r}")
        if self.simulated:  # in place, chunked or not: no temporaries
            self.ops.all_reduce(t, op, buckets=-(-t.numel() // max(1, self.bucket_bytes // t.element_size())))
            self.stats.add(t.numel() * t.element_size(), 0.0)
            return
        t0 = time.perf_counter()
        flat = t.view(-1)
        step = max(1, self.bucket_bytes // t.element_size())
        for a in range(0, flat.numel(), step):
            self.ops.all_reduce(flat[a:a + step], op)
        self.stats.add(t.numel() * t.element_size(), time.perf_counter() - t0)

    def reduce_scatter(self, full: Any, out: torch.Tensor, async_op: bool = False,
                       then=None, window: int | None = None, bucket_major: bool = False) -> Pending | None:
        """Sum ``full`` [world * S] over ranks; this rank's slice [S] lands in ``out``.
        ``full`` is a tensor, or a source read one bucket at a time (``fill(dst, a, b)``:
        columns [a, b) of it viewed as [world, S] into ``dst``; ``mct.zero.flat.HeldGrads``),
        so no tensor of its full size need exist. ``window``: at most that many buckets
        in flight (None: all). ``bucket_major``: the tensor ``full`` holds, bucket after
        bucket (``bucket_slices(S, world, ...)``), each bucket's [world, b - a] columns
        contiguously at [world * a, world * b): every bucket reads its slice in place, no
        copy; ``full`` stays alive until the wait."""
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 bucket or None, got {window}")
        source = not isinstance(full, torch.Tensor)
        if self.world == 1:
            full.fill(out.view(1, -1), 0, out.numel()) if source else out.copy_(full)
            if then is not None:
                then()
            return None
        if source and self.pairs and getattr(full, "sendable", False):
            p = self._exchange(full, out, then)
            if not async_op:
                p.wait()
                return None
            return p
        S = out.numel()
        nbytes = full.numel() * full.element_size()
        chunks = bucket_slices(S, self.world, full.element_size(), self.bucket_bytes)
        waited = 0.0
        if len(chunks) == 1:
            if source:
                whole = self.advise(torch.empty(self.world, S, dtype=out.dtype, device=out.device))
                full.fill(whole, 0, S)
                full = whole.view(-1)
            works, keep = [self.ops.reduce_scatter(out, full)], [full]
        elif bucket_major:
            assert window is None, "a bucket-major input keeps every bucket in flight"
            if self.simulated and BUCKETS_AS_ONE:  # no temporaries to allocate: one shape-checked call
                works = [self.ops.reduce_scatter(out, full, buckets=len(chunks))]
            else:
                works = [self.ops.reduce_scatter(out[a:b], full[self.world * a:self.world * b]) for a, b in chunks]
            keep = [full]  # every bucket reads it in place until done
        elif self.simulated and BUCKETS_AS_ONE:
            # the buckets' contiguous copies of their columns, as many alive as the real
            # run holds at its peak and then until wait(): one tensor, in O(1) fake ops
            src = _one_tensor(*window_numels([self.world * (b - a) for a, b in chunks], window), out)
            works, keep = [self.ops.reduce_scatter(out, full, buckets=len(chunks))], [src]
        else:
            view = None if source else full.view(self.world, S)
            flight: deque = deque()  # (work, its input copy)
            for a, b in chunks:
                if len(flight) == window:
                    t = time.perf_counter()
                    flight.popleft()[0].wait()  # and its copy is freed
                    waited += time.perf_counter() - t
                src = self.advise(torch.empty(self.world, b - a, dtype=out.dtype, device=out.device))
                if source:
                    full.fill(src, a, b)
                else:
                    src.copy_(view[:, a:b])  # the columns' contiguous copy
                flight.append((self.ops.reduce_scatter(out[a:b], src.view(-1)), src))
            works, keep = [w for w, _ in flight], [c for _, c in flight]
        p = Pending(works, self.stats, nbytes, then, keep, waited)
        if not async_op:
            p.wait()
            return None
        return p

    def _exchange(self, held: Any, out: torch.Tensor, then) -> Pending:
        """The reduce-scatter of ``held`` (a sendable ``HeldGrads``) between two ranks, bucket
        by bucket: the other rank's row is sent in pieces straight from the gradients
        (zeros for a parameter with none here), this rank's received into ``out``, and at
        the wait this rank's own gradients are added: no flat gradient, no bucket copy,
        no window (nothing to free between buckets). ``out = (0 + theirs) + mine``, a
        cache-sized chunk at a time, has the bits of the flat buffers' sum ``(0 + theirs)
        + (0 + mine)``: ``0 + x`` differs from ``x`` only for -0.0, and ``(0 + t) + m``
        is the same for either zero ``m`` as ``0 + t`` is never -0.0. Columns no parameter
        covers (gaps, padding) are zeros, as in the flat buffer."""
        S, me = out.numel(), self.rank
        chunks = bucket_slices(S, 2, out.element_size(), self.bucket_bytes)
        mine: list[tuple[int, int, torch.Tensor | None]] = []
        works: list = []
        keep: list = [held]  # the sends read the gradients until the wait
        for a, b in chunks:
            sends = []
            for c0, c1, g in held.row(1 - me, a, b):
                if g is None:  # no gradient here on this rank
                    g = torch.zeros(c1 - c0, dtype=out.dtype, device=out.device)
                    keep.append(g)
                sends.append(g)
            recvs, at = [], a
            for c0, c1, g in held.row(me, a, b):
                if a + c0 > at:
                    out[at:a + c0].zero_()
                recvs.append(out[a + c0:a + c1])
                mine.append((a + c0, a + c1, g))
                at = a + c1
            if b > at:
                out[at:b].zero_()
            if not self.simulated:
                works.append(self.ops.exchange(recvs, sends))
        if self.simulated:  # one counted call, as the real run's buckets
            works = [self.ops.reduce_scatter(out, held, buckets=len(chunks))]
        zero = torch.zeros(1, dtype=out.dtype, device=out.device)

        def finish() -> None:
            for x, y, g in mine:
                step = y - x if self.simulated else SUM_CHUNK  # the same ops' bytes in O(1) fake ops
                for k in range(x, y, step):
                    o = out[k:min(k + step, y)]
                    o.add_(zero)
                    if g is not None:
                        o.add_(g[k - x:k - x + o.numel()])
            if then is not None:
                then()
        return Pending(works, self.stats, held.numel() * held.element_size(), finish, keep)

    def all_gather(self, shard: torch.Tensor, full: torch.Tensor, async_op: bool = False,
                   window: int | None = None) -> Pending | None:
        """``full`` [world * S] <- concatenation of every rank's ``shard`` [S].
        ``window``: at most that many buckets in flight (None: all)."""
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 bucket or None, got {window}")
        if self.world == 1:
            full.copy_(shard)
            return None
        S = shard.numel()
        chunks = bucket_slices(S, self.world, full.element_size(), self.bucket_bytes)
        if len(chunks) == 1:
            works = [self.ops.all_gather(full, shard)]
            p = Pending(works, self.stats, full.numel() * full.element_size(), keep=[shard])
        elif self.simulated and BUCKETS_AS_ONE:
            # every bucket lands in place (below): no temporaries to allocate, one call
            works = [self.ops.all_gather(full, shard, buckets=len(chunks))]
            p = Pending(works, self.stats, full.numel() * full.element_size(), keep=[shard])
        else:
            # bucket [a, b) lands straight in its columns of ``full`` viewed as [world, S]
            # (one contiguous row segment per rank): no receive buffer, no copy back
            view = full.view(self.world, S)
            flight: deque = deque()
            waited = 0.0
            for a, b in chunks:
                if len(flight) == window:
                    t = time.perf_counter()
                    flight.popleft().wait()
                    waited += time.perf_counter() - t
                flight.append(self.ops.all_gather(view[:, a:b], shard[a:b]))
            p = Pending(list(flight), self.stats, full.numel() * full.element_size(), keep=[shard],
                        waited_s=waited)
        if not async_op:
            p.wait()
            return None
        return p

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        return self.ops.all_gather_object(obj, self.world)

    def barrier(self) -> None:
        if self.world > 1:
            self.ops.barrier()


def first_mismatch(comm: Comm, what: str, items: list[tuple[str, str]]) -> str | None:
    """The one-line error (the same on every rank) naming the first entry of ``items``
    (a list of (name, description) pairs) on which the ranks disagree, or None when
    they hold the same: for ``mct.dist.agree``. One small all-gather of a digest; the
    full lists are exchanged only on mismatch. Collective."""
    digest = hashlib.sha256(repr(items).encode()).hexdigest()
    digests = comm.all_gather_object(digest)
    if len(set(digests)) == 1:
        return None
    lists = comm.all_gather_object(items)
    for r, other in enumerate(lists):
        if other == lists[0]:
            continue
        for i in range(max(len(other), len(lists[0]))):
            a = lists[0][i] if i < len(lists[0]) else ("<missing>", "")
            b = other[i] if i < len(other) else ("<missing>", "")
            if a != b:
                return (f"ranks disagree on the {what}: entry {i} is {a[0]} {a[1]} on rank 0 but "
                        f"{b[0]} {b[1]} on rank {r}. Build the same model (same config and seed) on every rank.")
    return f"ranks disagree on the {what} (digests {digests})"
