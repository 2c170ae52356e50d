"""The time model: a configuration's seconds per step, from the dry run's own counts
(``mct.planner.work.StepWork``) and this machine's measured rates (``mct.machine``).

    step_s = compute + overhead + communication + offload

- **compute**: each op of the steady-state step on its own roofline,
  ``max(FLOPs / matmul rate, bytes / elementwise rate)``. The matmul rate is the
  profile's one-thread rate of the op's dtype at its smallest matrix dimension
  (``extra['matmul_by_dim']``: a matmul with a short side runs far below the square peak);
  threads speed up the large ones (the measured every-thread speed-up, blended in from 2 x
  64^3 to 2 x 512^3 FLOPs). The elementwise rate is the one-thread rate of the usual
  elementwise ops of the op's dtype at its bytes (``extra['elementwise_curve']`` for fp32,
  ``extra['elementwise_by_dtype']`` for bf16/fp16, fp32's where not measured: cache-resident
  tensors move faster; an op of a ``OP_KINDS`` kind at its kind's, ``extra['elementwise_by_kind']``:
  arithmetic runs several times the mix's rate, softmax and norms below it) x threads, the largest size's at most the every-thread copy rate shared by
  the ranks on this machine. The CPU's fused attention kernels at their own measured
  rates by head width (``extra['attention_by_dim']``; a matmul's when not measured). Random numbers (dropout's masks, ``StepWork.random``) at
  the measured ``bernoulli_`` rate, on top of their ops' bytes.
- **overhead**: ``ops x op_overhead_s + bytes x byte_overhead_s`` (+ the ops that pass
  through one of the Python dispatch modes a step runs (mct's upcast of bf16 matmuls, torch's
  selective-checkpoint caches) x what that mode costs, ``StepWork.modes``): what one dispatched op
  costs beyond its roofline (Python, the dispatcher, autograd, the engine's memory
  tracker), and what each byte the ops move costs inside a real step beyond the
  microbenchmarks' rates (inputs out of the caches, fresh allocations); with ranks, what
  ranks stepping at once on one machine cost each other (shared cores and caches).
  Measured on first use at the rank's own threads (``mct.planner.overhead.machine_rates`` says why) and, for a
  world, with that many ranks stepping at once: the median of real steps of a tiny
  built-in GPT (ops that move almost nothing) and of one with ops of a small model's
  sizes, minus their predicted compute, solved for the two (``mct.planner.overhead``: ``measure_op_overhead``,
  ``fit_overhead``).
- **communication**: each collective ``buckets x latency + bytes / bandwidth`` with
  the latency and bandwidth of that kind measured at the world size on this machine
  (gloo on CPU, NCCL on CUDA: ``mct.machine.collectives``); a context group's at its group
  size, measured with every group of that size in the world timing at once
  (``measure_group_collectives``, ``Rates.groups``), plus a rank's wait for the
  slower rank at each collective call as measured on real steps at that world
  (``measure_op_overhead``); no overlap with compute.
- **offload**: the bytes a step moves to and from disk at the measured disk rate (host
  memory: the pinned host-to-device rate on CUDA; on a CPU device the copies are ops
  already counted).

Known errors (docs/planner.md): no overlap of communication or offload I/O with compute;
a loaded machine runs slower than its profile; a world larger than this machine is
extrapolated from the largest world measured here (ring scaling).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from mct.machine import MachineProfile, usable_cores
from mct.planner.work import StepWork

BLEND = (2 * 64 ** 3, 2 * 512 ** 3)
"""Matmul FLOPs between which the threads' speed-up is blended in (small matmuls run on one thread)."""
PARALLEL_BYTES = 2**18
"""Elementwise ops moving at least this many bytes run on every thread of the rank: torch
splits an elementwise kernel over its threads from 32,768 elements (``GRAIN_SIZE``), an
fp32 op that reads one such tensor and writes another moving 256 KiB."""
MAX_MEASURED_WORLD = 8


@dataclass(frozen=True)
class Rates:
    """What turns one rank's ``StepWork`` into seconds: ``matmul`` {dtype: ((smallest
    dimension, FLOP/s of a large matmul), ...)} ascending, at this rank's threads (one
    thread's for small matmuls: see ``matmul_s``); ``speedup`` {dtype: threads' speed-up of
    large matmuls}; ``elementwise`` ((bytes, bytes/s), ...) ascending, per rank; ``op_s``:
    overhead per dispatched op; ``collectives`` {kind: (latency s, bytes/s)} at the world
    size; ``tiers`` {'cpu'|'disk': bytes/s} of offload traffic (absent: counted in the
    ops); ``notes``: what was not measured; ``random_per_s``: random elements drawn per
    second (0: not measured, not counted); ``wait_s``: what a rank waits for the others
    at each collective call of a real step beyond the collective's own time; ``attention``
    {dtype: {'forward'|'backward': ((head width, FLOP/s), ...)}} of the fused attention
    kernels, one thread (absent: timed as a matmul)."""

    matmul: dict[str, tuple[tuple[float, float], ...]]
    speedup: dict[str, float]
    elementwise: tuple[tuple[float, float], ...]
    op_s: float
    collectives: dict[str, tuple[float, float]] = field(default_factory=dict)
    tiers: dict[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    random_per_s: float = 0.0
    wait_s: float = 0.0
    attention: dict[str, dict[str, tuple[tuple[float, float], ...]]] = field(default_factory=dict)
    elementwise_by: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    """``elementwise`` of the ops of another dtype ({'bf16': ...}), where measured."""
    byte_s: float = 0.0
    """Seconds per byte an op reads or writes inside a real step beyond its roofline (inputs
    that left the caches, fresh allocations; measured on real steps, ``measure_op_overhead``);
    in ``StepTime.overhead_s`` with the per-op ``op_s``; an op of ``PARALLEL_BYTES`` or more
    splits it over the rank's ``threads`` as its kernel does, when it is measured as when it
    is charged (``charged_bytes``)."""
    threads: int = 1
    """The rank's torch threads (``byte_cost``)."""
    elementwise_kinds: dict[str, dict[str, tuple[tuple[float, float], ...]]] = field(default_factory=dict)
    """{kind: {dtype: curve}} of the ops of ``mct.planner.work.OP_KINDS``, where measured (the
    rank's threads in them as ``elementwise``'s); an op of another kind, or of a kind or
    dtype not measured, runs at ``elementwise`` (``elementwise_by``)."""
    mode_op_s: float = 0.0
    """Seconds an op costs passing through one of mct's Python dispatch modes
    (``StepWork.modes``; ``extra['python_mode_op_s']``; 0: not measured)."""
    matmul_reach: tuple[tuple[float, float], ...] = ()
    """((FLOPs, fraction), ...) ascending: how much of ``speedup`` a matmul of that many FLOPs
    reaches (the profile's measured ``extra['matmul_speedup']``); empty: blended in over
    ``BLEND``."""
    tracker_op_s: float = 0.0
    """Seconds an op costs through the CPU memory tracker (``extra['tracker_op_s']``), charged
    to a step that tracks memory (``step_time(..., tracked=True)``); ``op_s`` is measured on
    steps without it."""
    mode_op_by: dict[str, float] = field(default_factory=dict)
    """{mode: seconds an op costs passing through it} of the modes whose cost was measured
    apart (``StepWork.modes`` 'selective_checkpoint': ``extra['selective_mode_op_s']``);
    any other mode costs ``mode_op_s``."""
    groups: dict[int, dict[str, tuple[float, float]]] = field(default_factory=dict)
    """{group size: {kind: (latency s, bytes/s)}} of the context group's collectives
    (``mct.machine.collectives.GROUP_KINDS``) within groups of that size at the world
    (``group_collectives``); a size or kind absent is timed at ``collectives``' rate of that
    kind (the world's), 0 where neither was measured."""

    def matmul_s(self, dtype: str, flops: float, dim: int) -> float:
        """Seconds of one matmul-like op of ``flops`` in ``dtype`` (fp32's rates when
        ``dtype`` has none) whose smallest dimension is ``dim`` (0: unknown, the largest
        measured), beyond a call's fixed cost (``op_s``)."""
        curve = self.matmul.get(dtype) or self.matmul["fp32"]
        rate = _loglog(curve, dim) if dim > 0 else curve[-1][1]
        return flops / (rate * self.gain(flops, dtype))

    def gain(self, flops: float, dtype: str) -> float:
        """The threads' speed-up of a matmul-like op of ``flops`` in ``dtype``: the measured
        share of the large matmuls' ``speedup`` a matmul of that size reaches
        (``matmul_reach``), else blended in over ``BLEND``."""
        full = self.speedup.get(dtype, 1.0)
        if not self.matmul_reach:
            return _blend(flops, full)
        return 1.0 + (full - 1.0) * _loglin(self.matmul_reach, flops)

    def attention_s(self, phase: str, dtype: str, flops: float, dim: int) -> float:
        """Seconds of a fused attention kernel (``phase`` 'forward' | 'backward') of ``flops``
        at head width ``dim``: its measured curve, x the threads' speed-up as a matmul's;
        a matmul's time where the curve was not measured."""
        curve = self.attention.get(dtype, {}).get(phase)
        if not curve:
            return self.matmul_s(dtype, flops, dim)
        return flops / (_loglog(curve, dim) * self.gain(flops, dtype))

    def memory_s(self, nbytes: float, dtype: str = "fp32", kind: str = "") -> float:
        """Seconds of an elementwise op of ``dtype`` and ``kind`` that reads and writes
        ``nbytes`` (the kind's curve of that dtype, else the usual mix's of that dtype,
        else fp32's)."""
        if nbytes <= 0:
            return 0.0
        curve = self.elementwise_kinds.get(kind, {}).get(dtype) or self.elementwise_by.get(dtype, self.elementwise)
        return nbytes / _loglog(curve, nbytes)

    def collective_s(self, kind: str, nbytes: float, buckets: int, group: int = 0) -> float:
        """Seconds of one collective (kind 'object': an object all-gather or barrier,
        two small all-reduces' latency; 'send_recv': one ring exchange, at the all-gather's
        rates unless measured) over the world, or (``group`` > 0) within a group of that many
        ranks (``groups``, else the world's rate of ``kind``); 0 when this kind was not measured."""
        if kind == "object":
            lat = self.collectives.get("all_reduce", (0.0, 1.0))[0]
            return 2 * lat + self.wait_s
        if kind == "send_recv" and kind not in self.collectives and kind not in self.groups.get(group, {}):
            # a ring step (mct.context.ring): each rank sends and receives ``nbytes``, the traffic of
            # a 2-rank all-gather of 2 x nbytes; priced at the all-gather's rates, not overlapped
            kind, nbytes = "all_gather", 2 * nbytes
        got = self.groups.get(group, {}).get(kind) if group else None
        if got is None and kind not in self.collectives:
            return 0.0
        lat, bw = got or self.collectives[kind]
        return buckets * lat + nbytes / bw + self.wait_s

    def byte_cost(self, nbytes: float) -> float:
        """Seconds an op that moves ``nbytes`` costs inside a step beyond its roofline
        (``byte_s``; split over the threads from ``PARALLEL_BYTES``)."""
        return nbytes * self.byte_s / (self.threads if nbytes >= PARALLEL_BYTES else 1)

    def charged_bytes(self, work: StepWork) -> float:
        """The bytes of ``work``'s ops as the per-byte cost charges them at these threads
        (``byte_cost`` with ``byte_s`` 1): an op of ``PARALLEL_BYTES`` or more splits its
        bytes over the threads. Both the fit (``measure_op_overhead``) and ``step_time``
        count them so, so a cost measured at N threads is charged alike at N."""
        one = dataclasses.replace(self, byte_s=1.0)
        return (sum(n * one.byte_cost(key[2]) for key, n in work.ops.items())
                + sum(n * one.byte_cost(key[3]) for key, n in work.attention.items()))

    def random_s(self, elements: float) -> float:
        """Seconds of drawing ``elements`` random numbers (0 when the rate was not measured)."""
        return elements / self.random_per_s if self.random_per_s > 0 else 0.0


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one step, by term (module docstring)."""

    compute_s: float
    overhead_s: float
    comm_s: float
    offload_s: float

    @property
    def total(self) -> float:
        return self.compute_s + self.overhead_s + self.comm_s + self.offload_s

    def to_dict(self) -> dict[str, float]:
        return {"compute_s": self.compute_s, "overhead_s": self.overhead_s, "comm_s": self.comm_s,
                "offload_s": self.offload_s}


def step_time(work: StepWork, rates: Rates, *, tracked: bool = False) -> StepTime:
    """The seconds of one step of ``work`` at ``rates`` (the module docstring's sum).
    ``tracked``: a step the CPU memory tracker counts (every op through its dispatch mode,
    ``Rates.tracker_op_s`` each): every step of the Engine API's default and of a run with
    ``memory.enforce``; `mct train` tracks only its logged steps, so its median step is an
    untracked one."""
    compute = 0.0
    for key, n in work.ops.items():
        dtype, flops, nbytes, dim = key[:4]
        kind = key[4] if len(key) > 4 else ""
        compute += n * max(rates.matmul_s(dtype, flops, dim) if flops else 0.0, rates.memory_s(nbytes, dtype, kind))
    for (phase, dtype, flops, nbytes, dim), n in work.attention.items():
        compute += n * max(rates.attention_s(phase, dtype, flops, dim), rates.memory_s(nbytes, dtype))
    compute += sum(n * rates.random_s(elements) for elements, n in work.random.items())
    comm = sum(n * rates.collective_s(*key) for key, n in work.comm.items())
    offload = sum(nbytes / rates.tiers[tier] for tier, nbytes in work.offload.items() if rates.tiers.get(tier))
    moved = rates.byte_s * rates.charged_bytes(work) if rates.byte_s else 0.0
    moded = sum(n * rates.mode_op_by.get(mode, rates.mode_op_s) for mode, n in work.modes.items())
    per_op = rates.op_s + (rates.tracker_op_s if tracked else 0.0)
    return StepTime(compute, work.n_ops * per_op + moved + moded, comm, offload)


def _loglog(points: tuple[tuple[float, float], ...] | list, x: float) -> float:
    """y at ``x`` on the piecewise-linear interpolation of ``points`` in log-log (the
    end's y beyond either end)."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            w = math.log(x / x0) / math.log(x1 / x0)
            return math.exp(math.log(y0) + w * (math.log(y1) - math.log(y0)))
    return points[-1][1] if x > points[-1][0] else points[0][1]


def _loglin(points: tuple[tuple[float, float], ...], x: float) -> float:
    """y at ``x`` on the interpolation of ``points`` linear in log x (the end's y beyond either end)."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * math.log(x / x0) / math.log(x1 / x0)
    return points[-1][1] if x > points[-1][0] else points[0][1]


def threads_per_rank(world: int, device: str = "cpu") -> int:
    """The torch threads each rank of a ``world``-rank run on this machine uses: the
    usable cores shared out (``mct train --nproc`` sets OMP_NUM_THREADS so); 1 on CUDA."""
    return 1 if device == "cuda" else max(1, usable_cores() // max(1, world))


def rates_for(profile: MachineProfile, world: int, threads: int | None = None, *,
              ranks_here: int | None = None) -> Rates:
    """``Rates`` of one rank of a ``world``-rank run from ``profile`` alone (what it has
    not measured falls back: the flat peak for a missing curve, the 32 MiB copy rate,
    no overhead, no communication, each named in ``notes``). ``threads``: per rank
    (default ``threads_per_rank``); ``ranks_here``: ranks sharing this machine's memory
    bandwidth (default: the world, at most one per core)."""
    device = profile.device
    threads = threads or threads_per_rank(world, device)
    ranks_here = ranks_here or (1 if device == "cuda" else max(1, min(world, usable_cores())))
    extra, notes = profile.extra, []
    matmul, speedup = {}, {}
    for dtype, one in profile.matmul_one.items():
        speedup[dtype] = _speedup(profile, dtype, threads)
        curve = extra.get("matmul_by_dim", {}).get(dtype)
        if not curve:
            notes.append(f"no {dtype} matmul rates by dimension: the peak for every shape")
            curve = [[1.0, one]]
        matmul[dtype] = tuple((float(d), float(r)) for d, r in curve)
    curve = extra.get("elementwise_curve") or [[64.0 * 2**20, 2.0 * profile.memcpy_bytes_per_s]]
    share = 2.0 * extra.get("copy_all_bytes_per_s", profile.memcpy_bytes_per_s * threads) / ranks_here
    x = _elementwise_gain(profile, threads)
    elementwise = _threaded(curve, x, share)
    by_dtype = {k: _threaded(c, x, share) for k, c in (extra.get("elementwise_by_dtype") or {}).items() if c}
    kinds = {kind: {k: _threaded(c, x, share) for k, c in curves.items() if c}
             for kind, curves in (extra.get("elementwise_by_kind") or {}).items()}
    ranks_cpu = ranks_here if device == "cpu" else 1
    op_s = _op_overhead(extra.get("op_overhead_s", {}), threads, ranks_cpu, notes)
    byte_s = _at_threads(extra.get("byte_overhead_s", {}), threads, ranks_cpu)
    if byte_s is None and ranks_cpu > 1:
        byte_s = _at_threads(extra.get("byte_overhead_s", {}), threads, 1)
    random = float(extra.get("random_elements_per_s") or 0.0)
    if not random:
        notes.append("no random-number rate measured: dropout's masks timed as their bytes only")
    collectives: dict[str, tuple[float, float]] = {}
    wait, groups = 0.0, {}
    if world > 1:
        collectives = _collectives(profile, world)
        groups = {g: got for g in context_sizes(world) if (got := group_collectives(profile, world, g))}
        wait = float(_at_threads(extra.get("collective_wait_s", {}), threads, ranks_here) or 0.0)
        if not collectives:
            notes.append(f"no collectives measured for {world} ranks: communication not counted")
    tiers = {"disk": float(extra.get("disk_bytes_per_s") or 0.0)}
    if device == "cuda" and extra.get("host_bytes_per_s"):
        tiers["cpu"] = float(extra["host_bytes_per_s"])
    return Rates(matmul, speedup, elementwise, float(op_s or 0.0), collectives,
                 {k: v for k, v in tiers.items() if v}, tuple(notes), random, wait, _attention(extra), by_dtype,
                 float(byte_s or 0.0), 1 if device == "cuda" else threads, kinds,
                 float(extra.get("python_mode_op_s") or 0.0),
                 _matmul_reach(profile), float(extra.get("tracker_op_s") or 0.0) if device == "cpu" else 0.0,
                 {"selective_checkpoint": float(extra.get("selective_mode_op_s") or 0.0)}, groups)


def _elementwise_gain(profile: MachineProfile, threads: int) -> Callable[[float], float]:
    """What ``threads`` threads gain on an elementwise op by the bytes it moves (torch splits
    one over its threads from ~32k elements): the profile's measured every-core gain at that
    size (``extra['elementwise_speedup']``), linear in the threads between one and every core;
    the thread count where not measured or beyond the cores; 1 on CUDA and at one thread."""
    if profile.device == "cuda" or threads <= 1:
        return lambda nbytes: 1.0
    gained = tuple((float(b), float(x)) for b, x in profile.extra.get("elementwise_speedup") or [])
    cores = max(1, profile.threads)
    if not gained or threads > cores:
        return lambda nbytes: float(threads)
    share = (threads - 1) / max(1, cores - 1)
    return lambda nbytes: 1.0 + (max(1.0, _loglin(gained, nbytes)) - 1.0) * share


def _matmul_reach(profile: MachineProfile) -> tuple[tuple[float, float], ...]:
    """``Rates.matmul_reach`` from the profile's measured fp32 ``matmul_speedup`` (the share
    of the large matmuls' speed-up each size reached, between 0 and 1; the large size's
    itself 1); () where not measured (CUDA, one core)."""
    measured = profile.extra.get("matmul_speedup") or []
    full = profile.matmul_all.get("fp32", 0.0) / profile.matmul_one["fp32"]
    if not measured or profile.device == "cuda" or full <= 1.0:
        return ()
    big = 2.0 * profile.matmul_size.get("fp32", 2048) ** 3
    points = [(float(f), min(1.0, max(0.0, (x - 1.0) / (full - 1.0)))) for f, x in measured if f < big]
    return tuple(points) + ((big, 1.0),)


def _threaded(curve: list, gain: Callable[[float], float], share: float) -> tuple[tuple[float, float], ...]:
    """A one-thread elementwise curve at the rank's threads: ops of ``PARALLEL_BYTES`` or
    more run on all of them, ``gain(bytes)`` times as fast, the largest capped by the rank's
    ``share`` of copy bandwidth."""
    return tuple((float(b), r * (gain(b) if b >= PARALLEL_BYTES else 1.0)) for b, r in curve[:-1]) + (
        (float(curve[-1][0]), min(curve[-1][1] * gain(curve[-1][0]), share)),)


def _attention(extra: dict[str, Any]) -> dict[str, dict[str, tuple[tuple[float, float], ...]]]:
    """The profile's fused attention curves as ``Rates.attention`` holds them."""
    return {dtype: {phase: tuple((float(d), float(r)) for d, r in curve) for phase, curve in phases.items() if curve}
            for dtype, phases in (extra.get("attention_by_dim") or {}).items()}


def overhead_key(threads: int, ranks: int) -> str:
    """The ``op_overhead_s`` key of ``ranks`` ranks of ``threads`` threads stepping at once
    on one machine: '<threads>' for one process alone, '<threads>x<ranks>'."""
    return str(threads) if ranks <= 1 else f"{threads}x{ranks}"


def _op_overhead(measured: dict[str, float], threads: int, ranks: int, notes: list[str]) -> float | None:
    """The per-op overhead of ``ranks`` ranks at ``threads`` (else at one thread: what
    ``overhead.machine_rates`` measures); one process alone's when the ranks' was not measured
    (noted: it misses what the ranks cost each other)."""
    op_s = _at_threads(measured, threads, ranks)
    if op_s is None and ranks > 1:
        op_s = _at_threads(measured, threads, 1)
        if op_s is not None:
            notes.append(f"per-op overhead of one process alone at {threads} thread(s): {ranks} ranks "
                         "stepping at once not measured (mct calibrate --world-size)")
    if op_s is None:
        notes.append(f"no per-op overhead measured at {threads} thread(s)")
    return op_s


def _at_threads(measured: dict[str, float], threads: int, ranks: int) -> float | None:
    """The value measured for ``ranks`` ranks at ``threads``, else at one thread, else None."""
    got = measured.get(overhead_key(threads, ranks))
    return measured.get(overhead_key(1, ranks)) if got is None else got


def _speedup(profile: MachineProfile, dtype: str, threads: int) -> float:
    """Large matmuls' speed-up of ``threads`` over one thread: measured at every core,
    linear in between, never below 1 (a loaded machine can measure less)."""
    if profile.device == "cuda" or threads <= 1:
        return 1.0
    full = max(1.0, profile.matmul_all.get(dtype, 0.0) / profile.matmul_one[dtype])
    if threads >= profile.threads or profile.threads <= 1:
        return full
    return 1.0 + (full - 1.0) * (threads - 1) / (profile.threads - 1)


def _blend(flops: float, speedup: float) -> float:
    lo, hi = BLEND
    w = min(1.0, max(0.0, math.log(max(flops, lo) / lo) / math.log(hi / lo)))
    return 1.0 + (speedup - 1.0) * w


def collective_key(profile: MachineProfile, world: int) -> str:
    return f"{'nccl' if profile.device == 'cuda' else 'gloo'}:{world}"


def measured_world(profile: MachineProfile, world: int) -> int:
    """The world size collectives are measured at for a ``world``-rank plan: itself up
    to this machine's cores (CUDA: devices) and ``MAX_MEASURED_WORLD``, at least 2."""
    here = torch.cuda.device_count() if profile.device == "cuda" else usable_cores()
    return max(2, min(world, here, MAX_MEASURED_WORLD))


def _collectives(profile: MachineProfile, world: int) -> dict[str, tuple[float, float]]:
    """The profile's collectives for ``world``: measured at ``measured_world`` and, for a
    larger world, scaled as a ring (latency x (w-1), bandwidth x ((w0-1)/w0) / ((w-1)/w))."""
    w0 = measured_world(profile, world)
    got = profile.extra.get("collectives", {}).get(collective_key(profile, w0))
    if not got:
        return {}
    lat_x = (world - 1) / (w0 - 1)
    bw_x = ((w0 - 1) / w0) / ((world - 1) / world)
    return {k: (float(v[0]) * lat_x, float(v[1]) * bw_x) for k, v in got.items()}


def context_sizes(world: int) -> tuple[int, ...]:
    """The context group sizes a ``world``-rank run may have: its divisors from 2."""
    return tuple(g for g in range(2, world + 1) if world % g == 0)


def group_key(profile: MachineProfile, world: int, group: int) -> tuple[str, int]:
    """(the profile's ``extra['collectives']`` key, measured group size) that times the
    collectives of a context group of ``group`` ranks in a ``world``-rank run:
    '<backend>:<w>/<g>', groups of g ranks in a world of w, all timing at once. g is
    ``group`` up to ``measured_world``; w the largest multiple of g up to it (so a
    4-rank run's groups of 2 on a 2-core machine are timed as one group of 2)."""
    w0 = measured_world(profile, world)
    g = min(group, w0)
    return f"{'nccl' if profile.device == 'cuda' else 'gloo'}:{w0 - w0 % g}/{g}", g


def group_collectives(profile: MachineProfile, world: int, group: int) -> dict[str, tuple[float, float]]:
    """The context group's collectives for groups of ``group`` ranks in a ``world``-rank
    run, from the profile (``group_key``): a larger group than measured scaled as a ring,
    as ``_collectives`` scales the world's; {} where not measured."""
    key, g = group_key(profile, world, group)
    got = profile.extra.get("collectives", {}).get(key)
    if not got:
        return {}
    lat_x = (group - 1) / (g - 1)
    bw_x = ((g - 1) / g) / ((group - 1) / group)
    return {k: (float(v[0]) * lat_x, float(v[1]) * bw_x) for k, v in got.items()}


def tokens_per_step(batch: Any, grad_accum: int, world: int) -> int:
    """Tokens a step trains on: the micro-batch's first tensor's elements x micro-batches x ranks."""
    micro = batch[0] if isinstance(batch, list) and batch else batch
    leaves = [t for t in torch.utils._pytree.tree_leaves(micro) if isinstance(t, torch.Tensor)]
    return (leaves[0].numel() if leaves else 0) * grad_accum * world
