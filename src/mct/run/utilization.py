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

from mct.config import EngineConfig
from mct.machine import DTYPES, calibrate, cpu_line, format_rate
from mct.planner.flops import StepFlops, step_flops
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

    @classmethod
    def for_run(cls, task: Task, cfg: EngineConfig, world_size: int, device_type: str,
                threads_per_rank: int | None = None) -> tuple["Utilization", str | None]:
        """Count ``task``'s step FLOPs under ``cfg`` and load (or measure, the first time
        on this machine) the machine profile of ``device_type``. Returns the utilization
        and a warning about the profile cache (None when fine). Call on one rank."""
        flops = step_flops(task, cfg, world_size)
        cal = calibrate("cuda" if device_type == "cuda" else "cpu")
        prof, threads = cal.profile, threads_per_rank or torch.get_num_threads()
        dtype = cfg.precision.mode
        kernels = ""
        if dtype != "fp32" and use_fp32_kernels(cfg.precision.cpu_matmul, device_type, DTYPES[dtype]):
            dtype, kernels = "fp32", f" ({cfg.precision.mode} matmuls run on fp32 kernels here)"
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
        return cls(flops, peak, note, f"{name}, torch {prof.torch_version}", prof.to_dict()), cal.warning

    def row(self, step_time_s: float) -> dict[str, Any]:
        """The metrics row's keys for a step of ``step_time_s`` seconds (README)."""
        achieved = self.flops.model / step_time_s if step_time_s > 0 and self.flops.model else None
        row: dict[str, Any] = {"model_flops_per_step": self.flops.model or None, "achieved_flops_per_s": achieved,
                               "mfu": achieved / self.peak_flops if achieved and self.peak_flops else None}
        if self.flops.hardware is not None:
            row["hardware_flops_per_step"] = self.flops.hardware
        return row

    def summary(self, step_time_s: float | None) -> dict[str, Any]:
        """What the end-of-run summary prints (``reporting.report.summary_table``)."""
        row = self.row(step_time_s) if step_time_s else {"model_flops_per_step": self.flops.model or None}
        return {**row, "hardware_flops_per_step": self.flops.hardware, "flops_method": self.flops.describe(),
                "step_time_s": step_time_s, "peak_flops_per_s": self.peak_flops, "peak_note": self.peak_note,
                "machine": self.machine}

    def metadata(self) -> dict[str, Any]:
        """metadata.json's record of how MFU is made: the FLOP count and the profile."""
        f = self.flops
        return {"flops": {"model_flops_per_step": f.model, "hardware_flops_per_step": f.hardware,
                          "micro_batches_per_step": f.micro_batches, "method": f.method, "note": f.note,
                          "count_seconds": round(f.seconds, 3)},
                "peak_flops_per_s": self.peak_flops, "peak_note": self.peak_note, "machine_profile": self.profile}

