"""The time model's measured overheads, and this machine's ``Rates`` for a plan.

``machine_rates`` turns the cached machine profile (``mct.machine``) into one rank's
``mct.planner.steptime.Rates``, measuring first what the profile lacks for this world and
caching it: the collectives at the world size (spawned gloo ranks), and the per-op overhead,
the per-byte cost inside a step and the wait per collective call, from real steps of two
built-in GPTs (``measure_op_overhead``): one process at the rank's threads, and the world's
ranks stepping at once. The formula that uses them is ``mct.planner.steptime``; why each
term exists and how it was chosen is docs/planner.md, "Time model".
"""

from __future__ import annotations

import dataclasses
import time

import torch

from mct.config import EngineConfig
from mct.dist import DistContext
from mct.engine import Engine
from mct.machine import MachineProfile, calibrate, default_device
from mct.machine.cache import cached, remember, say_line
from mct.machine.collectives import measure_collectives, measure_group_collectives, spawn_ranks
from mct.machine.load import LoadWatch
from mct.machine.passes import measured_line
from mct.models.gpt import GPT, gpt_loss
from mct.planner.dry_run import dry_run
from mct.planner.steptime import (Rates, collective_key, context_sizes, group_key, measured_world, overhead_key,
                                  rates_for, step_time, threads_per_rank)

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


def machine_rates(world: int, device: str = "cpu", threads: int | None = None, *,
                  measure: bool = True, spawn: bool = True) -> tuple[Rates | None, list[str]]:
    """This machine's ``Rates`` for one rank of a ``world``-rank run: the cached profile
    (measured the first time, ``mct.machine.calibrate``), plus what it lacks for this run,
    measured now and cached: collectives at the world size (a few seconds, in spawned
    processes; not with ``spawn=False``), the per-op overhead of one process and (spawning)
    of the world's ranks stepping at once, with the wait per collective call (a second,
    and a few seconds). ``measure=False``: the cache only (None when it holds no profile; what it
    lacks is named in the notes; a suspect profile is used, with a warning saying why it is
    not measured again). Returns the rates and warnings (a cache that could not be written, a
    measurement that failed)."""
    if not measure:
        profile = cached(device)
        if profile is None:
            return None, []
        unmeasured = [] if not profile.suspect or profile.pinned else [
            f"the machine profile is suspect ({profile.suspect}) and is not measured again here (a training rank "
            f"measures nothing: it would compete with the others), so configurations are ranked by it; "
            f"mct calibrate --force measures it"]
        return _noted(rates_for(profile, world, threads), profile), unmeasured
    cal = calibrate(device)
    profile, warnings = cal.profile, [cal.warning] if cal.warning else []
    threads = threads or threads_per_rank(world, device)
    if world > 1 and spawn:
        w0 = measured_world(profile, world)
        key = collective_key(profile, w0)
        if key not in profile.extra.get("collectives", {}):
            try:
                say_line(f"measuring the collectives of {w0} ranks for the time model (a few seconds; cached)")
                profile, warning = remember(profile, "collectives", {key: measure_collectives(w0, device)})
                warnings += [warning] if warning else []
            except (RuntimeError, ValueError) as e:
                warnings.append(f"collectives not measured ({e}): communication not counted")
        profile, warning = _with_group_collectives(profile, world, device)
        warnings += [warning] if warning else []
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
    return _noted(rates_for(profile, world, threads), profile), warnings


def device_rates(world: int, device: str, *, measure: bool = True) -> tuple[Rates | None, list[str]]:
    """``machine_rates`` for a plan of a ``device`` run ('cpu' or 'cuda'), when this machine
    computes on that device type; else no rates (a profile times only its own device type, and
    no roofline of another device is modelled) and a note saying so. Never measures then."""
    here = default_device()
    if device != here:
        return None, [f"none for {device}: this machine computes on {here} and its profile times only that "
                      f"(plan on a {device} machine for s/step and tokens/s)"]
    return machine_rates(world, device, measure=measure)


def _with_group_collectives(profile: MachineProfile, world: int, device: str) -> tuple[MachineProfile, str | None]:
    """``profile`` with the context group's collectives at every group size a ``world``-rank
    run may have (``group_key``; measured and cached where it lacks them, one spawn per
    measured world: a profile from before they were measured gets them here), and a warning
    (a failed measurement, an unwritten cache)."""
    missing: dict[int, set[int]] = {}
    for g in context_sizes(world):
        key, g0 = group_key(profile, world, g)
        if key not in profile.extra.get("collectives", {}):
            missing.setdefault(int(key.split(":")[1].split("/")[0]), set()).add(g0)
    warning = None
    for w, sizes in sorted(missing.items()):
        try:
            say_line(f"measuring the context group's collectives (groups of {sorted(sizes)} in {w} ranks) for the "
                     f"time model (a few seconds; cached)")
            got = measure_group_collectives(w, tuple(sorted(sizes)), device)
        except (RuntimeError, ValueError) as e:
            return profile, f"context collectives not measured ({e}): timed at the world's rates"
        fresh = {group_key(profile, world, g)[0]: rates for g, rates in got.items()}
        profile, warning = remember(profile, "collectives", fresh)
    return profile, warning


def _noted(rates: Rates, profile: MachineProfile) -> Rates:
    """``rates`` with a first note saying when and under what load the profile was measured
    (`mct plan` prints it)."""
    return dataclasses.replace(rates, notes=(f"machine profile {measured_line(profile)}", *rates.notes))


def _with_overhead(profile: MachineProfile, threads: int, ranks: int) -> tuple[MachineProfile, str | None]:
    """``profile`` with the per-op overhead of ``ranks`` ranks at ``threads`` (measured and
    cached when it lacks it), and a warning (a failed measurement, an unwritten cache)."""
    key = overhead_key(threads, ranks)
    if key in profile.extra.get("op_overhead_s", {}) and key in profile.extra.get("byte_overhead_s", {}):
        return profile, None
    rates = rates_for(profile, ranks, threads, ranks_here=ranks)
    say_line(f"measuring the per-op overhead of {ranks} rank(s) at {threads} thread(s) from real steps for the time "
             f"model (a few seconds; cached)")
    try:
        with LoadWatch() as watch:
            op_s, wait_s, byte_s = measure_op_overhead(rates, threads, ranks=ranks)
        if watch.load().busy:  # once more; load only adds to a step, so the smaller of each is nearer the truth
            with LoadWatch() as again:
                more = measure_op_overhead(rates, threads, ranks=ranks)
            op_s, wait_s, byte_s = (min(a, b) for a, b in zip((op_s, wait_s, byte_s), more))
            watch = min(watch, again, key=lambda w: w.load().other_cores or 0.0)
    except (RuntimeError, ValueError) as e:
        return profile, f"per-op overhead of {ranks} ranks not measured ({e})"
    profile, _ = remember(profile, "overhead_load", {key: watch.load().to_dict()})
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
    it), and with more than one rank the same four at stage 3; ``steps`` timed steps of
    each, interleaved, after two warm-ups, the median of each (``STEP_QUANTILE``: the time
    model predicts a run's median step; on a machine shared with other jobs it follows the
    load of the moment of calibration). The time outside the collectives of each stage-0
    engine is ``predicted compute + ops x per-op + bytes x per-byte`` (``fit_overhead``);
    the wait per call is what the stage-3 steps take beyond that prediction more than the
    stage-0 ones, per call more (``wait_per_call``). ``ranks`` 1: this process alone, with
    ``threads`` torch threads (restored after; no wait); more: that many spawned gloo
    ranks stepping at once, each with ``threads`` (rank 0's steps: what the ranks cost each
    other is in it). Raises RuntimeError when the ranks fail."""
    cfgs = _overhead_configs(ranks)
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
    for got, w, c in zip(times, works, cfgs):
        if c.zero.stage == 0:
            outside = quantile([total - comm for total, comm in got], STEP_QUANTILE)
            samples[c.model.d_model == SIZED_MODEL["d_model"]].append((outside - step_time(w, bare).compute_s,
                                                                       w.n_ops, rates.charged_bytes(w)))
    op_s, byte_s = fit_overhead(samples[False], samples[True])
    fitted = dataclasses.replace(rates, op_s=op_s, byte_s=byte_s, wait_s=0.0)
    beyond = {0: [], 3: []}  # stage -> [(seconds beyond the prediction without a wait, calls)]
    for got, w, c in zip(times, works, cfgs):
        total = quantile([t for t, _ in got], STEP_QUANTILE)
        beyond[c.zero.stage].append((total - step_time(w, fitted).total, sum(w.comm.values())))
    return op_s, wait_per_call(beyond[0], beyond[3]), byte_s


def wait_per_call(few: list[tuple[float, int]], many: list[tuple[float, int]]) -> float:
    """Seconds a step loses per collective call beyond the collectives' own time: the
    slope of (seconds beyond the prediction without it, calls) from each engine at stage 0
    (``few``) to the same at stage 3 (``many``, 2-3x the calls), summed. A wait that comes
    once a step (the ranks' skew at their first collective) is in both and cancels: counted
    per call from stage 0 alone (its 4 calls a step) it came out 2 ms a call here, and
    predicted the 2-rank rows of the benchmark's real models 10-20% slow (1.1 ms fits them).
    0 with no stage-3 engines (one rank) or a slope below 0."""
    if not many:
        return 0.0
    more_s = sum(s for s, _ in many) - sum(s for s, _ in few)
    more_calls = sum(n for _, n in many) - sum(n for _, n in few)
    return max(0.0, more_s / more_calls) if more_calls > 0 else 0.0


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


def _overhead_configs(world: int = 1) -> list[EngineConfig]:
    """The calibration's engines: each model without and with recompute at stage 0, and (more
    than one rank) the same at stage 3, whose steps make 2-3x the collective calls."""
    return [EngineConfig.from_dict({"model": dict(model), "train": {"grad_clip": 1.0},
                                    "checkpointing": {"policy": policy}, "zero": {"stage": stage}})
            for stage in ((0, 3) if world > 1 else (0,))
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
    ``_overhead_configs`` engine on ``ctx`` (interleaved, after two warm-ups), the memory
    tracker off: the step `mct train` runs between its logged ones (the tracker's own cost
    is ``extra['tracker_op_s']``, charged where a run tracks every step)."""
    cfgs = _overhead_configs(ctx.world_size)
    batches = [_overhead_batch(c) for c in cfgs]
    engines = [Engine(GPT(c.model), None, c, ctx=ctx) for c in cfgs]  # a CUDA step's host side alike
    times: list[list[tuple[float, float]]] = [[] for _ in engines]
    for i in range(steps + 2):
        for engine, batch, got in zip(engines, batches, times):
            t0 = time.perf_counter()
            out = engine.train_step(batch, gpt_loss, track_memory=False)  # as most of mct train's steps
            if i >= 2:
                got.append((time.perf_counter() - t0, float(out.metrics["time_comm_s"])))
    for engine in engines:
        engine.close()
    return times
