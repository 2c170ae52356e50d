"""What ``memory.host_malloc`` costs and buys: step time, page faults and resident memory of
``mct train``'s loop under each host allocator mode, on the same model and batches.

The mode is process-wide (glibc's ``mallopt``), so each mode runs in its own pair of
processes; the modes alternate round by round (A B A B ...), so load from elsewhere hits
them alike. Each process builds ``mct train``'s trainer (``Trainer``: the recipe, the
tracker, the metrics) with ``memory.host_malloc = MODE``, takes ``--warmup`` steps, resets
its peak resident set (Linux ``clear_refs``), then times ``--steps`` steps. Printed per mode:
the median step (the slowest rank's) and its ratio to the first mode's, minor page faults
per step (rank 0, from ``getrusage``), the peak resident set over the timed steps and the
resident set after them (the worse rank), and MFU (``mct train``'s model FLOPs per step over
the median step, over its matmul peak), beside the CPU's model and flags.

A mode may carry ``:nohuge`` (``memory.huge_pages = false``): ``--modes default:nohuge,default``
measures what huge pages on mct's own buffers buy under glibc's defaults.

    PYTHONPATH=src:. python benchmarks/host_malloc.py [--model llama-small|llama-medium|gpt]
        [--precision bf16|fp32] [--modes default,cache] [--rounds 2] [--steps 4] [--warmup 2]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks` and `tests` importable
from benchmarks.common import cpu_line, format_table, write_json  # noqa: E402
from benchmarks.instruments import LLAMAS, config_for  # noqa: E402
from mct.config import HOST_MALLOC, EngineConfig  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmHWM, VmRSS)."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field)).split()[1]) * 1024


def _worker(rank: int, world: int, base: dict[str, Any], steps: int, warmup: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist
    from mct.run.trainer import Trainer
    trainer = Trainer(EngineConfig.from_dict(base), Path(root) / f"run{rank}", progress=False)
    for _ in range(warmup):
        trainer.run_step()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to VmRSS
    times, faults = [], []
    for _ in range(steps):
        dist.barrier()
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        trainer.run_step()
        times.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    u = trainer.utilization  # mct train's own count: model FLOPs per step, the matmul peak
    return {"times": times, "faults": faults, "hwm": _status("VmHWM:"), "rss": _status("VmRSS:"),
            "model_flops": u.flops.model, "peak_flops": u.peak_flops, "peak_note": u.peak_note}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-small", choices=[*LLAMAS, "gpt"])
    ap.add_argument("--precision", default="fp32", choices=["bf16", "fp32"])
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--modes", default="default,cache")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per process pair")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (the heap reaches its steady state)")
    ap.add_argument("--json", default="host_malloc", help="result name or path (.json)")
    args = ap.parse_args()
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        ap.error(f"--rounds {args.rounds} --steps {args.steps} --warmup {args.warmup}: rounds and steps at least 1, "
                 "warmup at least 0")
    modes = args.modes.split(",")
    bad = [m for m in modes if m.partition(":")[0] not in HOST_MALLOC or m.partition(":")[2] not in ("", "nohuge")]
    if bad:
        ap.error(f"--modes {args.modes!r}: {bad[0]!r} is not a mode; choose from {','.join(HOST_MALLOC)}, "
                 "each optionally with ':nohuge' (memory.huge_pages = false)")
    got: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        base = config_for(args.model, args.precision, Path(tmp), args.stage)
        for r in range(args.rounds):
            for mode in modes:
                name, _, huge = mode.partition(":")
                cfg = {**base, "memory": {"host_malloc": name, "huge_pages": huge != "nohuge"}}
                got[mode].append(run_distributed(_worker, 2, cfg, args.steps, args.warmup,
                                                 str(Path(tmp) / f"{mode}{r}"), timeout=7200))
    rows = []
    for mode, runs in got.items():
        times = [max(ranks[k]["times"][i] for k in range(2)) for ranks in runs for i in range(args.steps)]
        rows.append({"mode": mode, "median_ms": 1e3 * statistics.median(times),
                     "faults": statistics.median(f for ranks in runs for f in ranks[0]["faults"]),
                     "hwm_mib": max(rk["hwm"] for ranks in runs for rk in ranks) / 2**20,
                     "rss_mib": max(rk["rss"] for ranks in runs for rk in ranks) / 2**20, "times_s": times})
    first = next(iter(got.values()))[0][0]
    for row in rows:
        row["x_first"] = row["median_ms"] / rows[0]["median_ms"]
        row["hwm_x_first"] = row["hwm_mib"] / rows[0]["hwm_mib"]
        if first["model_flops"] and first["peak_flops"]:
            row["mfu_pct"] = 100 * first["model_flops"] / (row["median_ms"] / 1e3) / first["peak_flops"]
    print(f"{args.model}, {args.precision}, stage {args.stage}, 2 gloo ranks x 1 thread, mct train's loop; "
          f"{args.rounds} round(s) x {args.steps} steps after {args.warmup}; {cpu_line()}")
    print(format_table(rows, [("mode", "host_malloc"), ("median_ms", "median step ms"), ("x_first", f"x {modes[0]}"),
                              ("faults", "minor faults / step"), ("hwm_mib", "peak RSS MiB (steps)"),
                              ("hwm_x_first", f"x {modes[0]}"), ("rss_mib", "RSS after MiB"),
                              ("mfu_pct", "MFU %")]))
    if first["model_flops"]:
        print(f"MFU = {first['model_flops'] / 1e9:.3g} GFLOP model FLOPs per step (mct train's count) / median step / "
              f"{first['peak_note']}")
    path = write_json(args.json, {"model": args.model, "precision": args.precision, "stage": args.stage,
                                  "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
