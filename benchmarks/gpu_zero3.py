"""Short bf16 ZeRO-3 timing on one CUDA device, with the measured peak (torch.cuda
statistics, through the engine's tracker) beside the planner's prediction.

Run by benchmarks/gpu_check.sh; single process (world 1: stage 3 still gathers and
frees every block, so the lifecycle and its memory are exercised).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from mct.config import EngineConfig
from mct.engine import Engine
from mct.planner import predict_peak
from mct.models.gpt import GPT, gpt_loss, optimizer_groups


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    rows = []
    for policy in ("none", "all"):
        cfg = EngineConfig.from_dict({
            "model": {"n_layer": args.layers, "d_model": args.d_model, "n_head": args.d_model // 64,
                      "seq_len": args.seq, "attention": "sdpa"},  # what 'auto' runs on CUDA; planned as such
            "data": {"micro_batch_size": args.batch}, "zero": {"stage": 3}, "precision": {"mode": "bf16"},
            "checkpointing": {"policy": policy}, "train": {"grad_clip": 1.0}})
        # the dry run is the CPU path (per-tensor AdamW, no allocator caching): a lower bound here
        tokens = torch.zeros(args.batch, args.seq, dtype=torch.long)
        predicted = predict_peak(lambda: GPT(cfg.model), gpt_loss, (tokens, tokens), cfg, 1,
                                 lambda g: torch.optim.AdamW(g, lr=1e-4),
                                 param_groups=lambda m: optimizer_groups(m, 0.1))
        left = torch.cuda.memory_allocated()  # what an earlier row left behind (0 when it freed all)
        torch.manual_seed(0)
        model = GPT(cfg.model)
        engine = Engine(model, lambda g: torch.optim.AdamW(g, lr=1e-4), cfg,
                        param_groups=optimizer_groups(model, 0.1))
        x = torch.randint(0, 256, (args.batch, args.seq), device="cuda")
        times, peaks = [], []
        for step in range(args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = engine.train_step((x, x), gpt_loss)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            peaks.append(out.metrics["peak_bytes"])
        med = statistics.median(times[2:])
        row = {"policy": policy, "step_ms": med * 1e3, "tokens_per_s": args.batch * args.seq / med,
               "measured_peak_MiB": max(peaks[1:]) / 2**20, "predicted_peak_MiB": predicted / 2**20,
               "error_pct": 100 * (predicted - max(peaks[1:])) / max(peaks[1:]), "loss": out.loss,
               "left_before_MiB": left / 2**20}
        rows.append(row)
        engine.close()
        del engine, model, out
        gc.collect()  # the engine's hooks hold it in reference cycles: free its device memory before the next row
        torch.cuda.empty_cache()
    keys = list(rows[0])
    print(" ".join(f"{k:>18}" for k in keys))
    for r in rows:
        print(" ".join(f"{v:>18.2f}" if isinstance(v, float) else f"{v:>18}" for v in r.values()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
