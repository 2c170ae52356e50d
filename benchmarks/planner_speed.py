"""Planner speed: seconds per configuration against model size and depth, the full dry
run beside the depth extrapolation (mct.planner.depth) in one run, with their byte
difference; the error of the extrapolated prediction against measured peaks of small
real runs; and the two grids of the issue (the 6.4B GPT on 64 ranks, a 70B-class Llama
on 512 ranks, bf16 rows).

    PYTHONPATH=src:. python benchmarks/planner_speed.py [--depths 4 8 16] [--sizes 1024 2048 4096]
        [--grids] [--quick]

Prints the CPU (model, flags that matter to torch's CPU kernels, load) and tables;
writes benchmarks/results/planner_speed.json. Wall seconds depend on what else runs on
the machine; CPU seconds (this process) much less: both are reported.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "src")]

from benchmarks.common import cpu_info, cpu_line, format_table, write_json  # noqa: E402
from mct.config import EngineConfig  # noqa: E402
from mct.planner import Grid, make_plan, plan_workers, token_loss  # noqa: E402
from mct.planner.dry_run import DryRunHooks, dry_run_task  # noqa: E402
from mct.planner.grid import micro_batches, prepare_work  # noqa: E402
from mct.planner.plan import predict, with_choice  # noqa: E402
from mct.task import Task, builds_on_meta, gpt_task  # noqa: E402

def timed(fn) -> tuple:
    """(result, wall s, CPU s of this process)."""
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def gpt(n_layer: int, d_model: int) -> tuple[Task, EngineConfig]:
    cfg = EngineConfig.from_dict({"model": {"n_layer": n_layer, "d_model": d_model, "n_head": d_model // 128}})
    return gpt_task(cfg), cfg


def side_by_side(n_layer: int, d_model: int, world: int, choice: tuple) -> dict:
    """One configuration of a GPT: the full dry run and the extrapolation, timed."""
    work, base = gpt(n_layer, d_model)
    cfg = with_choice(base, *choice)
    batch = micro_batches(work.batch, cfg.data.grad_accum)
    full, fw, fc = timed(lambda: dry_run_task(work, cfg, world, batch=batch,
                                              hooks=DryRunHooks(meta_init=builds_on_meta(cfg))))
    planned, pw, pc = timed(lambda: prepare_work(work, cfg))
    ext, ew, ec = timed(lambda: predict(planned, cfg, world))
    return {"d_model": d_model, "n_layer": n_layer, "params_B": round(full.n_params / 1e9, 2), "world": world,
            "config": "/".join(map(str, choice)), "full_s": round(fw, 2), "full_cpu_s": round(fc, 2),
            "extrap_s": round(ew + pw, 2), "extrap_cpu_s": round(ec + pc, 2),
            "speedup": round((fw / (ew + pw)), 1), "steady_diff_B": ext.peak - full.peak,
            "first_diff_B": ext.first_step_peak - full.first_step_peak, "init_diff_B": ext.init_peak - full.init_peak}


def accuracy(quick: bool) -> list[dict]:
    """The extrapolated prediction of a 7-layer Hugging Face Llama against every live
    storage of a real run (tests/storage_count.py), one rank, a few configurations."""
    from tests.planner_models import hf_llama, random_batch
    from tests.storage_count import measure
    from tests.helpers import tiny_config
    work = Task(model_fn=hf_llama, loss_fn=token_loss, batch=random_batch(0, 0, 3))
    choices = [(0, "none", "fp32"), (1, "all", "bf16"), (2, "selective", "bf16")] + ([] if quick else
                                                                                    [(2, "none", "fp32")])
    rows = []
    for choice in choices:
        cfg = with_choice(tiny_config(), *choice)
        real = measure(hf_llama, token_loss, lambda s, r: random_batch(s, r, 3), cfg, 0)
        run = predict(prepare_work(work, cfg), cfg, 1)
        rows.append({"config": "/".join(map(str, choice)),
                     "steady_err_pct": round(100 * (run.peak - real["steps"][1]) / real["steps"][1], 3),
                     "first_err_pct": round(100 * (run.first_step_peak - real["steps"][0]) / real["steps"][0], 3),
                     "init_err_pct": round(100 * (run.init_peak - real["init"]) / real["init"], 3)})
    return rows


LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
             "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
             "num_hidden_layers": 80, "vocab_size": 128256, "max_position_embeddings": 131072,
             "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu"}
"""Llama 3 70B's config.json (shapes only): `mct plan --model hf:DIR` builds it on meta."""


def grids(sqrt: bool) -> list[dict]:
    """The issue's targets, as a user runs them: ``mct plan`` end to end (a new process:
    imports, the model built on meta, the grid on every core) for the default grid of the
    6.4B GPT on 64 ranks and the bf16 rows of a 70B-class Llama (``--model hf:DIR``) on 512
    ranks at micro-batch 1 and its 4096 window; beside it, the same grid in this process on
    one core (``workers=1``: its CPU seconds are the work itself), checked equal row by row.
    ``sqrt``: False leaves the sqrt rows out."""
    import json
    import subprocess
    import tempfile

    from mct.cli import CLI_RECIPE
    from mct.config import load_config
    from mct.task import task_for
    tmp = Path(tempfile.mkdtemp(prefix="mct-llama70b-"))
    (tmp / "config.json").write_text(json.dumps(LLAMA_70B))
    policies = ("none", "selective", "sqrt", "all") if sqrt else ("none", "selective", "all")
    cases = (("gpt 6.4B (32 x 4096)", ["model.n_layer=32", "model.d_model=4096", "model.n_head=32"], "gpt", 64,
              ("fp32", "bf16")),
             ("llama 70B (80 x 8192, GQA 64/8), hf:DIR", ["model.seq_len=4096", "data.micro_batch_size=1",
                                                         "precision.mode=bf16"], f"hf:{tmp}", 512, ("bf16",)))
    out = []
    for name, sets, source, world, precisions in cases:
        cfg = load_config(None, [*sets, f"model.source={source}"], defaults=CLI_RECIPE)
        work = task_for(cfg)
        plan, w, c = timed(lambda: make_plan(work, cfg, world, None, Grid(policies=policies, precisions=precisions),
                                             advise=False, workers=1))
        argv = [sys.executable, "-m", "mct", "plan", "--model", source, *(a for kv in sets for a in ("--set", kv)),
                "--world-size", str(world), "--policies", ",".join(policies), "--precisions", ",".join(precisions),
                "--json"]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
        t0, c0 = time.perf_counter(), os.times()
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, check=True)
        cli_wall = time.perf_counter() - t0
        c1 = os.times()
        cli_cpu = (c1.children_user + c1.children_system) - (c0.children_user + c0.children_system)
        cli_rows = json.loads(proc.stdout)["rows"]
        same = [(r["peak"], r["first_step_peak"], r["init_peak"]) for r in cli_rows] == \
            [(r["peak"], r["first_step_peak"], r["init_peak"]) for r in plan.rows]
        out.append({"grid": f"{name}, {world} ranks, stages 0-3 x {'/'.join(policies)} x {'/'.join(precisions)}",
                    "rows": len(plan.rows), "one_core_cpu_s": round(c, 1), "one_core_wall_s": round(w, 1),
                    "cli_wall_s": round(cli_wall, 1), "cli_cpu_s": round(cli_cpu, 1),
                    "cli_workers": plan_workers(None),
                    "cli_rows_equal": same,
                    "peaks_GiB": {f"{r['stage']}/{r['policy']}/{r['precision']}": round(r["peak"] / 2**30, 2)
                                  for r in plan.rows}})
        print(f"{out[-1]['grid']}: {out[-1]['rows']} rows; `mct plan` end to end {out[-1]['cli_wall_s']} s wall "
              f"({out[-1]['cli_cpu_s']} CPU s, {out[-1]['cli_workers']} workers); in one process on one core "
              f"{out[-1]['one_core_cpu_s']} CPU s; rows equal: {same}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--depths", type=int, nargs="+", default=[8, 16, 32, 64], help="GPT depths at d_model 4096")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048], help="d_model values at depth 16")
    ap.add_argument("--world", type=int, default=64)
    ap.add_argument("--grids", action="store_true", help="also time the two grids of the issue")
    ap.add_argument("--no-sweep", action="store_true", help="skip the size/depth sweep and the accuracy runs")
    ap.add_argument("--no-sqrt", action="store_true", help="grids without their sqrt rows")
    ap.add_argument("--quick", action="store_true", help="fewer accuracy configurations")
    args = ap.parse_args()
    info = cpu_info()
    print(f"CPU: {cpu_line(info)}; load {info['loadavg'][0]:.1f} (shared machine: wall seconds are noisy, "
          f"CPU seconds less so)")
    choice = (3, "all", "bf16")
    sweep, acc = [], []
    if not args.no_sweep:
        sweep = [side_by_side(n, 4096, args.world, choice) for n in args.depths]
        sweep += [side_by_side(16, d, args.world, choice) for d in args.sizes]
        cols = [(k, k) for k in ("d_model", "n_layer", "params_B", "world", "config", "full_s", "full_cpu_s",
                                 "extrap_s", "extrap_cpu_s", "speedup", "steady_diff_B", "first_diff_B", "init_diff_B")]
        print(format_table(sweep, cols), flush=True)
        acc = accuracy(args.quick)
        print(format_table(acc, [(k, k) for k in ("config", "steady_err_pct", "first_err_pct", "init_err_pct")]))
    grid = grids(not args.no_sqrt) if args.grids else []
    path = write_json("planner_speed_grids" if args.no_sweep else "planner_speed",
                      {"cpu": cpu_info() | {"loadavg_at_start": info["loadavg"]}, "sweep": sweep,
                       "accuracy": acc, "grids": grid})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
