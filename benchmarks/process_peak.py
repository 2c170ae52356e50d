"""The process peak the planner predicts (``PlanRow.process_peak``: runtime baseline + tensor
peak + allocator overhead, ``mct.memory.process_peak``) against each worker's measured VmHWM.

For each configuration (the built-in GPT at three odd sizes, a tiny transformers Llama and
GPT-2; ZeRO stages 0-3; 1 and 2 ranks; checkpointing none/all; fp32/bf16; host_malloc
default/lean/frugal/cache; offload none/disk; 4 steps, and 300 for the rows that say so, whose
processes hold two rollback snapshots)
it runs ``mct train`` as a user would, reads every worker's VmHWM from the
run's metadata.json (``resident``), and the plan row of the same configuration (dry run, no
step is timed). Printed: the CPU's model and flags, then per configuration the tensor peak
(predicted, measured by the tracker), the predicted process peak and its terms, the measured
VmHWM of each worker and the error. Target: within 5% or 24 MiB, whichever is larger.
Written: ``benchmarks/results/process_peak.json``.

    PYTHONPATH=src:. python benchmarks/process_peak.py [--steps 4] [--only NAME,...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import cpu_info, cpu_line, format_table, write_json

REPO = Path(__file__).resolve().parent.parent
MiB = 2**20
GPT_A = ["model.n_layer=3", "model.n_head=5", "model.d_model=160", "model.seq_len=96", "data.micro_batch_size=3"]
GPT_B = ["model.n_layer=5", "model.n_head=7", "model.d_model=224", "model.seq_len=128", "data.micro_batch_size=2"]
LLAMA = ["model.seq_len=64", "data.micro_batch_size=2"]
GPT_C = ["model.n_layer=4", "model.n_head=6", "model.d_model=192", "model.seq_len=80", "data.micro_batch_size=2"]
GPT2 = ["model.seq_len=64", "data.micro_batch_size=2"]
CASES: list[tuple[str, list[str], int, str]] = [  # name, --set values, ranks, model ('gpt', 'llama', 'gpt2')
    ("gpt-a s0 none fp32 default", [*GPT_A, "zero.stage=0", "checkpointing.policy=none"], 1, "gpt"),
    ("gpt-a s0 none fp32 lean", [*GPT_A, "zero.stage=0", "checkpointing.policy=none", "memory.host_malloc=lean"],
     1, "gpt"),
    ("gpt-a s3 all bf16 default x2", [*GPT_A, "zero.stage=3", "checkpointing.policy=all", "precision.mode=bf16"],
     2, "gpt"),
    ("gpt-b s0 all fp32 default", [*GPT_B, "zero.stage=0", "checkpointing.policy=all"], 1, "gpt"),
    ("gpt-b s3 none fp32 lean x2", [*GPT_B, "zero.stage=3", "checkpointing.policy=none", "memory.host_malloc=lean"],
     2, "gpt"),
    ("llama s0 none fp32 default", [*LLAMA, "zero.stage=0", "checkpointing.policy=none"], 1, "llama"),
    ("llama s3 all fp32 lean x2", [*LLAMA, "zero.stage=3", "checkpointing.policy=all", "memory.host_malloc=lean"],
     2, "llama"),
    # not used to tune the model: a second transformers family, and the optimizer state on disk
    ("gpt2 s0 all fp32 default", [*GPT2, "zero.stage=0", "checkpointing.policy=all"], 1, "gpt2"),
    ("gpt-a s1 none fp32 disk x2", [*GPT_A, "zero.stage=1", "checkpointing.policy=none", "offload.optimizer=disk"],
     2, "gpt"),
    # not used to tune anything: a third GPT size recomputing under frugal, GPT-2 in bf16
    ("gpt-c s2 all fp32 frugal", [*GPT_C, "zero.stage=2", "checkpointing.policy=all", "memory.host_malloc=frugal"],
     1, "gpt"),
    ("gpt2 s3 none bf16 x2", [*GPT2, "zero.stage=3", "checkpointing.policy=none", "precision.mode=bf16"], 2, "gpt2"),
    # the default job's model and recipe, validated and saved every 20 steps (its heap trimmed between)
    ("gpt default s0 none eval+save x60", ["train.steps=60", "train.eval_every=20", "train.checkpoint_every=20"],
     1, "gpt"),
    # the default job itself (`mct train`): 300 steps, validated every 50, saved after the last
    ("gpt default job", ["train.steps=300", "train.eval_every=50"], 1, "gpt"),
    # the default job recomputing: 300 steps show the heap's creep that 4 steps do not (docs/memory.md)
    ("gpt default job all", ["train.steps=300", "train.eval_every=50", "checkpointing.policy=all"], 1, "gpt"),
    ("gpt default job selective", ["train.steps=300", "train.eval_every=50", "checkpointing.policy=selective"],
     1, "gpt"),
    # long runs: two rollback snapshots held (train.snapshot_every 10) and the heap a forward's churn leaves;
    # gpt-b s0 and llama's 300 steps were among the runs the constants were fitted to, the others were not
    ("gpt-b s0 none fp32 default x300", [*GPT_B, "zero.stage=0", "checkpointing.policy=none", "train.steps=300"],
     1, "gpt"),
    ("gpt-b s2 none fp32 default x2 x300", [*GPT_B, "zero.stage=2", "checkpointing.policy=none", "train.steps=300"],
     2, "gpt"),
    ("gpt default job all bf16", ["train.steps=300", "train.eval_every=50", "checkpointing.policy=all",
                                  "precision.mode=bf16"], 1, "gpt"),
    ("llama s0 all fp32 default x300", [*LLAMA, "zero.stage=0", "checkpointing.policy=all", "train.steps=300"],
     1, "llama"),
    # the fourth host_malloc mode, on a model and stage it was not fitted to
    ("gpt-c s1 none fp32 cache x2 x300", [*GPT_C, "zero.stage=1", "checkpointing.policy=none",
                                          "memory.host_malloc=cache", "train.steps=300"], 2, "gpt"),
]
COMMON = ["train.eval_every=0", "train.checkpoint_every=0", "train.log_every=1"]


def save_hf(directory: Path, kind: str) -> None:
    """A tiny transformers model written with save_pretrained: 'llama' (4 x 128, GQA 2/1,
    vocab 256) or 'gpt2' (3 x 96, 4 heads, vocab 256)."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig
    if kind == "llama":
        config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=320, num_hidden_layers=4,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                             tie_word_embeddings=False)
    else:
        config = GPT2Config(vocab_size=256, n_embd=96, n_layer=3, n_head=4, n_positions=256)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def predicted(sets: list[str], ranks: int, model: str, steps: int) -> dict[str, Any]:
    """The plan row of the configuration ``sets`` names: its tensor peak, process peak and terms."""
    from mct.config import CLI_RECIPE, load_config
    from mct.planner import make_plan
    from mct.memory.process_peak import transient_bytes
    from mct.planner.grid import Grid
    from mct.planner.plan import predict
    from mct.planner.resident import process_model
    from mct.task import task_for
    cfg = load_config(None, [f"model.source={model}", *COMMON, f"train.steps={steps}", *sets], defaults=CLI_RECIPE)
    task = task_for(cfg)
    process_model(task, cfg, "cpu")  # the runtime baseline measured (and cached) here if it is not yet
    grid = Grid(stages=(cfg.zero.stage,), policies=(cfg.checkpointing.policy,), precisions=(cfg.precision.mode,))
    r = make_plan(task, cfg, ranks, None, grid, advise=False, measure=False).rows[0]
    return {"tensor_peak": r.peak, "process_peak": r.process_peak, "baseline": r.runtime_baseline,
            "overhead": r.allocator_overhead, "snapshots": r.rollback_snapshots, "counts": r.process_counts,
            "at": r.process_at,
            "transient": transient_bytes(predict(task, cfg, ranks).phases)}


def measured(sets: list[str], ranks: int, model: str, steps: int, run_dir: Path) -> dict[str, Any]:
    """``mct train`` of the configuration for ``steps`` steps: each worker's VmHWM and rank 0's tensor peak."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "mct", "train", "--run-dir", str(run_dir), "--no-progress", "--model", model,
           *(x for s in [*COMMON, f"train.steps={steps}", *sets] for x in ("--set", s))]
    if ranks > 1:
        cmd += ["--nproc", str(ranks)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()[-800:]}")
    meta = json.loads((run_dir / "metadata.json").read_text())
    tensor = next((int(float(x.split()[2]) * MiB) for x in out.stdout.splitlines() if x.startswith("tensor peak")
                   and x.split()[3] == "MiB"), None)
    return {"workers": meta["resident"]["workers"], "tracked_peak": tensor}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--only", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--json", default="process_peak")
    args = ap.parse_args(argv)
    print(f"cpu: {cpu_line(cpu_info())}")
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, sets, ranks, kind in CASES:
            if only and name not in only:
                continue
            hf = Path(tmp) / kind
            if kind != "gpt" and not hf.exists():
                save_hf(hf, kind)
            model = f"hf:{hf}" if kind != "gpt" else "gpt"
            p = predicted(sets, ranks, model, args.steps)
            m = measured(sets, ranks, model, args.steps, Path(tmp) / name.replace(" ", "_"))
            worst = max(m["workers"])
            err = worst - p["process_peak"]
            ok = abs(err) <= max(0.05 * worst, 24 * MiB)
            rows.append({"case": name, "tensor_mib": p["tensor_peak"] / MiB,
                         "tracked_mib": m["tracked_peak"] / MiB if m["tracked_peak"] else None,
                         "baseline_mib": p["baseline"] / MiB, "overhead_mib": p["overhead"] / MiB,
                         "snapshots_mib": p["snapshots"] / MiB,
                         "transient_mib": p["transient"] / MiB, "predicted_mib": p["process_peak"] / MiB,
                         "measured_mib": " / ".join(f"{w / MiB:.0f}" for w in m["workers"]),
                         "err_mib": err / MiB, "err_pct": 100 * err / worst, "in_target": "yes" if ok else "no",
                         "workers": m["workers"], "predicted": p})
            print(f"  {name}: predicted {p['process_peak'] / MiB:.1f} MiB (at the {p['at']}), measured "
                  f"{worst / MiB:.1f} MiB", flush=True)
    print(format_table(rows, [("case", "configuration"), ("tensor_mib", "tensor MiB"), ("baseline_mib", "base"),
                              ("transient_mib", "transient"), ("overhead_mib", "alloc"),
                              ("snapshots_mib", "snapshots"),
                              ("predicted_mib", "predicted"), ("measured_mib", "VmHWM by rank"),
                              ("err_mib", "err MiB"), ("err_pct", "err %"), ("in_target", "<=5%|24MiB")]))
    print("predicted: runtime baseline + tensor peak + allocator overhead + rollback snapshots (plan row's "
          "process_peak); measured: "
          "each worker's VmHWM (metadata.json resident); err = max worker - predicted")
    print(f"wrote {write_json(args.json, {'steps': args.steps, 'rows': rows})}")


if __name__ == "__main__":
    main()
