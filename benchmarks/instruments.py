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
loss, the sampler's batches of the default corpus); the ratio printed is each variant's
median step over the engine's. The mean is printed too: it carries the costs that come
every N steps (snapshot, metrics line), which a median leaves out.

    PYTHONPATH=src:. python benchmarks/instruments.py [--model llama-small|llama-medium|gpt]
        [--precision bf16|fp32] [--ranks 2] [--steps 12] [--variants engine,train]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks` and `tests` importable
from benchmarks.common import cpu_line, format_table, interleave, write_json  # noqa: E402
from mct.config import CLI_RECIPE, EngineConfig  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

LLAMAS = {  # (hidden, layers, heads, kv heads, vocab, seq, micro-batch): the sizes of issue "Speed on a model..."
    "llama-small": (256, 4, 4, 4, 8192, 256, 4),
    "llama-medium": (1024, 8, 16, 4, 32000, 256, 2),
}
VARIANTS = ("engine", "engine+track", "train", "train-notrack")


def llama_dir(name: str, root: Path) -> tuple[str, int, int]:
    """Write the transformers Llama ``name`` as a Hugging Face directory under ``root``
    (config.json only: ``mct train --model hf:DIR`` builds it from its config).
    Returns (the directory, seq_len, micro-batch)."""
    from transformers import LlamaConfig
    hidden, layers, heads, kv, vocab, seq, mbs = LLAMAS[name]
    path = root / name
    LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(2.75 * hidden) // 64 * 64,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                max_position_embeddings=seq, tie_word_embeddings=False).save_pretrained(path)
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

    run = {}
    for name in variants:
        track = name in ("engine+track", "train")
        cfg = EngineConfig.from_dict({**base, "memory": {"track": track}})
        if name.startswith("train"):
            trainer = Trainer(cfg, Path(root) / name, progress=True)
            trainer.bar = Progress(trainer.progress_enabled, cfg.train.steps, 0)
            run[name] = lambda i, t=trainer: t.run_step()
        else:
            engine, (_, sampler) = _engine(cfg), build_data(cfg, world)
            loss_fn, schedule = seeded(task_for(cfg).loss_fn), LRSchedule(cfg.train)

            def step(i: int, e=engine, s=sampler, c=cfg, lf=loss_fn, sch=schedule) -> None:
                for g in e.optimizer.param_groups:
                    g["lr"] = sch.lr(i)
                e.train_step(step_batches(s, c, i, rank), lf)
            run[name] = step
    times = interleave(run, steps, warmup=1, before_each=dist.barrier)
    return times


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
    times = {v: [max(r[v][i] for r in per_rank) for i in range(args.steps)] for v in variants}
    ref = statistics.median(times["engine"])
    rows = [{"variant": v, "median_ms": 1e3 * statistics.median(t), "mean_ms": 1e3 * statistics.mean(t),
             "x_engine": statistics.median(t) / ref, "mean_x_engine": statistics.mean(t) / statistics.mean(times["engine"])}
            for v, t in times.items()]
    print(f"{args.model}, {args.precision}, stage {args.stage}, {args.ranks} gloo rank(s) x 1 thread, "
          f"{args.steps} rounds after 1 warm-up; {cpu_line()}")
    print(format_table(rows, [("variant", "variant"), ("median_ms", "median ms"), ("x_engine", "x engine"),
                              ("mean_ms", "mean ms"), ("mean_x_engine", "mean x engine")]))
    path = write_json(args.json, {"model": args.model, "precision": args.precision, "stage": args.stage,
                                  "ranks": args.ranks, "rows": rows, "times_s": times})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
