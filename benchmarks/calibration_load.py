"""The machine profile under load: one pass against watched passes, with and without busy
processes beside it.

For each scenario (``--busy`` 0 and N extra processes spinning a core each, started before
the measurement and stopped after) the machine profile is measured twice: one pass, as
mct measured before (``passes.MAX_PASSES = 1``), and watched (up to ``MAX_PASSES`` passes
while other processes keep more than ``load.BUSY_CORES`` cores busy, each rate the best of
the passes). Per measurement: the seconds, the passes, the load recorded, and the rates the
time model leans on most (fp32 matmul one thread and every thread, the one-thread copy, the
4 MiB elementwise mix, the fp16 by-dimension curve at 512) as a fraction of the best any
measurement of the run saw (1.00 = the best seen; a loaded measurement reads below).

Prints the CPU model and flags; writes ``benchmarks/results/calibration_load.json`` (or
``--json PATH``). Run:

    PYTHONPATH=src python benchmarks/calibration_load.py --busy 0 1
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_line, format_table, write_json  # noqa: E402

import mct.machine.passes as passes  # noqa: E402
from mct.machine.profile import MachineProfile, measure_profile  # noqa: E402

RATES = {"fp32 1t": lambda p: p.matmul_one["fp32"], "fp32 all": lambda p: p.matmul_all["fp32"],
         "copy": lambda p: p.memcpy_bytes_per_s,
         "elementwise 4MiB": lambda p: p.extra["elementwise_curve"][-1][1],
         "fp16 d512": lambda p: dict(map(tuple, p.extra["matmul_by_dim"].get("fp16", [[512, float("nan")]]))).get(
             512.0, float("nan"))}
"""What each measurement is judged by: rates the time model reads for most steps."""


def _spin() -> None:  # pragma: no cover - a busy process
    while True:
        pass


def measure(busy: int, max_passes: int) -> dict[str, Any]:
    """One measurement with ``busy`` spinning processes beside it and at most ``max_passes`` passes."""
    spinners = [mp.Process(target=_spin, daemon=True) for _ in range(busy)]
    for s in spinners:
        s.start()
    time.sleep(0.5 if busy else 0.0)
    passes.MAX_PASSES = max_passes
    started = time.perf_counter()
    try:
        p: MachineProfile = passes.measure_watched(lambda: measure_profile("cpu"), say=print)
    finally:
        for s in spinners:
            s.terminate()
            s.join()
    return {"busy": busy, "max_passes": max_passes, "seconds": round(time.perf_counter() - started, 1),
            "passes": p.load.get("passes"), "other_cores": p.load.get("other_cores"),
            "rates": {k: f(p) for k, f in RATES.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--busy", type=int, nargs="+", default=[0, 1], help="extra spinning processes per scenario")
    ap.add_argument("--json", default="calibration_load", help="results name or path ending in .json")
    args = ap.parse_args()
    print(cpu_line())
    watched = passes.MAX_PASSES
    runs = [measure(busy, n) for busy in args.busy for n in (1, watched)]
    best = {k: max(r["rates"][k] for r in runs) for k in RATES}
    rows = [{**{k: v for k, v in r.items() if k != "rates"}, **{k: r["rates"][k] / best[k] for k in RATES}}
            for r in runs]
    print(format_table(rows, [("busy", "busy procs"), ("max_passes", "max passes"), ("passes", "passes"),
                              ("other_cores", "other cores"), ("seconds", "s"), *((k, k) for k in RATES)]))
    print("rates as a fraction of the best any measurement saw (1.00 = best)")
    print(f"wrote {write_json(args.json, {'runs': runs, 'best': best})}")


if __name__ == "__main__":
    main()
