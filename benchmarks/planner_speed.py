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

from benchmarks.common import format_table, write_json  # noqa: E402
from mct.config import EngineConfig  # noqa: E402
from mct.planner import make_plan, token_loss  # noqa: E402
from mct.planner.dry_run import dry_run  # noqa: E402
from mct.planner.plan import predict, with_choice  # noqa: E402
from mct.planner.workload import micro_batches, prepare  # noqa: E402
from mct.task import Task, builds_on_meta, gpt_task  # noqa: E402

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma")


def cpu() -> dict:
    """Model name, the flags torch's CPU kernels care about, cores and load."""
    info = {"model": "?", "flags": [], "cores": os.cpu_count(), "loadavg": os.getloadavg()}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            info["model"] = value.strip()
        if key.strip() == "flags":
            info["flags"] = [f for f in FLAGS if f in value.split()]
            break
    return info


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
    full, fw, fc = timed(lambda: dry_run(work.model_fn, work.loss_fn, batch, cfg, world, optimizer=work.optimizer,
                                         param_groups=work.param_groups, meta_init=builds_on_meta(cfg)))
    planned, pw, pc = timed(lambda: prepare(work, cfg))
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
        run = predict(prepare(work, cfg), cfg, 1)
        rows.append({"config": "/".join(map(str, choice)),
                     "steady_err_pct": round(100 * (run.peak - real["steps"][1]) / real["steps"][1], 3),
                     "first_err_pct": round(100 * (run.first_step_peak - real["steps"][0]) / real["steps"][0], 3),
                     "init_err_pct": round(100 * (run.init_peak - real["init"]) / real["init"], 3)})
    return rows


def grids(sqrt: bool) -> list[dict]:
    """The issue's targets: the default grid of the 6.4B GPT on 64 ranks, and the bf16
    rows of a 70B-class Llama on 512 ranks (micro-batch 1 at its 4096 window); the sqrt
    rows timed apart (``sqrt``: at all), as their copies hold ~5 sqrt(n) blocks."""
    from benchmarks.planner_models import example_batch, llama_70b
    gpt_work, gpt_cfg = gpt(32, 4096)
    cfg = EngineConfig.from_dict({"data": {"micro_batch_size": 1}, "precision": {"mode": "bf16"}})
    llama = Task(model_fn=llama_70b, loss_fn=token_loss, batch=example_batch(cfg), label="llama_70b")
    out = []
    for name, work, base, world, precisions in (("gpt 6.4B (32 x 4096)", gpt_work, gpt_cfg, 64, ("fp32", "bf16")),
                                                ("llama 70B (80 x 8192, GQA 64/8)", llama, cfg, 512, ("bf16",))):
        for policies in (("none", "selective", "all"), ("sqrt",))[:2 if sqrt else 1]:
            plan, w, c = timed(lambda: make_plan(work, base, world, None, policies=policies, precisions=precisions,
                                                 advise=False))
            out.append({"grid": f"{name}, {world} ranks, stages 0-3 x {'/'.join(policies)} x {'/'.join(precisions)}",
                        "rows": len(plan.rows), "wall_s": round(w, 1), "cpu_s": round(c, 1),
                        "peaks_GiB": {f"{r['stage']}/{r['policy']}/{r['precision']}": round(r["peak"] / 2**30, 2)
                                      for r in plan.rows}})
            print(f"{out[-1]['grid']}: {out[-1]['rows']} rows in {out[-1]['wall_s']} s wall, {out[-1]['cpu_s']} s CPU",
                  flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--depths", type=int, nargs="+", default=[8, 16, 32], help="GPT depths at d_model 4096")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048], help="d_model values at depth 16")
    ap.add_argument("--world", type=int, default=64)
    ap.add_argument("--grids", action="store_true", help="also time the two grids of the issue")
    ap.add_argument("--no-sweep", action="store_true", help="skip the size/depth sweep and the accuracy runs")
    ap.add_argument("--no-sqrt", action="store_true", help="grids without their sqrt rows")
    ap.add_argument("--quick", action="store_true", help="fewer accuracy configurations")
    args = ap.parse_args()
    info = cpu()
    print(f"CPU: {info['model']}; flags {' '.join(info['flags']) or '-'}; {info['cores']} cores; "
          f"load {info['loadavg'][0]:.1f} (shared machine: wall seconds are noisy, CPU seconds less so)")
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
    path = write_json("planner_speed_grids" if args.no_sweep else "planner_speed", {"cpu": cpu() | {"loadavg_at_start": info["loadavg"]}, "sweep": sweep,
                                        "accuracy": acc, "grids": grid})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
