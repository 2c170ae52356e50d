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
  tensors move faster; an op of a ``KINDS`` kind at its kind's, ``extra['elementwise_by_kind']``:
  arithmetic runs several times the mix's rate, softmax and norms below it) x threads, the largest size's at most the every-thread copy rate shared by
  the ranks on this machine. The CPU's fused attention kernels at their own measured
  rates by head width (``extra['attention_by_dim']``; a matmul's when not measured). Random numbers (dropout's masks, ``StepWork.random``) at
  the measured ``bernoulli_`` rate, on top of their ops' bytes.
- **overhead**: ``ops x op_overhead_s + bytes x byte_overhead_s`` (+ the ops that pass
  through one of mct's Python dispatch modes x what that costs, ``StepWork.modes``): what one dispatched op
  costs beyond its roofline (Python, the dispatcher, autograd, the engine's memory
  tracker), and what each byte the ops move costs inside a real step beyond the
  microbenchmarks' rates (inputs out of the caches, fresh allocations); with ranks, what
  ranks stepping at once on one machine cost each other (shared cores and caches).
  Measured on first use at the rank's own threads (``machine_rates`` says why) and, for a
  world, with that many ranks stepping at once: the median of real steps of a tiny
  built-in GPT (ops that move almost nothing) and of one with ops of a small model's
  sizes, minus their predicted compute, solved for the two (``measure_op_overhead``,
  ``fit_overhead``).
- **communication**: each collective ``buckets x latency + bytes / bandwidth`` with
  the latency and bandwidth of that kind measured at the world size on this machine
  (gloo on CPU, NCCL on CUDA: ``mct.machine.collectives``), plus a rank's wait for the
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
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from mct.config import EngineConfig
from mct.dist import DistContext
from mct.engine import Engine
from mct.machine import MachineProfile, calibrate, usable_cores
from mct.machine.cache import cached, remember
from mct.machine.collectives import measure_collectives, spawn_ranks
from mct.models.gpt import GPT, gpt_loss
from mct.planner.dry_run import dry_run
from mct.planner.work import StepWork

BLEND = (2 * 64 ** 3, 2 * 512 ** 3)
"""Matmul FLOPs between which the threads' speed-up is blended in (small matmuls run on one thread)."""
PARALLEL_BYTES = 2**18
"""Elementwise ops moving at least this many bytes run on every thread of the rank: torch
splits an elementwise kernel over its threads from 32,768 elements (``GRAIN_SIZE``), an
fp32 op that reads one such tensor and writes another moving 256 KiB."""
OVERHEAD_MODEL = {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16, "vocab_size": 128, "dropout": 0.0}
"""The built-in GPT whose real steps measure the per-op overhead: small enough that its
ops cost almost nothing but their dispatch (micro-batch 2)."""
SIZED_MODEL = {"n_layer": 2, "n_head": 4, "d_model": 128, "seq_len": 128, "vocab_size": 512, "dropout": 0.0}
"""The built-in GPT whose real steps measure the per-byte cost: ops of the sizes a small
model's step has (micro-batch 4: activations of 512 tokens x 128, 256 KiB; an MLP's and
the attention scores 1 MiB), whose kernels run slower inside a step than the profile's
microbenchmarks time them (inputs that left the core's caches, fresh allocations; softmax,
GELU and norms slower per byte than the elementwise mix)."""
OVERHEAD_STEPS = 10
"""Timed steps of each calibration engine (after two warm-ups)."""
STEP_QUANTILE = 0.5
"""Which of those steps' times is used (0: the fastest, 0.5: the median). The median: the
time model predicts a run's median step (what ``mct report`` and the summary set beside
it), and a step's spread is not noise around the fastest one. On a quiet 2-core machine the
median of 10 steps of the same configuration was 10-20% above the fastest at 2 threads
(every step of a 2-thread op waits at OpenMP's barrier for the slower core), so a
calibration from the fastest steps predicted every 1-rank row 20-30% fast, from the median
within 1-10% (``docs/planner.md``). The price: a calibration measured while another job
loads the machine predicts that load (``mct calibrate --force`` measures again)."""
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
    """{kind: {dtype: curve}} of the ops of ``mct.planner.work.KINDS``, where measured (the
    rank's threads in them as ``elementwise``'s); an op of another kind, or of a kind or
    dtype not measured, runs at ``elementwise`` (``elementwise_by``)."""
    mode_op_s: float = 0.0
    """Seconds an op costs passing through one of mct's Python dispatch modes
    (``StepWork.modes``; ``extra['python_mode_op_s']``; 0: not measured)."""

    def matmul_s(self, dtype: str, flops: float, dim: int) -> float:
        """Seconds of one matmul-like op of ``flops`` in ``dtype`` (fp32's rates when
        ``dtype`` has none) whose smallest dimension is ``dim`` (0: unknown, the largest
        measured), beyond a call's fixed cost (``op_s``)."""
        curve = self.matmul.get(dtype) or self.matmul["fp32"]
        rate = _loglog(curve, dim) if dim > 0 else curve[-1][1]
        return flops / (rate * _blend(flops, self.speedup.get(dtype, 1.0)))

    def attention_s(self, phase: str, dtype: str, flops: float, dim: int) -> float:
        """Seconds of a fused attention kernel (``phase`` 'forward' | 'backward') of ``flops``
        at head width ``dim``: its measured curve, x the threads' speed-up as a matmul's;
        a matmul's time where the curve was not measured."""
        curve = self.attention.get(dtype, {}).get(phase)
        if not curve:
            return self.matmul_s(dtype, flops, dim)
        return flops / (_loglog(curve, dim) * _blend(flops, self.speedup.get(dtype, 1.0)))

    def memory_s(self, nbytes: float, dtype: str = "fp32", kind: str = "") -> float:
        """Seconds of an elementwise op of ``dtype`` and ``kind`` that reads and writes
        ``nbytes`` (the kind's curve of that dtype, else the usual mix's of that dtype,
        else fp32's)."""
        if nbytes <= 0:
            return 0.0
        curve = self.elementwise_kinds.get(kind, {}).get(dtype) or self.elementwise_by.get(dtype, self.elementwise)
        return nbytes / _loglog(curve, nbytes)

    def collective_s(self, kind: str, nbytes: float, buckets: int) -> float:
        """Seconds of one collective (kind 'object': an object all-gather or barrier,
        two small all-reduces' latency); 0 when this kind was not measured."""
        if kind == "object":
            lat = self.collectives.get("all_reduce", (0.0, 1.0))[0]
            return 2 * lat + self.wait_s
        if kind not in self.collectives:
            return 0.0
        lat, bw = self.collectives[kind]
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


def step_time(work: StepWork, rates: Rates) -> StepTime:
    """The seconds of one step of ``work`` at ``rates`` (the module docstring's sum)."""
    compute = 0.0
    for key, n in work.ops.items():
        dtype, flops, nbytes, dim = key[:4]
        kind = key[4] if len(key) > 4 else ""
        compute += n * max(rates.matmul_s(dtype, flops, dim) if flops else 0.0, rates.memory_s(nbytes, dtype, kind))
    for (phase, dtype, flops, nbytes, dim), n in work.attention.items():
        compute += n * max(rates.attention_s(phase, dtype, flops, dim), rates.memory_s(nbytes, dtype))
    compute += sum(n * rates.random_s(elements) for elements, n in work.random.items())
    comm = sum(n * rates.collective_s(kind, nbytes, buckets) for (kind, nbytes, buckets), n in work.comm.items())
    offload = sum(nbytes / rates.tiers[tier] for tier, nbytes in work.offload.items() if rates.tiers.get(tier))
    moved = rates.byte_s * rates.charged_bytes(work) if rates.byte_s else 0.0
    moded = rates.mode_op_s * sum(work.modes.values())
    return StepTime(compute, work.n_ops * rates.op_s + moved + moded, comm, offload)


def _loglog(points: tuple[tuple[float, float], ...] | list, x: float) -> float:
    """y at ``x`` on the piecewise-linear interpolation of ``points`` in log-log (the
    end's y beyond either end)."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            w = math.log(x / x0) / math.log(x1 / x0)
            return math.exp(math.log(y0) + w * (math.log(y1) - math.log(y0)))
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
    x = 1.0 if device == "cuda" else threads  # torch splits an elementwise op over threads from ~32k elements
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
    wait = 0.0
    if world > 1:
        collectives = _collectives(profile, world)
        wait = float(_at_threads(extra.get("collective_wait_s", {}), threads, ranks_here) or 0.0)
        if not collectives:
            notes.append(f"no collectives measured for {world} ranks: communication not counted")
    tiers = {"disk": float(extra.get("disk_bytes_per_s") or 0.0)}
    if device == "cuda" and extra.get("host_bytes_per_s"):
        tiers["cpu"] = float(extra["host_bytes_per_s"])
    return Rates(matmul, speedup, elementwise, float(op_s or 0.0), collectives,
                 {k: v for k, v in tiers.items() if v}, tuple(notes), random, wait, _attention(extra), by_dtype,
                 float(byte_s or 0.0), 1 if device == "cuda" else threads, kinds,
                 float(extra.get("python_mode_op_s") or 0.0))


def _threaded(curve: list, threads: float, share: float) -> tuple[tuple[float, float], ...]:
    """A one-thread elementwise curve at ``threads`` threads: ops of ``PARALLEL_BYTES`` or
    more run on all of them, the largest capped by the rank's ``share`` of copy bandwidth."""
    return tuple((float(b), r * (threads if b >= PARALLEL_BYTES else 1.0)) for b, r in curve[:-1]) + (
        (float(curve[-1][0]), min(curve[-1][1] * threads, share)),)


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
    ``machine_rates`` measures); one process alone's when the ranks' was not measured
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


def machine_rates(world: int, device: str = "cpu", threads: int | None = None, *,
                  measure: bool = True, spawn: bool = True) -> tuple[Rates | None, list[str]]:
    """This machine's ``Rates`` for one rank of a ``world``-rank run: the cached profile
    (measured the first time, ``mct.machine.calibrate``), plus what it lacks for this run,
    measured now and cached: collectives at the world size (a few seconds, in spawned
    processes; not with ``spawn=False``), the per-op overhead of one process and (spawning)
    of the world's ranks stepping at once, with the wait per collective call (a second,
    and a few seconds). ``measure=False``: the cache only (None when it holds no profile; what it
    lacks is named in the notes). Returns the rates and warnings (a cache that could not
    be written, a measurement that failed)."""
    if not measure:
        profile = cached(device)
        return (None if profile is None else rates_for(profile, world, threads)), []
    cal = calibrate(device)
    profile, warnings = cal.profile, [cal.warning] if cal.warning else []
    threads = threads or threads_per_rank(world, device)
    if world > 1 and spawn:
        w0 = measured_world(profile, world)
        key = collective_key(profile, w0)
        if key not in profile.extra.get("collectives", {}):
            try:
                profile, warning = remember(profile, "collectives", {key: measure_collectives(w0, device)})
                warnings += [warning] if warning else []
            except (RuntimeError, ValueError) as e:
                warnings.append(f"collectives not measured ({e}): communication not counted")
    ranks = measured_world(profile, world) if world > 1 and spawn and device == "cpu" else 1
    # The overhead and the wait are measured at the rank's own threads: an op above torch's
    # grain size opens an OpenMP region whose barrier waits for the slowest thread, so a
    # 2-thread step's median is further above its fastest than a 1-thread step's (the
    # one-thread overhead, used at 2 threads, predicted every 1-rank row of the benchmark
    # 20-30% fast on a quiet machine). On a core another job holds that wait is a time slice
    # per region (the tiny model's steps 10-30x their one-thread time at load 2.5): measured
    # so, it is predicted so.
    for n in sorted({1, ranks}):
        profile, warning = _with_overhead(profile, 1 if device == "cuda" else threads, n)
        warnings += [warning] if warning else []
    return rates_for(profile, world, threads), warnings


def _with_overhead(profile: MachineProfile, threads: int, ranks: int) -> tuple[MachineProfile, str | None]:
    """``profile`` with the per-op overhead of ``ranks`` ranks at ``threads`` (measured and
    cached when it lacks it), and a warning (a failed measurement, an unwritten cache)."""
    key = overhead_key(threads, ranks)
    if key in profile.extra.get("op_overhead_s", {}) and key in profile.extra.get("byte_overhead_s", {}):
        return profile, None
    try:
        op_s, wait_s, byte_s = measure_op_overhead(rates_for(profile, ranks, threads, ranks_here=ranks), threads,
                                                   ranks=ranks)
    except (RuntimeError, ValueError) as e:
        return profile, f"per-op overhead of {ranks} ranks not measured ({e})"
    if ranks > 1:
        profile, _ = remember(profile, "collective_wait_s", {key: wait_s})
    profile, _ = remember(profile, "byte_overhead_s", {key: byte_s})
    return remember(profile, "op_overhead_s", {key: op_s})


def measure_op_overhead(rates: Rates, threads: int, steps: int = OVERHEAD_STEPS,
                        ranks: int = 1) -> tuple[float, float, float]:
    """(seconds per dispatched op beyond its roofline, seconds a rank waits at each
    collective call beyond the collective's time, seconds per byte an op moves beyond its
    roofline): real steps
    of two built-in GPTs, the tiny ``OVERHEAD_MODEL`` (ops that cost almost nothing but
    their dispatch) and ``SIZED_MODEL`` (ops of a small model's sizes), each at stage 0,
    fp32, without and with recompute of every block (so the checkpointing's own work is in
    it); ``steps`` timed steps of each, interleaved, after two warm-ups, the median of each
    (``STEP_QUANTILE``: the time model predicts a run's median step; on a machine shared with
    other jobs it follows the load of the moment of calibration). The time outside
    the collectives of each is ``predicted compute + ops x per-op + bytes x per-byte`` (``fit_overhead``);
    the time in its collectives (the engine's ``time_comm_s``) minus the communication
    predicted, over their calls, is the wait. ``ranks`` 1: this process alone, with
    ``threads`` torch threads (restored after; no wait); more: that many spawned gloo
    ranks stepping at once, each with ``threads`` (rank 0's steps: what the ranks cost each
    other is in it). Raises RuntimeError when the ranks fail."""
    cfgs = _overhead_configs()
    works = [dry_run(lambda c=c: GPT(c.model), gpt_loss, _overhead_batch(c), c, ranks).work for c in cfgs]
    if ranks > 1:
        times = spawn_ranks(_rank_overhead_steps, ranks, "cpu", (steps,), timeout_s=300.0, threads=threads)
    else:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            times = _overhead_steps(DistContext(device=torch.device("cpu")), steps)  # alone, whatever group this is in
        finally:
            torch.set_num_threads(before)
    bare = dataclasses.replace(rates, wait_s=0.0, byte_s=0.0)
    samples: dict[bool, list[tuple[float, int, float]]] = {False: [], True: []}
    waited, calls = 0.0, 0
    for got, w, c in zip(times, works, cfgs):
        predicted = step_time(w, bare)
        outside = quantile([total - comm for total, comm in got], STEP_QUANTILE)
        samples[c.model.d_model == SIZED_MODEL["d_model"]].append((outside - predicted.compute_s, w.n_ops,
                                                                   rates.charged_bytes(w)))
        waited += quantile([comm for _, comm in got], STEP_QUANTILE) - predicted.comm_s
        calls += sum(w.comm.values())
    op_s, byte_s = fit_overhead(samples[False], samples[True])
    return op_s, max(0.0, waited / calls) if calls else 0.0, byte_s


def quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (0: the smallest, 0.5: the median, linear in between)."""
    xs = sorted(xs)
    at = q * (len(xs) - 1)
    lo = int(at)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (at - lo)


def fit_overhead(tiny: list[tuple[float, int, float]], sized: list[tuple[float, int, float]]) -> tuple[float, float]:
    """(seconds per op, seconds per byte) with ``rest = ops x per-op + bytes x per-byte`` for
    the summed (seconds beyond the predicted compute, ops, bytes the ops move) of the tiny
    engines and of the sized ones: the tiny ops move almost nothing, so their rest is their
    dispatch; the sized ones' rest beyond it is what their bytes cost inside a step. Neither
    below 0 (a per-byte cost below 0: the tiny steps' rest alone, per op)."""
    (rt, ot, bt), (rm, om, bm) = ([sum(x[i] for x in group) for i in range(3)] for group in (tiny, sized))
    det = ot * bm - om * bt
    byte_s = max(0.0, (ot * rm - om * rt) / det) if det > 0 else 0.0
    return max(0.0, (rt - byte_s * bt) / ot), byte_s


def _overhead_configs() -> list[EngineConfig]:
    return [EngineConfig.from_dict({"model": dict(model), "train": {"grad_clip": 1.0},
                                    "checkpointing": {"policy": policy}})
            for model in (OVERHEAD_MODEL, SIZED_MODEL) for policy in ("none", "all")]


def _overhead_batch(cfg: EngineConfig) -> tuple[torch.Tensor, torch.Tensor]:
    T, V = cfg.model.seq_len, cfg.model.vocab_size
    rows = 4 if cfg.model.d_model == SIZED_MODEL["d_model"] else 2
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, V, (rows, T), generator=g), torch.randint(0, V, (rows, T), generator=g)


def _rank_overhead_steps(rank: int, world: int, dev: torch.device, steps: int) -> list[list[tuple[float, float]]]:
    return _overhead_steps(DistContext.current(dev), steps)


def _overhead_steps(ctx: DistContext, steps: int) -> list[list[tuple[float, float]]]:
    """(seconds, of which in collectives) of ``steps`` timed steps per
    ``_overhead_configs`` engine on ``ctx`` (interleaved, after two warm-ups)."""
    cfgs = _overhead_configs()
    batches = [_overhead_batch(c) for c in cfgs]
    engines = [Engine(GPT(c.model), None, c, ctx=ctx) for c in cfgs]  # a CUDA step's host side alike
    times: list[list[tuple[float, float]]] = [[] for _ in engines]
    for i in range(steps + 2):
        for engine, batch, got in zip(engines, batches, times):
            t0 = time.perf_counter()
            out = engine.train_step(batch, gpt_loss)
            if i >= 2:
                got.append((time.perf_counter() - t0, float(out.metrics["time_comm_s"])))
    for engine in engines:
        engine.close()
    return times


def tokens_per_step(batch: Any, grad_accum: int, world: int) -> int:
    """Tokens a step trains on: the micro-batch's first tensor's elements x micro-batches x ranks."""
    micro = batch[0] if isinstance(batch, list) and batch else batch
    leaves = [t for t in torch.utils._pytree.tree_leaves(micro) if isinstance(t, torch.Tensor)]
    return (leaves[0].numel() if leaves else 0) * grad_accum * world
