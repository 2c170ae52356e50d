"""Planner accuracy: predicted vs measured per-rank peak for every configuration of
stages 0-3 x policies none/all/sqrt x fp32/bf16 x 1 and 2 ranks on the tiny GPT, beside
DeepSpeed's published model-state estimate for stages 2 and 3 (no activations).

    PYTHONPATH=src:. python benchmarks/planner.py [--micro-batch 4] [--layers 2]

Prints a table and writes benchmarks/results/planner.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "src")]

from mct.memory.planner import ModelSource, meta_layout, predict  # noqa: E402
from mct.memory.tracker import format_bytes  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from tests.helpers import measured_peak, tiny_config  # noqa: E402

STAGES, POLICIES, PRECISIONS = (0, 1, 2, 3), ("none", "all", "sqrt"), ("fp32", "bf16")


def grid() -> list[tuple[int, str, str]]:
    return [(s, p, q) for q in PRECISIONS for p in POLICIES for s in STAGES]


def config(stage: int, policy: str, precision: str, batch: int, layers: int):
    return tiny_config(zero={"stage": stage}, checkpointing={"policy": policy}, precision={"mode": precision},
                       data={"micro_batch_size": batch}, model={"n_layer": layers})


def measure(rank: int, world: int, batch: int, layers: int) -> list[int]:
    """Max tracker peak over two steps for every configuration (this rank)."""
    return [measured_peak(config(*c, batch, layers), rank, batch) for c in grid()]


def deepspeed_estimate(stage: int, n_params: int, largest_layer: int, world: int) -> int | None:
    """DeepSpeed's estimate_zero2/3_model_states_mem_needs (offload off, one GPU per
    node): stage 2: 4 psi + 16 psi / N; stage 3: 4 x largest layer + 18 psi / N."""
    if stage == 2:
        return int(4 * n_params + 16 * n_params / world)
    if stage == 3:
        return int(4 * largest_layer + 18 * n_params / world)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    t0 = time.perf_counter()
    measured = {1: measure(0, 1, args.micro_batch, args.layers),
                2: run_distributed(measure, 2, args.micro_batch, args.layers, timeout=900)[0]}
    rows, memo = [], {}
    for world in (1, 2):
        for (stage, policy, precision), got in zip(grid(), measured[world]):
            cfg = config(stage, policy, precision, args.micro_batch, args.layers)
            source = ModelSource.from_config(cfg)
            layout = meta_layout(source, world)
            pred = predict(layout, source, stage=stage, policy=policy, precision=precision, batch=args.micro_batch,
                           seq=cfg.model.seq_len, memo=memo.setdefault(world, {}))
            block = max(sum(u.numel for u in layout.units if u.owner == b) for b in layout.blocks)
            ds = deepspeed_estimate(stage, layout.n_params, block, world)
            rows.append({"world": world, "stage": stage, "policy": policy, "precision": precision,
                         "predicted": pred.peak, "measured": got, "error_pct": 100 * (pred.peak - got) / got,
                         "at": pred.stage_name, "deepspeed_model_states": ds})
    header = f"{'ranks':>5} {'stage':>5} {'policy':>6} {'prec':>5} {'predicted':>11} {'measured':>11} " \
             f"{'error':>7} {'at':>9} {'DeepSpeed est.':>14}"
    print(header)
    for r in rows:
        ds = format_bytes(r["deepspeed_model_states"]) if r["deepspeed_model_states"] else "-"
        print(f"{r['world']:>5} {r['stage']:>5} {r['policy']:>6} {r['precision']:>5} {format_bytes(r['predicted']):>11} "
              f"{format_bytes(r['measured']):>11} {r['error_pct']:>6.1f}% {r['at']:>9} {ds:>14}")
    worst = max(abs(r["error_pct"]) for r in rows)
    print(f"worst |error| {worst:.2f}% over {len(rows)} configurations; {time.perf_counter() - t0:.0f}s")
    out = Path(__file__).resolve().parent / "results" / "planner.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"micro_batch": args.micro_batch, "layers": args.layers, "rows": rows,
                               "worst_error_pct": worst}, indent=2) + "\n")


if __name__ == "__main__":
    main()
