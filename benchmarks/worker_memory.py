"""What a ``mct train`` worker holds beyond its tensors, per component: each rank is a fresh
``python`` that records its resident set (VmRSS) and peak (VmHWM) after each stage of a
real run: the bare interpreter, ``import torch``, mct's trainer imports, the gloo process
group, the task, the planner's resolution, the data pipeline, the engine (model, optimizer),
the FLOP count on fake tensors (the dry run), the metrics writer, the first step, the later
steps, a checkpoint save, and glibc's ``malloc_trim`` at the end. Stages are timed by
wrapping the trainer module's own calls, so what is measured is what ``mct train`` runs.

Printed: the CPU's model and flags, then per stage rank 0's VmRSS after it, what the stage
added, and VmHWM; with the tracker's tensor peak beside. Written:
``benchmarks/results/worker_memory.json``.

    PYTHONPATH=src:. python benchmarks/worker_memory.py [--nproc 2] [--steps 6] [--default-model]
        [--set section.key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY = {"seed": 5, "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16},
        "data": {"micro_batch_size": 2}, "train": {"eval_every": 0, "checkpoint_every": 0, "log_every": 1},
        "zero": {"stage": 2}}


def _status() -> tuple[int, int]:
    text = Path("/proc/self/status").read_text()
    got = {k: int(v.split()[0]) * 1024 for k, _, v in (x.partition(":") for x in text.splitlines())
           if k in ("VmRSS", "VmHWM")}
    return got["VmRSS"], got["VmHWM"]


def worker(spec_path: str) -> None:
    """One rank: the stages in order, each row (stage, VmRSS, VmHWM) appended as JSON to
    ``spec['out']``.RANK. Imports are measured here, so nothing heavy is imported above."""
    stages: list[tuple[str, int, int]] = [("python", *_status())]
    spec = json.loads(Path(spec_path).read_text())
    import torch  # noqa: F401
    stages.append(("import torch", *_status()))
    import mct.run.trainer as T
    from mct.config import EngineConfig
    from mct.dist import init_distributed
    from mct.memory import host
    stages.append(("import mct (trainer, engine, planner)", *_status()))
    ctx = init_distributed("gloo")
    stages.append(("process group (gloo)", *_status()))

    def wrap(owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def measured(*args, **kwargs):
            out = original(*args, **kwargs)
            stages.append((label, *_status()))
            return out
        setattr(owner, name, measured)
    for owner, name, label in ((T, "task_for", "task (model source)"), (T, "resolve_once", "planner resolution"),
                               (T, "build_data", "data pipeline"),
                               (T.Trainer, "build_engine", "engine: model, flat units, optimizer"),
                               (T.Trainer, "_utilization", "FLOP count on fake tensors (dry run)"),
                               (T, "MetricsWriter", "metrics writer")):
        wrap(owner, name, label)
    cfg = EngineConfig.from_dict(spec["config"])
    trainer = T.Trainer(cfg, spec["run_dir"], ctx, progress=False)
    trainer.run_step()
    stages.append(("first step", *_status()))
    for _ in range(spec["steps"] - 1):
        trainer.run_step()
    stages.append((f"{spec['steps'] - 1} more steps", *_status()))
    trainer.save_checkpoint()
    stages.append(("checkpoint save (DCP)", *_status()))
    host.trim()
    stages.append(("malloc_trim", *_status()))
    tensor_peak = trainer.engine.tracker.peak_total()
    Path(f"{spec['out']}.{ctx.rank}").write_text(json.dumps({"stages": stages, "tensor_peak": tensor_peak}))


def run(nproc: int, steps: int, sets: list[str], default_model: bool = False) -> list[dict]:
    """Start ``nproc`` ranks of ``worker`` (the tiny GPT, or the recipe's default one);
    their records by rank."""
    from mct.config import apply_overrides
    from mct.run.agent import free_port, worker_env
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus"
        corpus.mkdir()
        for i in range(8):
            (corpus / f"f{i}.txt").write_text(f"file {i}: " + "the quick brown fox jumps. " * 80)
        base = {k: v for k, v in TINY.items() if not (default_model and k == "model")}
        config = apply_overrides({**base, "data": {"path": str(corpus)} if default_model else
                                  {**TINY["data"], "path": str(corpus)}, "train": {**TINY["train"], "steps": steps}},
                                 sets)
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({"config": config, "run_dir": str(Path(tmp) / "run"), "steps": steps,
                                    "out": str(Path(tmp) / "stages")}))
        base = dict(os.environ, OMP_NUM_THREADS="1",
                    PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")]))
        port = free_port()
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(spec)],
                                  env=worker_env(base, rank=r, nproc=nproc, restart=0, max_restarts=0, port=port,
                                                 run_id="bench")) for r in range(nproc)]
        if any(p.wait(timeout=1800) for p in procs):
            raise SystemExit(f"a rank failed: exit codes {[p.returncode for p in procs]}")
        return [json.loads(Path(f"{tmp}/stages.{r}").read_text()) for r in range(nproc)]


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        return worker(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--default-model", action="store_true", help="the recipe's default GPT, not the tiny one")
    ap.add_argument("--set", action="append", default=[], help="a config override, e.g. zero.stage=3")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from benchmarks.common import cpu_line, format_table, write_json
    ranks = run(args.nproc, args.steps, args.set, args.default_model)
    rows, before = [], 0
    for name, rss, hwm in ranks[0]["stages"]:
        rows.append({"stage": name, "rss": round(rss / 2**20, 1), "added": round((rss - before) / 2**20, 1),
                     "hwm": round(hwm / 2**20, 1)})
        before = rss
    print(cpu_line())
    model = "the default GPT" if args.default_model else "the tiny GPT"
    print(f"{args.nproc} gloo rank(s), {model} {' '.join(args.set)}; rank 0 after each stage:")
    print(format_table(rows, [("stage", "stage"), ("rss", "VmRSS MiB"), ("added", "added MiB"),
                              ("hwm", "VmHWM MiB")]))
    peak, hwm = ranks[0]["tensor_peak"], ranks[0]["stages"][-1][2]
    print(f"tensor bytes (tracker peak): {peak / 2**20:.2f} MiB; resident (VmHWM): {hwm / 2**20:.1f} MiB")
    print(f"wrote {write_json('worker_memory', {'nproc': args.nproc, 'steps': args.steps, 'set': args.set, 'ranks': ranks})}")


if __name__ == "__main__":
    main()
