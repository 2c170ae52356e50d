"""Mixed precision benchmark: fp32, bf16 and fp16 through the Engine on the default GPT.

Variants are a precision mode, an attention implementation (``model.attention``: auto,
sdpa, explicit) and the CPU matmul kernels (``precision.cpu_matmul``: auto, native, fp32),
so each bf16 choice is measured side by side with fp32.
For each variant: median step time and tokens/s (untracked engines, all modes measured
round-robin, one step each per round, so load bursts hit every mode alike), model-state
bytes (params, grads, fp32 master, optimizer state) and the activation peak from a
separate tracked engine, and the loss after N steps on the same batches. Prints a
table with ratios against fp32 and writes ``benchmarks/results/precision.json``.

MFU: model FLOPs per step (``mct train``'s count) over the median step time, against this
machine's measured matmul peak of the variant's dtype x threads (``mct calibrate``).

    PYTHONPATH=src:. python benchmarks/precision.py [--steps 12] [--micro-batch-size 8] [--threads 1]
        [--variants fp32,bf16,bf16:explicit,bf16:auto:native,fp16]

On CPUs without native bf16 (AVX2) torch's own bf16/fp16 matmuls are 25-40x slower than
fp32 (the ``:native`` variants); ``precision.cpu_matmul = auto`` runs them on fp32 kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import add_mfu, mfu_line, step_utilization
from mct.config import EngineConfig
from mct.data import build_data
from mct.engine import Engine
from mct.models.gpt import GPT, gpt_loss, optimizer_groups
from mct.run.utilization import Utilization
from mct.task.tokens import token_batch
from mct.run.trainer import build_gpt, make_optimizer, seeded_gpt_loss, step_batches

VARIANTS = ("fp32", "bf16", "bf16:explicit", "fp16")
"""'mode[:attention[:cpu_matmul]]'; the first is the baseline of every ratio."""
RESULTS = Path(__file__).resolve().parent / "results" / "precision.json"


def variant_config(variant: str, micro_batch_size: int, track: bool) -> EngineConfig:
    """`mct train`'s recipe (clip 1.0) in the variant's precision mode, attention and CPU
    matmul kernels ('mode[:attention[:cpu_matmul]]')."""
    mode, attention, cpu_matmul = (variant.split(":") + ["", ""])[:3]
    return EngineConfig.from_dict({"precision": {"mode": mode, "cpu_matmul": cpu_matmul or "auto"},
                                   "data": {"micro_batch_size": micro_batch_size},
                                   "memory": {"track": track}, "train": {"grad_clip": 1.0},
                                   "model": {"attention": attention or "auto"}})


def utilization(variant: str, micro_batch_size: int) -> Utilization:
    """The variant's model FLOPs per step and matmul peak (its dtype, this process's threads)."""
    cfg = variant_config(variant, micro_batch_size, track=False)
    return step_utilization(lambda: GPT(cfg.model), gpt_loss, token_batch(cfg), cfg)


def make_engine(variant: str, micro_batch_size: int, track: bool) -> tuple[Engine, EngineConfig]:
    """Default GPT (ModelConfig defaults) in ``variant_config``."""
    cfg = variant_config(variant, micro_batch_size, track)
    model = build_gpt(cfg)
    return Engine(model, make_optimizer(cfg), cfg, param_groups=optimizer_groups(model, cfg.train.weight_decay)), cfg


def timed_runs(steps: int, warmup: int, micro_batch_size: int, variants: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Train one untracked engine per variant on identical batches, round-robin per step.
    Returns per variant: step times (warm-up dropped), losses, skipped flags."""
    engines = {m: make_engine(m, micro_batch_size, track=False) for m in variants}
    _, sampler = build_data(engines[variants[0]][1])
    out = {m: {"times": [], "losses": [], "skipped": []} for m in variants}
    for step in range(warmup + steps):
        for mode, (engine, cfg) in engines.items():
            batch = step_batches(sampler, cfg, step, 0)
            t0 = time.perf_counter()
            res = engine.train_step(batch, seeded_gpt_loss)
            dt = time.perf_counter() - t0
            if step >= warmup:
                out[mode]["times"].append(dt)
            out[mode]["losses"].append(res.loss)
            out[mode]["skipped"].append(res.skipped)
        print(f"  step {step}: " + ", ".join(f"{m} {out[m]['losses'][-1]:.4f}" for m in variants), flush=True)
    return out


def memory_runs(micro_batch_size: int, variants: tuple[str, ...], steps: int = 2) -> dict[str, dict[str, int]]:
    """Tracked engine per variant, ``steps`` steps (optimizer state exists after the first):
    persistent bytes by category after the last step and the activation peak within it."""
    out = {}
    for mode in variants:
        engine, cfg = make_engine(mode, micro_batch_size, track=True)
        _, sampler = build_data(cfg)
        for step in range(steps):
            res = engine.train_step(step_batches(sampler, cfg, step, 0), seeded_gpt_loss)
        live = engine.tracker.live()
        peaks = res.metrics["peaks"]
        out[mode] = {k: live[k] for k in ("params", "grads", "master", "optimizer")}
        out[mode]["model_state"] = sum(out[mode].values())
        out[mode]["activation_peak"] = max(p.get("activations", 0) for p in peaks.values())
        out[mode]["step_peak"] = res.metrics["peak_bytes"]
    return out


def cpu_features() -> dict[str, Any]:
    """What decides low-precision speed on CPU: native bf16/fp16 matrix units."""
    from mct.models.gpt import attention_impl
    from mct.precision.cpu_matmul import cpu_has_native_low_precision
    caps = torch.backends.cpu.get_cpu_capability()
    info: dict[str, Any] = {"capability": caps}
    try:
        flags = torch._C._cpu._get_cpu_capability()
        info.update({k: flags.get(k) for k in ("cpu_name", "avx512_bf16", "amx_bf16", "amx_fp16", "avx512_fp16")})
    except AttributeError:
        pass
    info["native_bf16"] = cpu_has_native_low_precision(torch.bfloat16)
    info["auto_attention_bf16"] = attention_impl("auto", "cpu", torch.bfloat16)
    return info


def summarize(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    q = statistics.quantiles(s, n=4) if len(s) >= 2 else [s[0]] * 3
    return {"median": statistics.median(s), "min": s[0], "max": s[-1], "iqr": q[2] - q[0]}


def build_rows(timed: dict, mem: dict, tokens_per_step: int, variants: tuple[str, ...],
               utils: dict[str, Utilization]) -> list[dict[str, Any]]:
    rows = []
    for mode in variants:
        t = summarize(timed[mode]["times"])
        rows.append(add_mfu({"mode": mode, "step_s": t["median"], "step_iqr_s": t["iqr"],
                             "tokens_per_s": tokens_per_step / t["median"], **mem[mode],
                             "final_loss": timed[mode]["losses"][-1], "skipped_steps": sum(timed[mode]["skipped"])},
                            utils[mode], t["median"]))
    base = rows[0]
    for r in rows:
        for k in ("step_s", "model_state", "params", "activation_peak", "step_peak"):
            r[f"{k}_vs_fp32"] = r[k] / base[k] if base[k] else None
        r["loss_vs_fp32"] = r["final_loss"] / base["final_loss"]
        r["tokens_per_s_vs_fp32"] = r["tokens_per_s"] / base["tokens_per_s"]
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    mib = lambda n: f"{n / 2**20:.2f}"
    cols = [("mode", lambda r: r["mode"]), ("step s", lambda r: f"{r['step_s']:.3f}"),
            ("x fp32", lambda r: f"{r['step_s_vs_fp32']:.2f}"), ("tok/s", lambda r: f"{r['tokens_per_s']:,.0f}"),
            ("tok/s x fp32", lambda r: f"{r['tokens_per_s_vs_fp32']:.2f}"),
            ("GFLOP/s", lambda r: f"{r['gflop_s']:.3g}"),
            ("MFU %", lambda r: "-" if r["mfu_pct"] is None else f"{r['mfu_pct']:.1f}"),
            ("params MiB", lambda r: mib(r["params"])), ("grads MiB", lambda r: mib(r["grads"])),
            ("master MiB", lambda r: mib(r["master"])), ("optim MiB", lambda r: mib(r["optimizer"])),
            ("state MiB", lambda r: mib(r["model_state"])), ("x fp32", lambda r: f"{r['model_state_vs_fp32']:.2f}"),
            ("act peak MiB", lambda r: mib(r["activation_peak"])),
            ("x fp32", lambda r: f"{r['activation_peak_vs_fp32']:.2f}"),
            ("step peak MiB", lambda r: mib(r["step_peak"])), ("x fp32", lambda r: f"{r['step_peak_vs_fp32']:.2f}"),
            ("final loss", lambda r: f"{r['final_loss']:.4f}"), ("skipped", lambda r: str(r["skipped_steps"]))]
    body = [[f(r) for _, f in cols] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, (h, _) in enumerate(cols)]
    line = lambda cells: " | ".join(c.rjust(w) for c, w in zip(cells, widths))
    return "\n".join([line([h for h, _ in cols]), "-+-".join("-" * w for w in widths), *map(line, body)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12, help="timed steps per mode (default 12)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed first steps (default 1)")
    ap.add_argument("--micro-batch-size", type=int, default=8, help="sequences per step (default 8)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    ap.add_argument("--out", default=str(RESULTS), help="JSON output path")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated 'mode[:attention[:cpu_matmul]]'; first = baseline")
    args = ap.parse_args(argv)
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = EngineConfig()
    tokens_per_step = args.micro_batch_size * cfg.model.seq_len
    print(f"default GPT {cfg.model}, {tokens_per_step} tokens/step, {torch.get_num_threads()} threads", flush=True)
    cpu = cpu_features()
    print(f"CPU: {cpu}", flush=True)
    utils = {v: utilization(v, args.micro_batch_size) for v in variants}
    mem = memory_runs(args.micro_batch_size, variants)
    timed = timed_runs(args.steps, args.warmup, args.micro_batch_size, variants)
    rows = build_rows(timed, mem, tokens_per_step, variants, utils)
    print(table(rows))
    for v in variants:
        print(f"{v}: {mfu_line(utils[v])}")
    for r in rows[1:]:
        if r["mode"].startswith("bf16"):
            verdict = "met" if r["tokens_per_s_vs_fp32"] >= 1.5 else "missed"
            print(f"{r['mode']}: {r['tokens_per_s_vs_fp32']:.2f}x fp32 tokens/s (target >= 1.5x: {verdict})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"rows": rows, "losses": {m: timed[m]["losses"] for m in variants},
               "step_times_s": {m: timed[m]["times"] for m in variants}, "cpu": cpu,
               "config": {"model": vars(cfg.model), "micro_batch_size": args.micro_batch_size, "steps": args.steps,
                          "warmup": args.warmup, "threads": torch.get_num_threads()},
               "environment": {"python": sys.version.split()[0], "torch": torch.__version__,
                               "platform": platform.platform(), "cpus": os.cpu_count(),
                               "loadavg_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None}}
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
