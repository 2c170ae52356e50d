"""Model FLOPs utilization (MFU) of a run: the model FLOPs of a step (``mct.planner.flops``,
counted once on fake tensors), the achieved FLOP/s of a step time, and their fraction of
this machine's measured matmul peak (``mct.machine``) in the run's compute dtype:

    MFU = model FLOPs per step / step time / (peak per core x threads per rank x ranks)

On CUDA the peak is the device's measured rate x ranks. Where bf16/fp16 matmuls run on
fp32 kernels (``precision.cpu_matmul``) the fp32 peak is the one they can reach.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mct.config import EngineConfig, PrecisionMode
from mct.machine import MachineProfile, calibrate, cpu_line, format_rate
from mct.machine.cache import Calibration, cache_file, cached
from mct.machine.aside import measure_aside
from mct.machine.load import Load
from mct.machine.trust import check_run
from mct.planner.flops import StepFlops, step_flops
from mct.planner.grid import prepare_work
from mct.planner.isolate import run_forked
from mct.planner.overhead import machine_rates
from mct.planner.plan import for_device, predict
from mct.planner.steptime import overhead_key, step_time
from mct.planner.work import StepWork
from mct.precision.cpu_matmul import use_fp32_kernels
from mct.task.spec import Task


@dataclass(frozen=True)
class Utilization:
    """What a run needs to turn a step time into MFU. ``peak_flops``: the run's matmul
    peak in FLOP/s (None when this machine has no rate for the dtype); ``peak_note``:
    how it was made; ``machine``: the CPU (model, flags, cores) or CUDA device and torch;
    ``profile``: the machine profile as recorded in metadata.json."""

    flops: StepFlops
    peak_flops: float | None
    peak_note: str
    machine: str
    profile: dict[str, Any]
    predicted_step_s: float | None = None
    """The time model's seconds per step of this run (``mct.planner.steptime``; None when
    the dry run could not run)."""

    @classmethod
    def for_run(cls, task: Task, cfg: EngineConfig, world_size: int, device_type: str,
                threads_per_rank: int | None = None, predicted_step_s: float | None = None
                ) -> tuple["Utilization", str | None]:
        """Count ``task``'s step FLOPs under ``cfg`` and load (or measure, the first time
        on this machine) the machine profile of ``device_type``; the predicted step time
        is ``predicted_step_s`` (the plan ``auto`` made) or a dry run's now
        (``predict_step_s``). Returns the utilization and a warning about the profile
        cache (None when fine). Call on one rank."""
        want_work = predicted_step_s is None
        # fake tensors import torch._dynamo: counted in a forked child (mct.planner.isolate)
        flops, work = run_forked(lambda: (step_flops(task, cfg, world_size),
                                          step_work(task, cfg, world_size, device_type) if want_work else None))
        threads = threads_per_rank or torch.get_num_threads()
        # what the cache lacks is measured in a child process: not in this rank's peak resident set
        device = "cuda" if device_type == "cuda" else "cpu"
        key = None if predicted_step_s is not None else overhead_key(1 if device == "cuda" else threads, 1)
        settled = measure_aside(device, world_size, threads, overhead_key=key)
        profile = cached(device) if settled else None
        cal = Calibration(profile, "cache", cache_file()) if profile is not None else calibrate(device)
        prof = cal.profile
        mode = cfg.precision.mode
        dtype, kernels = mode.value, ""
        if mode.is_low and use_fp32_kernels(cfg.precision.cpu_matmul, device_type, mode.dtype):
            dtype, kernels = PrecisionMode.fp32.value, f" ({mode} matmuls run on fp32 kernels here)"
        peak = prof.peak_flops(dtype, threads, world_size)
        rate = prof.matmul_one.get(dtype)
        if rate is None:
            note = f"no measured {dtype} matmul rate on this machine"
        elif prof.device == "cuda":
            note = f"{dtype} matmul peak {format_rate(rate)} per device x {world_size} rank(s){kernels}"
        else:
            note = (f"{dtype} matmul peak {format_rate(rate)} per core x {threads} thread(s) x "
                    f"{world_size} rank(s){kernels}")
        name = (f"{prof.name} ({' '.join(prof.flags)})" if prof.device == "cuda" else cpu_line())
        if predicted_step_s is None:
            predicted_step_s = predict_step_s(task, cfg, world_size, device_type, threads, work=work,
                                              measure=profile is None)
        return cls(flops, peak, note, f"{name}, torch {prof.torch_version}", prof.to_dict(),
                   predicted_step_s), cal.warning

    def row(self, step_time_s: float) -> dict[str, Any]:
        """The metrics row's keys for a step of ``step_time_s`` seconds (docs/metrics.md). A step
        whose model FLOP/s exceed the profile's peak (a profile measured while the machine
        was busy) gets no MFU but ``mfu_over_peak`` (the warning line, ``over_peak``)."""
        achieved = self.flops.model / step_time_s if step_time_s > 0 and self.flops.model else None
        mfu = achieved / self.peak_flops if achieved and self.peak_flops else None
        row: dict[str, Any] = {"model_flops_per_step": self.flops.model or None, "achieved_flops_per_s": achieved,
                               "mfu": None if mfu is not None and mfu > 1 else mfu,
                               "predicted_step_s": self.predicted_step_s}
        if mfu is not None and mfu > 1:
            row["mfu_over_peak"] = self.over_peak(achieved)  # type: ignore[arg-type]
        if self.flops.hardware is not None:
            row["hardware_flops_per_step"] = self.flops.hardware
        return row

    def check_profile(self, step_time_s: float | None, steady_steps: int, over_peak: bool,
                      run_load: Load | None = None) -> str | None:
        """The one line a run prints when its median step ``step_time_s`` (of ``steady_steps``
        timed steps after the first) disagrees with the prediction beyond the time model's
        stated error, or its MFU went above 100% (``over_peak``); marks the cached profile
        suspect (``mct.machine.trust.check_run``). None when they agree or nothing was recorded."""
        try:
            profile = MachineProfile.from_dict(self.profile)
        except ValueError:
            return None
        return check_run(profile, step_time_s, self.predicted_step_s, steady_steps, over_peak, run_load)

    def over_peak(self, achieved: float) -> str:
        """The warning for model FLOP/s above the measured peak."""
        return (f"achieved {format_rate(achieved)} exceeds this machine's measured peak "
                f"{format_rate(self.peak_flops or 0.0)} ({self.peak_note}): the profile was measured while the "
                f"machine was busy; no MFU printed. Measure it again on a quiet machine: mct calibrate --force")

    def summary(self, step_time_s: float | None) -> dict[str, Any]:
        """What the end-of-run summary prints (``reporting.report.summary_table``)."""
        row = self.row(step_time_s) if step_time_s else {"model_flops_per_step": self.flops.model or None}
        return {**row, "hardware_flops_per_step": self.flops.hardware, "flops_method": self.flops.describe(),
                "step_time_s": step_time_s, "peak_flops_per_s": self.peak_flops, "peak_note": self.peak_note,
                "machine": self.machine, "predicted_step_s": self.predicted_step_s}

    def metadata(self) -> dict[str, Any]:
        """metadata.json's record of how MFU is made: the FLOP count and the profile."""
        f = self.flops
        return {"flops": {"model_flops_per_step": f.model, "hardware_flops_per_step": f.hardware,
                          "micro_batches_per_step": f.micro_batches, "method": f.method, "note": f.note,
                          "count_seconds": round(f.seconds, 3)},
                "peak_flops_per_s": self.peak_flops, "peak_note": self.peak_note, "machine_profile": self.profile,
                "predicted_step_s": self.predicted_step_s}


_DRY_RUN = "dry run"
"""``predict_step_s``'s default ``work``: make the dry run there."""


def predict_step_s(task: Task, cfg: EngineConfig, world_size: int, device_type: str, threads: int,
                   measure: bool = True, *, work: StepWork | None | str = _DRY_RUN) -> float | None:
    """The time model's seconds per step of ``task`` under ``cfg`` (a dry run, depth
    extrapolated, and this machine's rates; in a training rank nothing is spawned: the
    collectives only when cached), of the step the run's median is made of: untracked, as
    `mct train` tracks memory only on its logged steps, unless it tracks every one
    (``memory.enforce``, ``train.log_every = 1``). ``work``: the dry run's ``step_work``
    when made already (elsewhere: ``run_forked``). ``measure=False``: the cached rates only
    (what ``mct.machine.aside`` measured). None when the model cannot be dry-run or a
    concrete config is missing (``auto`` unresolved)."""
    try:
        rates, _ = machine_rates(world_size, "cuda" if device_type == "cuda" else "cpu", threads, spawn=False,
                                 measure=measure)
    except Exception:  # noqa: BLE001 - as a failed dry run: the run goes on without a prediction
        return None
    if work == _DRY_RUN:
        work = step_work(task, cfg, world_size, device_type)
    tracked = tracks_every_step(cfg, device_type)
    return step_time(work, rates, tracked=tracked).total if rates is not None and work is not None else None


def step_work(task: Task, cfg: EngineConfig, world_size: int, device_type: str) -> StepWork | None:
    """One rank's step of ``task`` under ``cfg`` as counts, from a dry run on fake tensors
    (depth extrapolated); None when the model cannot be dry-run or a concrete config is
    missing (``auto`` unresolved). Computes nothing real; imports ``torch._dynamo``."""
    try:
        cfg = for_device(cfg, device_type)
        return predict(prepare_work(task, cfg), cfg, world_size).work
    except Exception:  # noqa: BLE001 - any model may fail on fake tensors; the run goes on without it
        return None


def tracks_every_step(cfg: EngineConfig, device_type: str) -> bool:
    """Does a run of ``cfg`` count memory on every step (the CPU tracker's dispatch mode on
    every op: ``memory.enforce``, or ``train.log_every = 1``)? `mct train` counts only the
    steps it logs, so its median step is otherwise an untracked one."""
    return device_type != "cuda" and cfg.memory.track and (cfg.memory.enforce or cfg.train.log_every == 1)

