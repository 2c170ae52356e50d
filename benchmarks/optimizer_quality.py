"""Optimizer state quality: `mct train` of the default GPT with fp32, bf16 and int8 Adam
moments, same seed and data; the validation loss after the last step side by side.

Runs ``python -m mct train --set optimizer.state_dtype=D`` (the real recipe: schedule,
clipping, evaluation) into temporary run dirs and reads ``metrics.jsonl``. Targets:
bf16 within 1% and int8 within 2% of fp32's validation loss.

    PYTHONPATH=src:. python benchmarks/optimizer_quality.py [--steps 300] [--dtypes fp32,bf16,int8]
        [--set section.key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import cpu_line, format_table, write_json


def run(dtype: str, steps: int, extra: list[str], root: Path) -> dict:
    run_dir = root / dtype
    cmd = [sys.executable, "-m", "mct", "train", "--run-dir", str(run_dir), "--set", f"train.steps={steps}",
           "--set", f"optimizer.state_dtype={dtype}", *[a for s in extra for a in ("--set", s)]]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": "src"})
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val = [r for r in rows if "val_loss" in r]
    return {"state_dtype": dtype, "val_loss": val[-1]["val_loss"], "val_step": val[-1]["step"],
            "train_loss": rows[-1].get("loss"), "wall_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--dtypes", default="fp32,bf16,int8")
    ap.add_argument("--set", action="append", default=[], dest="extra")
    ap.add_argument("--out", default="optimizer_quality")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(d, args.steps, args.extra, Path(tmp)) for d in args.dtypes.split(",")]
    base = next((r["val_loss"] for r in rows if r["state_dtype"] == "fp32"), rows[0]["val_loss"])
    for r in rows:
        r["vs_fp32_pct"] = 100.0 * (r["val_loss"] / base - 1.0)
    print(f"{'GPT with ' + ' '.join(args.extra) if args.extra else 'default GPT'}, {args.steps} steps; CPU: {cpu_line()}")
    print(format_table(rows, [("state_dtype", "state"), ("val_loss", "val loss"), ("vs_fp32_pct", "% vs fp32"),
                              ("train_loss", "train loss"), ("wall_s", "wall s")]))
    print(f"wrote {write_json(args.out, {'steps': args.steps, 'rows': rows})}")


if __name__ == "__main__":
    main()
