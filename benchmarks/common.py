"""Shared benchmark helpers: interleaved timing, summary statistics, a plain-text
table, a JSON result file with the run's environment, and MFU columns (``step_utilization``,
``add_mfu``, ``MFU_COLUMNS``) counted as ``mct train`` counts them.

Benchmarks run on shared, noisy machines: measure every variant in one process,
round-robin per step (``interleave``), so that a burst of load hits all variants
alike, and compare variants by ratios rather than by absolute times.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from mct.config import EngineConfig
from mct.run.utilization import Utilization
from mct.task.spec import LossFn, ModelFn, Task

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def interleave(steps: dict[str, Callable[[int], None]], n_steps: int, *, warmup: int = 1,
               before_each: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Run ``steps[name](i)`` for i in range(warmup + n_steps), every variant once per
    i in a fixed round-robin order; ``before_each`` (e.g. a barrier) runs untimed
    before each call. Returns {name: [seconds of each measured call]} (warm-up calls
    dropped). Exceptions from a step propagate."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(warmup + n_steps):
        for name, step in steps.items():
            if before_each is not None:
                before_each()
            t0 = time.perf_counter()
            step(i)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """median, min, max and the interquartile range of ``samples`` (seconds)."""
    s = sorted(samples)
    if not s:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "iqr": float("nan")}
    q = statistics.quantiles(s, n=4) if len(s) >= 2 else [s[0], s[0], s[0]]
    return {"median": statistics.median(s), "min": s[0], "max": s[-1], "iqr": q[2] - q[0]}


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def format_table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """Rows of dicts -> aligned text table. ``columns``: (key, header) pairs; floats
    are printed with 3 significant digits, None as '-'."""
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)
    body = [[cell(r.get(k)) for k, _ in columns] for r in rows]
    heads = [h for _, h in columns]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(heads)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(heads), line(["-" * w for w in widths]), *(line(b) for b in body)])


CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma")
"""The /proc/cpuinfo flags that decide torch's CPU kernels (native bf16 or not)."""


def cpu_info() -> dict[str, Any]:
    """The CPU the numbers were measured on: model name, the flags of ``CPU_FLAGS`` it
    has (read by ``mct.machine.cpu_identity``), cores, load average now."""
    from mct.machine import cpu_identity
    ident = cpu_identity()
    return {"model": ident["model"], "flags": [f for f in CPU_FLAGS if f in ident["flags"]], "cores": os.cpu_count(),
            "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None}


def cpu_line(info: dict[str, Any] | None = None) -> str:
    """``cpu_info()`` as one line: 'MODEL (flags), N cores'."""
    info = info or cpu_info()
    return f"{info['model']} ({' '.join(info['flags']) or '-'}), {info['cores']} cores"


def environment() -> dict[str, Any]:
    """What the numbers depend on: versions, CPU count, load, thread count."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform(),
            "cpu": cpu_info(), "cpus": os.cpu_count(), "loadavg_at_end": load, "argv": sys.argv[1:],
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def write_json(name_or_path: str, payload: dict[str, Any]) -> Path:
    """Write ``payload`` plus ``environment()`` as JSON to ``name_or_path`` (a path
    ending in .json) or to ``benchmarks/results/NAME.json``; returns the path.
    Creates the folder; raises OSError if it cannot be written."""
    path = Path(name_or_path) if name_or_path.endswith(".json") else RESULTS_DIR / f"{name_or_path}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**payload, "environment": environment()}, indent=2, default=str) + "\n")
    return path


MFU_COLUMNS = [("gflop_s", "GFLOP/s"), ("mfu_pct", "MFU %")]
"""format_table columns for ``add_mfu``'s keys: achieved model FLOP/s and MFU."""


def step_utilization(model_fn: ModelFn, loss_fn: LossFn, micro_batch: Any, config: EngineConfig | dict, *,
                     ranks: int = 1, threads: int | None = None) -> Utilization:
    """The model FLOPs of one step (``micro_batch`` x ``data.grad_accum`` x ``ranks``),
    counted on fake tensors as ``mct train`` counts them, and this machine's matmul peak
    for ``config``'s precision x ``threads`` per rank (default: this process's) x ``ranks``
    (``mct calibrate``'s cached profile, measured the first time)."""
    cfg = config if isinstance(config, EngineConfig) else EngineConfig.from_dict(config)
    util, warning = Utilization.for_run(Task(model_fn, loss_fn, micro_batch), cfg, ranks, "cpu", threads)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    return util


def add_mfu(row: dict[str, Any], util: Utilization, step_s: float) -> dict[str, Any]:
    """``row`` plus ``model_gflop`` (per step), ``gflop_s`` (achieved) and ``mfu_pct`` for
    a step of ``step_s`` seconds; returns ``row``."""
    r = util.row(step_s)
    row["model_gflop"] = util.flops.model / 1e9
    row["gflop_s"] = r["achieved_flops_per_s"] / 1e9 if r["achieved_flops_per_s"] else None
    row["mfu_pct"] = 100 * r["mfu"] if r["mfu"] is not None else None
    return row


def mfu_line(util: Utilization) -> str:
    """How the MFU column was made, and on what, in one line."""
    return (f"MFU = model FLOPs per step ({util.flops.describe()}) / step time / "
            f"{util.peak_note}; {util.machine}")
