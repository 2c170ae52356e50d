"""``mct plan`` (the grid, or ``--solve``) and ``mct calibrate``: flags to a ``Grid`` and a budget,
the plan printed or written as JSON."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mct.config import CLI_RECIPE, EngineConfig, PrecisionMode, load_config
from mct.cli.common import _model_flags, _warn


def _plan_config(args: argparse.Namespace) -> EngineConfig:
    """``mct plan``'s config: ``--budget B`` is ``memory.budget = B`` (converted where the
    config converts it; an error names --budget, as the user wrote it)."""
    budget = [f"memory.budget={args.budget}"] if args.budget else []
    try:
        return load_config(args.config, [*_model_flags(args), *budget], defaults=CLI_RECIPE)
    except ValueError as e:
        if budget and str(e).startswith("memory.budget "):
            raise ValueError("--budget" + str(e)[len("memory.budget"):]) from None
        raise

def cmd_plan(args: argparse.Namespace, argv: list[str]) -> int:
    """``mct plan``: dry-run every configuration and print the table (or JSON). Returns
    0 when a configuration fits (or no budget was given); raises ValueError (exit 2,
    one line) when nothing fits. ``--plot FILE.png`` also draws it (``mct.reporting.plots``)."""
    import json

    from mct.planner import make_plan, plan_workers
    from mct.planner.plan import target_device
    from mct.planner.pool import WorkerDied
    from mct.persistence.run_dir import check_outside_runs
    from mct.reporting.plots import check_plot_path
    cfg = _plan_config(args)
    if cfg.train.init_from:  # the weights a fine-tune starts from: refused here as `mct train` would
        from mct.persistence.init_from import open_source
        open_source(cfg.train.init_from)
    if args.plot:
        check_plot_path(args.plot, args.force, check_outside_runs)  # before minutes of planning
    _check_world_size(args.world_size)
    device = target_device(cfg, args.device)
    limit = cfg.memory.budget
    from mct.task import task_for
    work = task_for(cfg)
    grid = _plan_grid(args, cfg)
    if args.solve or args.allow is not None:
        return _cmd_solve(args, cfg, limit, work, grid, device)
    try:
        # a CUDA plan's dry runs take native matmuls and stand for NCCL ranks (make_plan's for_device)
        plan = make_plan(work, cfg, args.world_size, limit, grid, extrapolate=not args.full_depth,
                         workers=plan_workers(args.workers), device=device)
    except WorkerDied as e:
        print(f"mct: error: {e}", file=sys.stderr)
        return 1
    from mct.planner.tables import format_plan, format_plan_brief
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan) if args.wide
          else format_plan_brief(plan, cfg))
    if args.plot:
        from mct.reporting.plots import plot_plan
        plot_plan(plan.to_dict(), args.plot)
    if limit is not None and plan.recommended is None:
        raise ValueError(plan.advice)
    return 0

def _cmd_solve(args: argparse.Namespace, cfg: EngineConfig, limit: int | None, work: Any, grid: Any,
               device: str) -> int:
    """``mct plan --solve``: the solver's frontier, pick and why for a run on ``device`` (or JSON;
    ``--plot``: the frontier). Raises ValueError (exit 2, one line) without a budget or when nothing fits."""
    import json

    from mct.planner import plan_workers
    from mct.planner.auto import check_allow, format_solution, nothing_fits, solve_auto, space_for
    if not args.solve:
        raise ValueError(f"--allow {args.allow!r} is for the solver: add --solve")
    if limit is None:
        raise ValueError("--solve needs a per-rank budget: pass --budget (e.g. --budget 24GiB) or set memory.budget")
    allow = check_allow(args.allow, "--allow") if args.allow is not None else tuple(cfg.memory.solver_allow)
    if len(grid.precisions) == 1:  # --precisions bf16: that one
        from mct.config import with_values
        cfg = with_values(cfg, {"precision.mode": grid.precisions[0]})
    space = space_for(work, cfg, allow, device, stages=tuple(grid.stages), search_policy=True,
                      world=args.world_size)
    from mct.planner.pool import WorkerDied
    try:
        sol = solve_auto(work, cfg, args.world_size, limit, allow, device, workers=plan_workers(args.workers),
                         space=space)
    except WorkerDied as e:
        print(f"mct: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps({**sol.to_dict(), "allow": list(allow)}, indent=2) if args.json else format_solution(sol))
    if sol.pick is None:
        raise ValueError(nothing_fits(sol, work, cfg))
    if args.plot:
        from mct.reporting.plots import plot_frontier
        plot_frontier(sol.to_dict(), args.plot)
    return 0

def _plan_grid(args: argparse.Namespace, cfg: EngineConfig) -> Any:
    """--stages/--policies/--precisions/--offloads -> make_plan's ``Grid``. Raises
    ValueError naming a value that is not a stage, policy, precision mode or offload.
    --policies defaults to the uniform ones, and 'per_block' when ``cfg`` sets checkpointing.per_block."""
    from mct.planner.grid import Grid
    allowed = {"stages": ("0", "1", "2", "3"),
               "policies": ("none", "selective", "sqrt", "all", "every_k", "per_block"),
               "precisions": ("fp32", "bf16", "fp16")}
    if args.policies is None:
        args.policies = "none,selective,sqrt,all" + (",per_block" if cfg.checkpointing.per_block else "")
    grid: dict[str, tuple] = {}
    for key, ok in allowed.items():
        values = tuple(v.strip() for v in getattr(args, key).split(",") if v.strip())
        bad = [v for v in values if v not in ok]
        if bad or not values:
            raise ValueError(f"--{key} {getattr(args, key)!r}: {bad or 'nothing'} is not allowed; "
                             f"choose from {','.join(ok)}")
        grid[key] = tuple(int(v) for v in values) if key == "stages" else \
            tuple(PrecisionMode(v) for v in values) if key == "precisions" else values
    if args.offloads is not None:
        from mct.planner.choice import OffloadChoice
        labels = tuple(v.strip() for v in args.offloads.split(",") if v.strip())
        if not labels:
            raise ValueError(f"--offloads {args.offloads!r}: nothing given; choose from none, optimizer=cpu|disk, "
                             f"optimizer+params=cpu|disk")
        try:
            grid["offloads"] = tuple(OffloadChoice.parse(label) for label in labels)
        except ValueError as e:
            raise ValueError(f"--offloads {args.offloads!r}: {e}") from None
    if args.act_offloads is not None:
        tiers = tuple(v.strip() for v in args.act_offloads.split(",") if v.strip())
        bad = [t for t in tiers if t not in ("none", "cpu", "disk")]
        if bad or not tiers:
            raise ValueError(f"--act-offloads {args.act_offloads!r}: {bad or 'nothing'} is not allowed; "
                             f"choose from none,cpu,disk")
        grid["act_offloads"] = tiers
    if args.loss_chunks is not None:
        grid["loss_chunks"] = _token_counts("--loss-chunks", args.loss_chunks)
    if args.mlp_tiles is not None:
        grid["mlp_tiles"] = _token_counts("--mlp-tiles", args.mlp_tiles)
    return Grid(**grid)

def _token_counts(flag: str, text: str) -> tuple[int, ...]:
    """Comma-separated token counts >= 0 (0 = off). Raises ValueError naming ``flag``."""
    try:
        counts = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        counts = ()
    if not counts or min(counts) < 0:
        raise ValueError(f"{flag} {text!r}: give token counts >= 0, comma-separated (0 = off), e.g. 0,1024")
    return counts

def cmd_calibrate(args: argparse.Namespace, argv: list[str]) -> int:
    import json

    import dataclasses

    from mct.machine import calibrate, calibration_table, default_device
    device = default_device() if args.device == "auto" else args.device
    if args.world_size is not None:
        _check_world_size(args.world_size)
    cal = calibrate(device, force=args.force)
    if cal.warning:
        _warn(cal.warning)
    if args.world_size is not None:
        from mct.planner.overhead import machine_rates
        warnings: list[str] = []
        for world in sorted({1, args.world_size}):  # one process at every core, and the world's ranks
            warnings += machine_rates(world, device)[1]
        for w in warnings:
            _warn(w)
        cal = dataclasses.replace(calibrate(device), source=cal.source)
        _warn_unmeasured_world(cal.profile, args.world_size)
    from mct.memory.baseline import baseline_line, runtime_baseline
    try:
        baseline, baseline_source = runtime_baseline(force=args.force)  # what a process holds before its tensors
    except RuntimeError as e:  # no /proc, or the probe failed: the profile still stands
        _warn(f"runtime baseline not measured: {e}")
        baseline, baseline_source = None, "not measured"
    if args.json:
        print(json.dumps({"key": cal.profile.key, "source": cal.source, "path": str(cal.path),
                          "profile": cal.profile.to_dict(),
                          "runtime_baseline": {"bytes": baseline, "source": baseline_source}}, indent=2))
    else:
        print(calibration_table(cal))
        if baseline is not None:
            print(baseline_line(baseline, baseline_source))
    return 0

MAX_WORLD_SIZE = 2**24
"""The largest --world-size `mct plan` / `mct calibrate` model: beyond any machine count, and
past it the planner's index arithmetic overflows."""

def _check_world_size(world: int) -> None:
    """ValueError (one line) unless 1 <= ``world`` <= MAX_WORLD_SIZE."""
    if not 1 <= world <= MAX_WORLD_SIZE:
        raise ValueError(f"--world-size must be >= 1 and <= {MAX_WORLD_SIZE} (2**24), got {world}")

def _warn_unmeasured_world(profile, world: int) -> None:
    """One warning line when ``mct calibrate --world-size N`` could not measure N ranks here:
    what was measured (collectives at fewer ranks) and what the N-rank figures are."""
    from mct.planner.steptime import MAX_MEASURED_WORLD, measured_world
    measured = measured_world(profile, world)
    if world > 1 and measured < world:
        limit = (f"this machine's {measured} {'devices' if profile.device == 'cuda' else 'usable cores'}"
                 if measured < MAX_MEASURED_WORLD else f"at most {MAX_MEASURED_WORLD} ranks are measured")
        overhead = f", and the per-op overhead is {measured} ranks' stepping at once" if profile.device == "cpu" else ""
        _warn(f"--world-size {world}: collectives were measured at {measured} ranks ({limit}), not {world}; "
              f"the {world}-rank communication is scaled from them as a ring{overhead}")
