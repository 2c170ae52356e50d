"""What ``mct train``'s default instruments cost per step, against the Engine API with
memory tracking off, on the same model, the same batches and the same ranks.

Variants, all built in the same processes and stepped round-robin (one step of each per
round, after a barrier), so a burst of load from elsewhere hits them alike:

  engine        ``mct.Engine`` with ``memory.track = false``: the yardstick
  engine+track  the same with the memory tracker on (its cost alone)
  train         ``mct train``'s loop as it runs by default (``Trainer.run_step``): the
                tracker, the metrics row and its ``metrics.jsonl`` line every
                ``train.log_every`` steps, the progress bar, MFU per row, the per-step
                verdict all-reduce, the rollback snapshot every ``train.snapshot_every``
                steps; validation off (``train.eval_every = 0``: it is evaluation, not an
                instrument, and its cost is what ``eval_batches`` asks for)
  train-notrack the same loop with ``memory.track = false`` (the loop's cost alone)

Every variant uses ``mct train``'s recipe (AdamW of the recipe, grad clip 1.0, the seeded
loss, the sampler's batches of the default corpus). Printed per variant: the median
step (the slowest rank's, per round) over the engine's; the mean, which carries what
comes every N steps (the counted step, snapshot, metrics line) and a median leaves out;
the CPU seconds of the ranks' processes over the engine's (what load from other
processes changes least); and, for the loops, rank 0's time outside ``Engine.train_step``
within the same steps (the loop's own cost, which load cannot move from one variant to
another).

    PYTHONPATH=src:. python benchmarks/instruments.py [--model llama-small|llama-medium|gpt]
        [--precision bf16|fp32] [--ranks 2] [--steps 12] [--variants engine,train]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks` and `tests` importable
from benchmarks.common import cpu_line, format_table, interleave, write_json  # noqa: E402
from benchmarks.peers import SIZES, llama_config  # noqa: E402
from mct.config import CLI_RECIPE, EngineConfig  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

LLAMAS = {f"llama-{size}": size for size in SIZES}  # the sizes of benchmarks/peers.py
VARIANTS = ("engine", "engine+track", "train", "train-notrack")


def llama_dir(name: str, root: Path) -> tuple[str, int, int]:
    """Write the transformers Llama ``name`` (``peers.py``'s size) as a Hugging Face
    directory under ``root`` (config.json only: ``mct train --model hf:DIR`` builds it from
    its config). Returns (the directory, seq_len, micro-batch)."""
    size = LLAMAS[name]
    *_, seq, mbs = SIZES[size]
    path = root / name
    llama_config(size).save_pretrained(path)
    return str(path), seq, mbs


def config_for(model: str, precision: str, root: Path, stage: int) -> dict[str, Any]:
    """``mct train``'s configuration of the run (CLI recipe + the model and sizes)."""
    d: dict[str, Any] = {**{k: dict(v) for k, v in CLI_RECIPE.items()}}
    d["precision"] = {"mode": precision}
    d["zero"] = {"stage": stage}
    d["train"] = {**d["train"], "steps": 100_000, "eval_every": 0}
    if model == "gpt":
        d["data"] = {"micro_batch_size": 16}
        return d
    path, seq, mbs = llama_dir(model, root)
    d["model"] = {"source": f"hf:{path}", "seq_len": seq}
    d["data"] = {"micro_batch_size": mbs}
    return d


def _engine(cfg: EngineConfig):
    """The Engine as ``mct train`` builds it (the same task, recipe, groups, seed)."""
    from mct.engine import Engine
    from mct.task import build_model, builds_on_meta, task_for
    from mct.task.gpt import make_optimizer
    task = task_for(cfg)
    model, program = build_model(task, cfg, on_meta=builds_on_meta(cfg))
    groups = task.param_groups(model) if task.param_groups else None
    return Engine(model, task.optimizer or make_optimizer(cfg), cfg, param_groups=groups, init_program=program)


def _worker(rank: int, world: int, base: dict[str, Any], variants: list[str], steps: int,
            root: str) -> dict[str, Any]:
    import torch.distributed as dist
    from mct.data import build_data
    from mct.run.components import Progress
    from mct.run.schedule import LRSchedule
    from mct.run.trainer import Trainer
    from mct.task import seeded, task_for
    from mct.task.gpt import step_batches

    run, inside = {}, {}
    for name in variants:
        track = name in ("engine+track", "train")
        cfg = EngineConfig.from_dict({**base, "memory": {"track": track}})
        if name.startswith("train"):
            trainer = Trainer(cfg, Path(root) / name, progress=True)
            trainer.bar = Progress(trainer.progress_enabled, cfg.train.steps, 0)
            inside[name] = _time_engine_steps(trainer.engine)
            run[name] = lambda i, t=trainer: t.run_step()
        else:
            engine, (_, sampler) = _engine(cfg), build_data(cfg, world)
            loss_fn, schedule = seeded(task_for(cfg).loss_fn), LRSchedule(cfg.train)

            def step(i: int, e=engine, s=sampler, c=cfg, lf=loss_fn, sch=schedule) -> None:
                for g in e.optimizer.param_groups:
                    g["lr"] = sch.lr(i)
                e.train_step(step_batches(s, c, i, rank), lf)
            run[name] = step
    cpu: dict[str, list[float]] = {name: [] for name in run}
    times = interleave({name: _cpu_timed(fn, cpu[name]) for name, fn in run.items()}, steps, warmup=1,
                       before_each=dist.barrier)
    return {"times": times, "cpu_s": {name: c[1:] for name, c in cpu.items()},
            "engine_s": {name: spent[1:] for name, spent in inside.items()}}


def _cpu_timed(fn, into: list[float]):
    """``fn`` recording the CPU seconds this process spends in each call: what another
    process's load on the machine changes least (it still shares caches and cores)."""
    def call(i: int) -> None:
        t0 = time.process_time()
        fn(i)
        into.append(time.process_time() - t0)
    return call


def _time_engine_steps(engine) -> list[float]:
    """Wrap ``engine.train_step`` to record its seconds per call (the loop's own cost is
    the rest of the step, measured within the same step, so load cannot blur it)."""
    spent: list[float] = []
    step = engine.train_step

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return step(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - t0)
    engine.train_step = timed
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-small", choices=[*LLAMAS, "gpt"])
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--ranks", type=int, default=2, help="gloo ranks (1 thread each)")
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12, help="timed rounds after one warm-up round")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default="instruments", help="result name or path (.json)")
    args = ap.parse_args()
    variants = args.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad or "engine" not in variants:
        ap.error(f"--variants {args.variants!r}: choose from {','.join(VARIANTS)}, engine included")
    with tempfile.TemporaryDirectory() as tmp:
        base = config_for(args.model, args.precision, Path(tmp), args.stage)
        per_rank = run_distributed(_worker, args.ranks, base, variants, args.steps, tmp, timeout=7200)
    # a step ends when its slowest rank ends: per round, the max over ranks
    times = {v: [max(r["times"][v][i] for r in per_rank) for i in range(args.steps)] for v in variants}
    ref = statistics.median(times["engine"])
    cpu = {v: [sum(r["cpu_s"][v][i] for r in per_rank) for i in range(args.steps)] for v in variants}
    rows = [{"variant": v, "median_ms": 1e3 * statistics.median(t), "mean_ms": 1e3 * statistics.mean(t),
             "x_engine": statistics.median(t) / ref, "mean_x_engine": statistics.mean(t) / statistics.mean(times["engine"]),
             "cpu_x_engine": statistics.mean(cpu[v]) / statistics.mean(cpu["engine"])}
            for v, t in times.items()]
    for row in rows:  # rank 0's loop outside the engine, within the same steps
        engine_s = per_rank[0]["engine_s"].get(row["variant"])
        if engine_s:
            own = [t - e for t, e in zip(per_rank[0]["times"][row["variant"]], engine_s)]
            row["loop_ms"] = 1e3 * statistics.mean(own)
            row["loop_pct"] = 100 * sum(own) / sum(per_rank[0]["times"][row["variant"]])
    print(f"{args.model}, {args.precision}, stage {args.stage}, {args.ranks} gloo rank(s) x 1 thread, "
          f"{args.steps} rounds after 1 warm-up; {cpu_line()}")
    print(format_table(rows, [("variant", "variant"), ("median_ms", "median ms"), ("x_engine", "x engine"),
                              ("mean_ms", "mean ms"), ("mean_x_engine", "mean x engine"),
                              ("cpu_x_engine", "CPU s x engine (mean)"),
                              ("loop_ms", "loop outside engine, mean ms"), ("loop_pct", "% of step")]))
    path = write_json(args.json, {"model": args.model, "precision": args.precision, "stage": args.stage,
                                  "ranks": args.ranks, "rows": rows, "times_s": times, "cpu_s": cpu})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
