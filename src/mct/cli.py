"""Command line: mct train | plan | verify | report (also ``python -m mct``).

User mistakes (config, data, launch) print one line ``mct: error: ...`` and exit 2.
``--nproc N`` re-launches this command under torchrun with N local workers.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from mct import __version__
from mct.config import CLI_RECIPE, EngineConfig, load_config


class _Parser(argparse.ArgumentParser):
    """argparse with mct's error format: one line ``mct: error: ...``, exit 2 (argparse
    would print the usage block first)."""

    def error(self, message: str):  # type: ignore[override]
        print(f"mct: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)


class _DefaultsFormatter(argparse.HelpFormatter):
    """Appends each option's default to its help, unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        d = action.default
        shown = "off" if d is False else "none" if d in (None, []) else "%(default)s"
        return f"{text} (default: {shown})"


def _common(p: argparse.ArgumentParser, nproc: bool = True) -> None:
    p.add_argument("--config", help="TOML config file; keys not in it keep the recipe's defaults")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config key (repeatable), e.g. --set zero.stage=2")
    if nproc:
        p.add_argument("--nproc", type=int, default=1, help="local worker processes (launched with torchrun)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mct", description="memory-constrained trainer for PyTorch",
                     formatter_class=_DefaultsFormatter)
    parser.add_argument("--version", action="version", version=f"mct {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    kw: dict = {"formatter_class": _DefaultsFormatter,
                "epilog": "Config keys default to the field defaults in mct/config.py, except "
                          "train.grad_clip = 1.0 (the mct recipe; the Python API does not clip)."}
    t = sub.add_parser("train", help="train the configured GPT on the configured corpus", **kw)
    _common(t)
    t.add_argument("--run-dir", help="where metrics.jsonl and metadata.json go (default: runs/<timestamp>)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    v = sub.add_parser("verify", help="compare the configured engine with the fp32 reference", **kw)
    _common(v)
    v.add_argument("--steps", type=int, default=10, help="steps to compare")
    pl = sub.add_parser("plan", help="predict per-rank peak memory of every configuration; pick one for a budget",
                        **kw)
    _common(pl, nproc=False)
    pl.add_argument("--model", help="'package.module:factory' returning an nn.Module (default: the reference GPT)")
    pl.add_argument("--world-size", type=int, default=1, help="data-parallel ranks")
    pl.add_argument("--budget", help="per-rank budget, e.g. 24GiB (default: memory.budget)")
    pl.add_argument("--json", action="store_true", help="print JSON instead of the table")
    pl.add_argument("--plot", metavar="FILE.png", help="also draw the predicted peaks as stacked bars")
    r = sub.add_parser("report", help="summarize a run directory", **kw)
    r.add_argument("run_dir", help="a directory made by `mct train`")
    r.add_argument("--plot", metavar="FILE.png", help="also draw loss, throughput, time and memory")
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


def _warn(msg: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # rank 0 prints; workers stay quiet
        print(f"mct: warning: {msg}", file=sys.stderr)


def _config_warnings(cfg: EngineConfig, nproc: int) -> None:
    """Settings that are allowed but probably not what the user meant: one line each."""
    cores = os.cpu_count() or 1
    if nproc > cores and not _under_torchrun():
        _warn(f"--nproc {nproc} starts more workers than this machine's {cores} CPU cores; they will "
              f"share cores and run slower than --nproc {cores} (fine for testing a world size)")
    auto = cfg.zero.stage == "auto" or cfg.checkpointing.policy == "auto"
    if cfg.memory.budget and not cfg.memory.enforce and not auto:
        _warn(f"memory.budget = {cfg.memory.budget!r} is recorded but not enforced; set memory.enforce=true "
              f"to stop at the allocation that crosses it, or zero.stage=auto to plan for it")


def _check_host_memory(cfg: EngineConfig, nproc: int) -> None:
    """On CPU, refuse a model whose parameters alone (nproc copies, at 2 or 4 bytes each:
    a lower bound on what training needs) exceed the machine's physical memory, before
    anything is allocated: allocating it would end in swapping or the OOM killer, not an
    error. Raises ValueError naming the size and the fix."""
    import torch
    if torch.cuda.is_available() or not hasattr(os, "sysconf"):
        return
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return
    from mct.models.gpt import GPT
    with torch.device("meta"):
        n = sum(p.numel() for p in GPT(cfg.model).parameters())
    need = n * (4 if cfg.precision.mode == "fp32" else 2) * nproc
    if need > ram:
        raise ValueError(f"the model has {n:,} parameters: {need / 2**30:.1f} GiB for the parameters alone on "
                         f"{nproc} worker(s), more than this machine's {ram / 2**30:.1f} GiB of memory; shrink "
                         f"model.n_layer/model.d_model, or run `mct plan` for the memory a configuration needs")


def cmd_train(args: argparse.Namespace, argv: list[str]) -> int:
    cfg = load_config(args.config, args.set, defaults=CLI_RECIPE)
    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    _check_host_memory(cfg, args.nproc if not _under_torchrun() else 1)
    _config_warnings(cfg, args.nproc)
    if args.nproc > 1 and not _under_torchrun():
        from mct.memory.plan import resolve_auto
        resolve_auto(cfg, args.nproc)  # an impossible budget fails here, in one line, before any launch
        run_dir = args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}"
        return _launch([*_strip_nproc(argv), *([] if args.run_dir else ["--run-dir", run_dir])], args.nproc)
    from mct.dist import broadcast_from_main, init_distributed, teardown
    from mct.memory.tracker import MemoryBudgetExceeded
    from mct.trainer import TrainingStopped, summary_table, train
    ctx = init_distributed(cfg.distributed.backend, cfg.distributed.timeout_s)
    try:
        run_dir = broadcast_from_main(args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
        existed = Path(run_dir).exists()
        try:
            summary = train(cfg, run_dir, ctx, progress=not args.no_progress)
        except (MemoryBudgetExceeded, MemoryError, RuntimeError) as e:
            if not _is_out_of_memory(e):
                raise
            if ctx.is_main:
                _discard_empty_run(Path(run_dir), existed)
                print(f"mct: error: {_memory_message(e)}", file=sys.stderr)
            return 2
        if ctx.is_main:
            print(summary_table(summary))
        return 0
    except TrainingStopped as e:
        print(f"mct: training stopped: {e}", file=sys.stderr)
        return 3
    finally:
        teardown()


def _is_out_of_memory(e: BaseException) -> bool:
    """An enforced budget crossed, or the host/device refusing an allocation."""
    if type(e).__name__ == "MemoryBudgetExceeded" or isinstance(e, MemoryError):
        return True
    return isinstance(e, RuntimeError) and ("out of memory" in str(e) or "can't allocate memory" in str(e))


def _memory_message(e: BaseException) -> str:
    """One line for a budget crossed (its own message) or the device/host running out."""
    if type(e).__name__ == "MemoryBudgetExceeded":
        return " ".join(str(e).split())
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return (f"out of memory ({first}); run `mct plan --budget <what this device has>` for a configuration "
            f"predicted to fit, or lower data.micro_batch_size or the model size")


def _discard_empty_run(run_dir: Path, existed: bool) -> None:
    """A run that failed before logging a step leaves nothing behind: remove the
    directory it created (only when this run created it and no metrics row exists)."""
    metrics = run_dir / "metrics.jsonl"
    if existed or (metrics.exists() and metrics.stat().st_size > 0):
        return
    import shutil
    shutil.rmtree(run_dir, ignore_errors=True)


def cmd_verify(args: argparse.Namespace, argv: list[str]) -> int:
    cfg = load_config(args.config, args.set, defaults=CLI_RECIPE)
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
    from mct.memory.plan import cmd_plan as plan
    from mct.plots import check_plot_path
    cfg = load_config(args.config, args.set, defaults=CLI_RECIPE)
    if args.plot:
        check_plot_path(args.plot)  # before minutes of planning
    return plan(cfg, world=args.world_size, budget=args.budget, factory=args.model, as_json=args.json,
                plot=args.plot)


def cmd_report(args: argparse.Namespace, argv: list[str]) -> int:
    from mct.report import load_run, plot_title, report_table
    if args.plot:
        from mct.plots import check_plot_path
        check_plot_path(args.plot)
    run = load_run(args.run_dir)
    for w in run.warnings:
        print(f"mct: warning: {w}", file=sys.stderr)
    print(report_table(run))
    if args.plot:
        from mct.plots import plot_run
        plot_run(run.rows, run.events, run.meta, args.plot, budget=run.budget, title=plot_title(run))
        print(f"wrote {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    handler = {"train": cmd_train, "plan": cmd_plan, "verify": cmd_verify, "report": cmd_report}[args.command]
    try:
        return handler(args, argv)
    except ValueError as e:
        message = " ".join(str(e).split())  # one line, whatever the message held
        print(f"mct: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
