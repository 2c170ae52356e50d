"""Planner accuracy: the dry run's predicted per-rank peaks (steady-state step, first
step, initialization) against an independent count of every live storage in a real
run (tests/storage_count.py), on models the planner was not tuned for: a Hugging Face
GPT-2 with dropout, a model with tied, frozen and re-used parameters and odd sizes, and
the reference GPT; stages 0-3 x none/selective/all x fp32/bf16 on 1-4 ranks.

    PYTHONPATH=src:. python benchmarks/planner.py [--worlds 1 2 3 4] [--models hf_gpt2 ...]

Prints a table (with each dry run's CPU seconds) and the worst error; writes
benchmarks/results/planner.json.
``--speed [...]`` runs benchmarks/planner_speed.py instead (seconds per configuration
against model size and depth, full dry run beside depth extrapolation).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "src")]

from mct.memory.tracker import format_bytes  # noqa: E402
from mct.models.gpt import GPT, gpt_loss  # noqa: E402
from mct.planner import dry_run, token_loss  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from tests.helpers import tiny_config  # noqa: E402
from tests.planner_models import hf_gpt2, random_batch, tied_frozen_reused  # noqa: E402
from tests.storage_count import measure  # noqa: E402

B = 3
STAGES, POLICIES, PRECISIONS = (0, 1, 2, 3), ("none", "selective", "all"), ("fp32", "bf16")
ODD_GPT = {"n_layer": 3, "n_head": 3, "d_model": 30, "seq_len": 13, "vocab_size": 101, "dropout": 0.1}


def models() -> dict:
    """name -> (model factory, loss, batch(step, rank))."""
    gpt_cfg = tiny_config(model=ODD_GPT).model
    return {"hf_gpt2": (hf_gpt2, token_loss, lambda s, r: random_batch(s, r, B)),
            "tied_frozen_reused": (tied_frozen_reused, token_loss, lambda s, r: random_batch(s, r, B)),
            "gpt_odd": (lambda: GPT(gpt_cfg), gpt_loss, lambda s, r: random_batch(s, r, B))}


def grid(names: list[str]) -> list[tuple[str, int, str, str]]:
    return [(m, s, p, q) for m in names for q in PRECISIONS for p in POLICIES for s in STAGES]


def config(stage: int, policy: str, precision: str):
    return tiny_config(zero={"stage": stage}, checkpointing={"policy": policy}, precision={"mode": precision})


def measure_all(rank: int, world: int, names: list[str]) -> list[dict]:
    table = models()
    return [measure(table[m][0], table[m][1], table[m][2], config(*c), rank) for m, *c in grid(names)]


def main() -> None:
    if "--speed" in sys.argv:
        from benchmarks.planner_speed import main as speed
        sys.argv.remove("--speed")
        return speed()
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--models", nargs="+", default=list(models()))
    args = ap.parse_args()
    t0 = time.perf_counter()
    table, rows = models(), []
    for world in args.worlds:
        got = (measure_all(0, 1, args.models) if world == 1
               else run_distributed(measure_all, world, args.models, timeout=3600)[0])
        for (m, *c), real in zip(grid(args.models), got):
            fn, loss, batch = table[m]
            t1 = time.process_time()
            run = dry_run(fn, loss, batch(0, 0), config(*c), world)
            row = {"model": m, "world": world, "stage": c[0], "policy": c[1], "precision": c[2],
                   "params": run.n_params, "dry_run_cpu_s": round(time.process_time() - t1, 3)}
            for key, pred, meas in (("steady", run.peak, real["steps"][1]), ("first", run.first_step_peak,
                                    real["steps"][0]), ("init", run.init_peak, real["init"])):
                row[f"{key}_predicted"], row[f"{key}_measured"] = pred, meas
                row[f"{key}_error_pct"] = 100 * (pred - meas) / meas
            rows.append(row)
    header = (f"{'model':>18} {'ranks':>5} {'stage':>5} {'policy':>9} {'prec':>5} {'predicted':>11} {'measured':>11} "
              f"{'error':>7} {'first err':>9} {'init err':>8} {'params':>8} {'dry run s':>9}")
    print(header)
    for r in rows:
        print(f"{r['model']:>18} {r['world']:>5} {r['stage']:>5} {r['policy']:>9} {r['precision']:>5} "
              f"{format_bytes(r['steady_predicted']):>11} {format_bytes(r['steady_measured']):>11} "
              f"{r['steady_error_pct']:>6.2f}% {r['first_error_pct']:>8.2f}% {r['init_error_pct']:>7.2f}% "
              f"{r['params']:>8} {r['dry_run_cpu_s']:>9.3f}")
    worst = {k: max(abs(r[f"{k}_error_pct"]) for r in rows) for k in ("steady", "first", "init")}
    print(f"worst |error| over {len(rows)} configurations: steady step {worst['steady']:.2f}%, first step "
          f"{worst['first']:.2f}%, initialization {worst['init']:.2f}%; {time.perf_counter() - t0:.0f}s; "
          f"a dry run {sum(r['dry_run_cpu_s'] for r in rows) / len(rows):.2f} CPU s on average (seconds per "
          f"configuration against model size and depth: --speed)")
    out = Path(__file__).resolve().parent / "results" / "planner.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"micro_batch": B, "rows": rows, "worst_error_pct": worst}, indent=2) + "\n")


if __name__ == "__main__":
    main()
