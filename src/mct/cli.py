"""Command line: mct train | plan | verify | report (also ``python -m mct``).

User mistakes (config, data, launch) print one line ``mct: error: ...`` and exit 2.
``--nproc N`` re-launches this command under torchrun with N local workers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from mct.config import load_config


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config file")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config key (repeatable), e.g. --set zero.stage=2")
    p.add_argument("--nproc", type=int, default=1, help="local worker processes (launched with torchrun)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mct", description="memory-constrained trainer for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train the configured GPT on the configured corpus")
    _common(t)
    t.add_argument("--run-dir", help="where metrics.jsonl and metadata.json go (default runs/<timestamp>)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    v = sub.add_parser("verify", help="compare the configured engine with the fp32 reference")
    _common(v)
    v.add_argument("--steps", type=int, default=10, help="steps to compare (default 10)")
    pl = sub.add_parser("plan", help="predict per-rank peak memory of every configuration; pick one for a budget")
    pl.add_argument("--config", help="TOML config file")
    pl.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one config key (repeatable), e.g. --set model.n_layer=32")
    pl.add_argument("--model", help="'package.module:factory' returning an nn.Module (default: the reference "
                    "GPT); the module may define loss_fn, example_batch, optimizer, param_groups (docs/planner.md)")
    pl.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (default 1)")
    pl.add_argument("--budget", help="per-rank budget, e.g. 24GiB (default: memory.budget)")
    pl.add_argument("--json", action="store_true", help="print JSON instead of the table")
    pl.add_argument("--stages", default="0,1,2,3", help="ZeRO stages to plan, comma-separated (default 0,1,2,3)")
    pl.add_argument("--policies", default="none,selective,sqrt,all",
                    help="checkpointing policies to plan (default none,selective,sqrt,all)")
    pl.add_argument("--precisions", default="fp32,bf16", help="precision modes to plan (default fp32,bf16)")
    r = sub.add_parser("report", help="summarize a run directory")
    r.add_argument("run_dir")
    return parser


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def _launch(argv: list[str], nproc: int) -> int:
    """Run ``mct <argv>`` in ``nproc`` local workers through torch.distributed.run."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "mct", *argv]
    return subprocess.run(cmd, env=env).returncode


def _strip_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def cmd_train(args: argparse.Namespace, argv: list[str]) -> int:
    cfg = load_config(args.config, args.set)
    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    if args.nproc > 1 and not _under_torchrun():
        from mct.planner import resolve_auto
        from mct.trainer import planning_workload
        # an impossible budget fails here, in one line, before any launch
        resolve_auto(cfg, args.nproc, planning_workload(cfg))
        run_dir = args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}"
        return _launch([*_strip_nproc(argv), *([] if args.run_dir else ["--run-dir", run_dir])], args.nproc)
    from mct.dist import broadcast_from_main, init_distributed, teardown
    from mct.trainer import TrainingStopped, summary_table, train
    ctx = init_distributed(cfg.distributed.backend, cfg.distributed.timeout_s)
    try:
        run_dir = broadcast_from_main(args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
        summary = train(cfg, run_dir, ctx, progress=not args.no_progress)
        if ctx.is_main:
            print(summary_table(summary))
        return 0
    except TrainingStopped as e:
        print(f"mct: training stopped: {e}", file=sys.stderr)
        return 3
    finally:
        teardown()


def cmd_verify(args: argparse.Namespace, argv: list[str]) -> int:
    cfg = load_config(args.config, args.set)
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.nproc > 1 and not _under_torchrun():
        return _launch(_strip_nproc(argv), args.nproc)
    from mct.dist import broadcast_from_main, init_distributed, teardown
    from mct.verify import run_verify
    ctx = init_distributed(cfg.distributed.backend, cfg.distributed.timeout_s)
    try:
        report = run_verify(cfg, args.steps, ctx)
        if report is not None:
            print(report.table())
        passed = report.passed if report is not None else True
        return 0 if broadcast_from_main(passed) else 1
    finally:
        teardown()


def cmd_plan(args: argparse.Namespace, argv: list[str]) -> int:
    """``mct plan``: dry-run every configuration and print the table (or JSON). Returns
    0 when a configuration fits (or no budget was given); raises ValueError (exit 2,
    one line) when nothing fits."""
    from mct.config import parse_bytes
    from mct.planner import load_workload, make_plan
    cfg = load_config(args.config, args.set)
    if args.world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
    limit = parse_bytes(args.budget, "--budget") if args.budget else cfg.memory.budget_bytes
    if args.model:
        work = load_workload(args.model, cfg)
    else:
        from mct.trainer import planning_workload
        work = planning_workload(cfg)
    grid = _plan_grid(args)
    plan = make_plan(work, cfg, args.world_size, limit, **grid)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    if limit is not None and plan.recommended is None:
        raise ValueError(plan.advice)
    return 0


def _plan_grid(args: argparse.Namespace) -> dict[str, tuple]:
    """--stages/--policies/--precisions -> make_plan's grid. Raises ValueError naming a
    value that is not a stage, policy or precision mode."""
    allowed = {"stages": ("0", "1", "2", "3"), "policies": ("none", "selective", "sqrt", "all", "every_k"),
               "precisions": ("fp32", "bf16", "fp16")}
    grid: dict[str, tuple] = {}
    for key, ok in allowed.items():
        values = tuple(v.strip() for v in getattr(args, key).split(",") if v.strip())
        bad = [v for v in values if v not in ok]
        if bad or not values:
            raise ValueError(f"--{key} {getattr(args, key)!r}: {bad or 'nothing'} is not allowed; "
                             f"choose from {','.join(ok)}")
        grid[key] = tuple(int(v) for v in values) if key == "stages" else values
    return grid


def format_plan(plan) -> str:
    """The plan as a table: one row per configuration (steady-state peak, bytes per
    category at that peak, the phase it is in, first-step and init peaks, fits, cost),
    the recommended row marked '*', then the advice line."""
    from mct.memory.tracker import CATEGORIES, format_bytes
    cols = ["stage", "policy", "prec", "peak", *CATEGORIES, "at", "first", "init", "fits", "cost"]
    lines = [f"model: {plan.n_params:,} parameters; {plan.world_size} rank(s); budget per rank: "
             f"{format_bytes(plan.budget) if plan.budget else 'none'}",
             "  ".join(f"{c:>10}" for c in cols)]
    for r in plan.rows:
        mark = "*" if r is plan.recommended else ""
        vals = [f"{r['stage']}{mark}", r["policy"], r["precision"], format_bytes(r["peak"]),
                *(format_bytes(r["by_category"][c]) for c in CATEGORIES), r["phase"],
                format_bytes(r["first_step_peak"]), format_bytes(r["init_peak"]), "yes" if r["fits"] else "no",
                f"{r['cost']:.2f}"]
        lines.append("  ".join(f"{v:>10}" for v in vals))
    lines.append(plan.advice)
    return "\n".join(lines)


def cmd_report(args: argparse.Namespace, argv: list[str]) -> int:
    path = Path(args.run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{args.run_dir!r} has no metrics.jsonl: pass a run directory made by `mct train`")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path} is empty: the run logged no step")
    from mct.metrics import fmt_bytes
    print(f"{'step':>6} {'loss':>8} {'val_loss':>9} {'tokens/s':>10} {'peak':>11}")
    for r in rows:
        val = f"{r['val_loss']:.4f}" if "val_loss" in r else ""
        print(f"{r['step']:>6} {r['loss']:>8.4f} {val:>9} {r['tokens_per_s']:>10.0f} {fmt_bytes(r['peak_bytes']):>11}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    handler = {"train": cmd_train, "plan": cmd_plan, "verify": cmd_verify, "report": cmd_report}[args.command]
    try:
        return handler(args, argv)
    except ValueError as e:
        print(f"mct: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
