"""The time model: a configuration's seconds per step, from the dry run's own counts
(``mct.planner.work.StepWork``) and this machine's measured rates (``mct.machine``).

    step_s = compute + overhead + communication + offload

- **compute**: each op of the steady-state step on its own roofline,
  ``max(matmul seconds of its FLOPs, bytes / memory bandwidth)``. Matmul seconds come
  from the profile's one-thread curve (``extra['matmul_curve']``: small matmuls run far
  below the peak) in the op's dtype, minus the smallest size's time (a call's fixed cost,
  counted in ``overhead``), never below FLOPs / peak; threads speed up the large ones (the
  measured every-thread speed-up, blended in from 2 x 64^3 to 2 x 512^3 FLOPs). Bandwidth
  is the one-thread copy curve at the op's bytes (cache-resident tensors move faster), at
  most the every-thread copy rate shared by the ranks on this machine.
- **overhead**: ``ops x op_overhead_s``, the time one dispatched op costs beyond its
  roofline (Python, the dispatcher, autograd, the engine's memory tracker), measured on
  first use at the rank's thread count: a real step of a tiny built-in GPT minus its
  predicted compute, per op (``measure_op_overhead``).
- **communication**: each collective ``buckets x latency + bytes / bandwidth`` with
  the latency and bandwidth of that kind measured at the world size on this machine
  (gloo on CPU, NCCL on CUDA: ``mct.machine.collectives``); no overlap with compute.
- **offload**: the bytes a step moves to and from disk at the measured disk rate (host
  memory: the pinned host-to-device rate on CUDA; on a CPU device the copies are ops
  already counted).

Known errors (docs/planner.md): no overlap of communication or offload I/O with compute;
a loaded machine runs slower than its profile; a world larger than this machine is
extrapolated from the largest world measured here (ring scaling).
"""

from __future__ import annotations

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
from mct.machine.collectives import measure_collectives
from mct.models.gpt import GPT, gpt_loss
from mct.planner.dry_run import dry_run
from mct.planner.work import StepWork

BLEND = (2 * 64 ** 3, 2 * 512 ** 3)
"""Matmul FLOPs between which the threads' speed-up is blended in (small matmuls run on one thread)."""
OVERHEAD_MODEL = {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16, "vocab_size": 128, "dropout": 0.0}
"""The built-in GPT whose real steps measure the per-op overhead: small enough that its
ops cost almost nothing but their dispatch."""
MAX_MEASURED_WORLD = 8


@dataclass(frozen=True)
class Rates:
    """What turns one rank's ``StepWork`` into seconds: ``matmul`` {dtype: ((FLOPs of a
    call, seconds of a call), ...)} ascending, at this rank's threads; ``peak`` {dtype:
    FLOP/s}; ``copy`` ((bytes, bytes/s), ...) ascending, per rank; ``op_s``: overhead
    per dispatched op; ``collectives`` {kind: (latency s, bytes/s)} at the world size;
    ``tiers`` {'cpu'|'disk': bytes/s} of offload traffic (absent: counted in the ops);
    ``notes``: what was not measured."""

    matmul: dict[str, tuple[tuple[float, float], ...]]
    peak: dict[str, float]
    copy: tuple[tuple[float, float], ...]
    op_s: float
    collectives: dict[str, tuple[float, float]] = field(default_factory=dict)
    tiers: dict[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def matmul_s(self, dtype: str, flops: float) -> float:
        """Seconds of one matmul of ``flops`` in ``dtype`` (fp32's curve when ``dtype``
        has none), beyond a call's fixed cost."""
        curve = self.matmul.get(dtype) or self.matmul["fp32"]
        peak = self.peak.get(dtype) or self.peak["fp32"]
        floor = flops / peak
        if flops <= curve[0][0]:
            return floor
        t = _loglog(curve, flops) if flops < curve[-1][0] else curve[-1][1] * flops / curve[-1][0]
        return max(t - curve[0][1], floor)

    def memory_s(self, nbytes: float) -> float:
        """Seconds to read and write ``nbytes`` (an op's inputs and outputs)."""
        if nbytes <= 0:
            return 0.0
        pts = self.copy
        rate = pts[0][1] if nbytes <= pts[0][0] else pts[-1][1] if nbytes >= pts[-1][0] else \
            nbytes / _loglog(tuple((b, b / r) for b, r in pts), nbytes)
        return nbytes / rate

    def collective_s(self, kind: str, nbytes: float, buckets: int) -> float:
        """Seconds of one collective (kind 'object': an object all-gather or barrier,
        two small all-reduces' latency); 0 when this kind was not measured."""
        if kind == "object":
            lat = self.collectives.get("all_reduce", (0.0, 1.0))[0]
            return 2 * lat
        if kind not in self.collectives:
            return 0.0
        lat, bw = self.collectives[kind]
        return buckets * lat + nbytes / bw


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
    for (dtype, flops, nbytes), n in work.ops.items():
        compute += n * max(rates.matmul_s(dtype, flops) if flops else 0.0, rates.memory_s(nbytes))
    comm = sum(n * rates.collective_s(kind, nbytes, buckets) for (kind, nbytes, buckets), n in work.comm.items())
    offload = sum(nbytes / rates.tiers[tier] for tier, nbytes in work.offload.items() if rates.tiers.get(tier))
    return StepTime(compute, work.n_ops * rates.op_s, comm, offload)


def _loglog(points: tuple[tuple[float, float], ...] | list, x: float) -> float:
    """y at ``x`` on the piecewise-linear interpolation of ``points`` in log-log."""
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
    matmul, peak = {}, {}
    for dtype, one in profile.matmul_one.items():
        speedup = _speedup(profile, dtype, threads)
        curve = extra.get("matmul_curve", {}).get(dtype)
        if not curve:
            notes.append(f"no {dtype} matmul curve: the peak for every size")
            curve = [[2.0 * 16 ** 3, one], [2.0 * 512 ** 3, one]]
        matmul[dtype] = tuple((f, f / (r * _blend(f, speedup))) for f, r in curve)
        peak[dtype] = max(one, *(r for _, r in curve)) * speedup  # the fastest size seen: calls vary under load
    share = 2.0 * extra.get("copy_all_bytes_per_s", profile.memcpy_bytes_per_s * threads) / ranks_here
    curve = extra.get("copy_curve") or [[32.0 * 2**20, profile.memcpy_bytes_per_s]]
    copy = tuple((2.0 * b, min(2.0 * r * threads, share)) for b, r in curve)  # a copy reads and writes
    op_s = extra.get("op_overhead_s", {}).get(str(threads))
    if op_s is None:
        notes.append(f"no per-op overhead measured at {threads} thread(s)")
    collectives: dict[str, tuple[float, float]] = {}
    if world > 1:
        collectives = _collectives(profile, world)
        if not collectives:
            notes.append(f"no collectives measured for {world} ranks: communication not counted")
    tiers = {"disk": float(extra.get("disk_bytes_per_s") or 0.0)}
    if device == "cuda" and extra.get("host_bytes_per_s"):
        tiers["cpu"] = float(extra["host_bytes_per_s"])
    return Rates(matmul, peak, copy, float(op_s or 0.0), collectives, {k: v for k, v in tiers.items() if v},
                 tuple(notes))


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
    processes; not with ``spawn=False``), the per-op overhead at the rank's threads (about
    a second). ``measure=False``: the cache only (None when it holds no profile; what it
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
    if str(threads) not in profile.extra.get("op_overhead_s", {}):
        op_s = measure_op_overhead(rates_for(profile, 1, threads, ranks_here=1), threads)
        profile, warning = remember(profile, "op_overhead_s", {str(threads): op_s})
        warnings += [warning] if warning else []
    return rates_for(profile, world, threads), warnings


def measure_op_overhead(rates: Rates, threads: int, steps: int = 5) -> float:
    """Seconds per dispatched op beyond its roofline: real steps of the built-in GPT of
    ``OVERHEAD_MODEL`` (one rank, stage 0, fp32, without and with recompute of every
    block, so the checkpointing's own work is in it; the fastest of ``steps`` each,
    interleaved, after two warm-ups: a busy machine only ever slows a step down) minus
    the compute ``rates`` predict for their dry runs, over their ops. Runs with
    ``threads`` torch threads (restored after)."""
    T, V = OVERHEAD_MODEL["seq_len"], OVERHEAD_MODEL["vocab_size"]
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, V, (2, T), generator=g), torch.randint(0, V, (2, T), generator=g))
    cfgs = [EngineConfig.from_dict({"model": dict(OVERHEAD_MODEL), "train": {"grad_clip": 1.0},
                                    "checkpointing": {"policy": policy}}) for policy in ("none", "all")]
    works = [dry_run(lambda c=c: GPT(c.model), gpt_loss, batch, c, 1).work for c in cfgs]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = DistContext(device=torch.device("cpu"))  # one process on the CPU, whatever group this one is in
        engines = [Engine(GPT(c.model), None, c, ctx=alone) for c in cfgs]  # a CUDA step's host side alike
        times: list[list[float]] = [[] for _ in cfgs]
        for i in range(steps + 2):
            for engine, got in zip(engines, times):
                t0 = time.perf_counter()
                engine.train_step(batch, gpt_loss)
                if i >= 2:
                    got.append(time.perf_counter() - t0)
        for engine in engines:
            engine.close()
    finally:
        torch.set_num_threads(before)
    spare = sum(min(t) - step_time(w, rates).compute_s for t, w in zip(times, works) if w is not None)
    return max(0.0, spare / sum(w.n_ops for w in works if w is not None))


def tokens_per_step(batch: Any, grad_accum: int, world: int) -> int:
    """Tokens a step trains on: the micro-batch's first tensor's elements x micro-batches x ranks."""
    micro = batch[0] if isinstance(batch, list) and batch else batch
    leaves = [t for t in torch.utils._pytree.tree_leaves(micro) if isinstance(t, torch.Tensor)]
    return (leaves[0].numel() if leaves else 0) * grad_accum * world
