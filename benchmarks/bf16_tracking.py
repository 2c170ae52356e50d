"""How closely the Engine's bf16 (and fp16) run tracks its fp32 run, through the Python API.

Builds the default GPT (``cfg.seed``) once per mode, trains each with ``mct train``'s
AdamW recipe at a constant ``train.lr`` on the same batches (one process, ZeRO stage
``--stage``), and prints each step's loss and its difference from fp32, then the
loss after ``--steps`` updates (evaluated on the next batch, in each mode's precision)
and the largest difference of the masters from the fp32 init right after construction
(0 when the masters are the exact fp32 values).

    PYTHONPATH=src:. python benchmarks/bf16_tracking.py [--steps 6] [--stage 0] [--modes fp32,bf16]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import cpu_line, write_json
from mct.config import EngineConfig
from mct.data import build_data
from mct.engine import Engine
from mct.task import build_model, seeded, task_for
from mct.task.gpt import make_optimizer, step_batches


def run(mode: str, steps: int, stage: int) -> tuple[list[float], float]:
    """(losses of steps 0..steps, where the last is after ``steps`` updates; the
    largest |master - fp32 init| after construction)."""
    cfg = EngineConfig.from_dict({"precision": {"mode": mode}, "zero": {"stage": stage}})
    task = task_for(cfg)
    _, sampler = build_data(cfg, 1)
    model, _ = build_model(task, cfg, on_meta=False)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = Engine(model, task.optimizer, cfg, param_groups=task.param_groups(model))
    start = engine.full_state_dict()
    init_err = max(float((start[n] - v).abs().max()) for n, v in init.items())
    loss_fn = seeded(task.loss_fn)
    losses = []
    for step in range(steps + 1):
        batch = step_batches(sampler, cfg, step, 0)
        if step < steps:
            losses.append(engine.train_step(batch, loss_fn).loss)
        else:
            with torch.no_grad(), engine.precision.autocast("cpu"):
                losses.append(sum(float(loss_fn(engine.model, b)) for b in batch) / len(batch))
    engine.close()
    return losses, init_err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--stage", type=int, default=0)
    ap.add_argument("--modes", default="fp32,bf16")
    ap.add_argument("--json", default="bf16_tracking", help="result name or path (.json)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    modes = args.modes.split(",")
    out = {m: run(m, args.steps, args.stage) for m in modes}
    base = out[modes[0]][0]
    print(cpu_line())
    print(f"{'step':>4} " + " ".join(f"{m:>10} {'diff':>9}" for m in modes))
    for s in range(args.steps + 1):
        label = f"{s:>4}" if s < args.steps else "eval"
        print(label + " " + " ".join(f"{out[m][0][s]:>10.6f} {out[m][0][s] - base[s]:>+9.2e}" for m in modes))
    for m in modes:
        print(f"{m}: loss after {args.steps} updates {out[m][0][-1]:.6f}, difference from {modes[0]} "
              f"{out[m][0][-1] - base[-1]:+.3e}; max |master - fp32 init| at construction {out[m][1]:.2e}")
    path = write_json(args.json, {"steps": args.steps, "stage": args.stage,
                                  "modes": {m: {"losses": out[m][0], "init_max_abs_err": out[m][1]} for m in modes}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
