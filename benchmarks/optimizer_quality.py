"""Optimizer state quality: `mct train` of the default GPT with fp32, bf16 and int8 Adam
moments, same seed and data; the validation loss after the last step side by side.

Runs ``python -m mct train --set optimizer.state_dtype=D`` (the real recipe: schedule,
clipping, evaluation) into temporary run dirs and reads ``metrics.jsonl``. Targets:
bf16 within 1% and int8 within 2% of fp32's validation loss.

    PYTHONPATH=src:. python benchmarks/optimizer_quality.py [--steps 300] [--dtypes fp32,bf16,int8]
        [--set section.key=value ...] [--hf-llama]

``--hf-llama`` trains a transformers LlamaForCausalLM instead (4 layers x 128, GQA 4/2,
vocabulary 512, built from a config.json written here: ``--set model.source=hf:DIR``) and
also compares the loss curves: the largest gap to fp32's logged training loss over the run
(means of windows of 10 logged rows, and row by row) beside the final validation loss.
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
    curve = [r["loss"] for r in rows if "loss" in r and "val_loss" not in r]
    return {"state_dtype": dtype, "val_loss": val[-1]["val_loss"], "val_step": val[-1]["step"],
            "train_loss": rows[-1].get("loss"), "curve": curve, "wall_s": time.perf_counter() - t0}


HF_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 128,
            "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
"""A small Llama (shapes only; mct builds it from this config.json, seeded)."""


def window_means(curve: list[float], k: int = 10) -> list[float]:
    return [sum(curve[i:i + k]) / len(curve[i:i + k]) for i in range(0, len(curve), k)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--dtypes", default="fp32,bf16,int8")
    ap.add_argument("--set", action="append", default=[], dest="extra")
    ap.add_argument("--out", default="optimizer_quality")
    ap.add_argument("--hf-llama", action="store_true", help="a transformers Llama (config.json written here)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        extra = list(args.extra)
        if args.hf_llama:
            (Path(tmp) / "llama").mkdir()
            (Path(tmp) / "llama" / "config.json").write_text(json.dumps(HF_LLAMA))
            extra.append(f"model.source=hf:{Path(tmp) / 'llama'}")
        rows = [run(d, args.steps, extra, Path(tmp)) for d in args.dtypes.split(",")]
    ref = next((r for r in rows if r["state_dtype"] == "fp32"), rows[0])
    for r in rows:
        r["vs_fp32_pct"] = 100.0 * (r["val_loss"] / ref["val_loss"] - 1.0)
        gaps = [abs(a / b - 1.0) for a, b in zip(window_means(r["curve"]), window_means(ref["curve"]))]
        r["curve_gap_pct"] = 100.0 * max(gaps, default=0.0)
        r["row_gap_pct"] = 100.0 * max((abs(a / b - 1.0) for a, b in zip(r["curve"], ref["curve"])), default=0.0)
    what = "HF Llama (4 x 128, vocab 512)" if args.hf_llama else "default GPT"
    print(f"{what}{' with ' + ' '.join(args.extra) if args.extra else ''}, {args.steps} steps; CPU: {cpu_line()}")
    print(format_table(rows, [("state_dtype", "state"), ("val_loss", "val loss"), ("vs_fp32_pct", "% vs fp32"),
                              ("curve_gap_pct", "worst gap % (10-row means)"), ("row_gap_pct", "worst gap % (rows)"), ("train_loss", "train loss"),
                              ("wall_s", "wall s")]))
    print(f"wrote {write_json(args.out + ('_hf_llama' if args.hf_llama else ''), {'steps': args.steps, 'model': what, 'rows': rows})}")


if __name__ == "__main__":
    main()
