"""``mct train``: the new run's config or the resumed one's, the launch-time checks (one line each,
before any worker starts), ``auto`` solved once by the launcher, and the launch."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any
from pathlib import Path

from mct.config import EngineConfig
from mct.cli.common import _launch, _model_flags, _note, _strip_nproc, _under_torchrun, _warn


def _config_warnings(cfg: EngineConfig, nproc: int, resume: str | None = None) -> None:
    """Settings that are allowed but probably not what the user meant: one line each, once (by
    the launcher, not again by its workers). ``resume``: the run dir a resume continues."""
    cores = os.cpu_count() or 1
    if nproc > cores and not _under_torchrun():
        _warn(f"--nproc {nproc} starts more workers than this machine's {cores} CPU cores; they will "
              f"share cores and run slower than --nproc {cores} (fine for testing a world size)")
    from mct.persistence.resume import planned_for_budget
    auto = cfg.zero.stage == "auto" or cfg.checkpointing.policy == "auto" or planned_for_budget(resume)
    if cfg.memory.budget and not cfg.memory.enforce and not auto and not os.environ.get("MCT_LAUNCH_DIR"):
        _warn(f"memory.budget = {cfg.memory.budget!r} is recorded but not enforced; set memory.enforce=true "
              f"to stop at the allocation that crosses it, or zero.stage=auto to plan for it")

def _train_config(args: argparse.Namespace):
    """(config, run dir or None) of a new run, or of the run that ``--resume`` continues."""
    if not args.resume:
        from mct.run.recipe import train_config
        return train_config(args.config, _model_flags(args)), args.run_dir
    if args.model or args.init_from:
        raise ValueError("--resume continues the run's own model and weights; drop --model/--init-from")
    if args.config:
        raise ValueError("--resume uses the run's recorded config; drop --config (change allowed keys with --set)")
    if args.run_dir and Path(args.run_dir).resolve() != Path(args.resume).resolve():
        raise ValueError(f"--resume {args.resume!r} continues that run in place; drop --run-dir {args.run_dir!r}")
    from mct.persistence.resume import resume_config
    world = int(os.environ.get("WORLD_SIZE", args.nproc)) if _under_torchrun() else args.nproc
    return resume_config(args.resume, args.set, max(world, 1)), args.resume

def cmd_train(args: argparse.Namespace, argv: list[str]) -> int:
    for flag, value, low in (("--nproc", args.nproc, 1), ("--nnodes", args.nnodes, 1),
                             ("--max-restarts", args.max_restarts, 0)):
        if value is not None and value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if args.rdzv_endpoint is not None and not _under_torchrun():
        from mct.run.launch import check_rdzv_endpoint
        check_rdzv_endpoint(args.rdzv_endpoint)
    if args.run_dir is not None and not args.run_dir.strip():
        raise ValueError("--run-dir '' is empty; pass a directory, or leave --run-dir out for runs/<timestamp>")
    if args.resume is not None and not args.resume.strip():  # not a new run: '' would start one
        raise ValueError("--resume '' is empty; pass the run directory to continue (the --run-dir of an earlier run)")
    from mct.persistence.resume import recorded_local_ranks
    recorded = bool(args.nproc is None and args.resume and not _under_torchrun())
    if args.nproc is None:
        args.nproc = recorded_local_ranks(args.resume, args.nnodes) if recorded else 1
    if (args.nproc > 1 or args.nnodes > 1 or args.max_restarts) and not _under_torchrun():
        from mct.run.apart import apart
        # the checks import torch and the model library: in a forked child, so the launcher
        # that waits for the workers stays lean (mct.run.apart)
        checked = apart(lambda: _launch_checks(args, argv, recorded))
        if checked is None:
            return 0
        worker_argv, handoff = checked
        os.environ.update(handoff)  # auto's answer, for the workers (mct.run.resolve)
        return _launch(worker_argv, args.nproc, max_restarts=args.max_restarts, nnodes=args.nnodes,
                       rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id)
    checked = _train_checks(args, bool(recorded))
    if checked is None:
        return 0
    cfg, run_dir, task = checked
    from mct.run.worker import run_worker
    return run_worker(cfg, run_dir, resume=bool(args.resume), progress=not args.no_progress, task=task)


def _train_checks(args: argparse.Namespace, recorded: bool) -> tuple[Any, str | None, Any] | None:
    """(config, run dir or None, task) of a run once the checks before training passed; None
    when a --resume has no steps left (its weights written if missing). Raises ValueError."""
    from mct.persistence.resume import finished_step
    cfg, run_dir = _train_config(args)
    done = finished_step(args.resume, cfg.train.steps) if args.resume and not _under_torchrun() else None
    if done is not None:  # a resume with no steps left leaves the run as it is
        from mct.persistence.export import finish_weights
        from mct.persistence.init_from import rebuilt_frozen
        if finish_weights(Path(args.resume), done[1], rebuilt_frozen):
            _note(f"wrote {Path(args.resume) / 'model.safetensors'} from {done[1].name}")
        _note(f"--resume {args.resume!r}: the run already completed {done[0]} steps (train.steps = "
              f"{cfg.train.steps}); nothing to do (raise it with --set train.steps=N to train further)")
        return None
    if recorded and args.nproc > 1:  # resuming on one rank is what a user expects without --nproc: no news
        _note(f"--resume without --nproc: continuing on the run's recorded {args.nproc} local ranks "
              f"(pass --nproc M to reshard)")
    from mct.task import task_for
    task = task_for(cfg)  # a bad model source fails here, in one line, before any launch
    from mct.task.meta import check_host_memory
    check_host_memory(cfg, args.nproc if not _under_torchrun() else 1, task)
    from mct.planner.plan import planned_device
    from mct.planner.resident import check_process_floor
    check_process_floor(task, cfg, planned_device(cfg))  # a budget no process can meet: one line, now
    _config_warnings(cfg, args.nproc, args.resume)
    return cfg, run_dir, task


def _launch_checks(args: argparse.Namespace, argv: list[str], recorded: bool
                   ) -> tuple[list[str], dict[str, str]] | None:
    """The launcher's checks (``_train_checks``, ``auto`` solved for every worker, a run dir
    that holds a run): the workers' argv (``--run-dir`` added where defaulted) and the
    environment that hands them ``auto``'s answer; None when there is nothing to do. Raises
    ValueError (an impossible budget too) before any worker starts."""
    checked = _train_checks(args, recorded)
    if checked is None:
        return None
    cfg, run_dir, task = checked
    from mct.planner.plan import planned_device
    from mct.persistence.run_dir import check_new_run_dir
    from mct.run.resolve import solve_in_launcher
    # an impossible budget fails here, in one line, before any launch; the workers train this answer
    handoff = solve_in_launcher(cfg, args.nproc * args.nnodes, task, planned_device(cfg))
    extra: list[str] = []
    if not args.resume:
        run_dir = run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}"
        if args.nnodes == 1:  # several machines: global rank 0 checks, once, under torchrun
            check_new_run_dir(run_dir)  # refused here, before any worker starts
        extra = [] if args.run_dir else ["--run-dir", run_dir]
    # several machines: rank 0 solves for all (each launcher only checked)
    return [*_strip_nproc(argv), *extra], handoff if args.nnodes == 1 else {}
