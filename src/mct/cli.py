"""Command line: mct train | plan | verify | report | export | sample | prepare | calibrate (also
``python -m mct``).

User mistakes (config, data, launch) print one line ``mct: error: ...`` and exit 2.
``--nproc N`` re-launches this command in N local workers, with torchrun's environment
(mct.run.launch; several machines: under torchrun).

Every command imports what it runs inside its own function: torch and the engine take
seconds to import, and ``mct --help``, a config error or the launcher must answer at once.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

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


def _common(p: argparse.ArgumentParser, nproc: bool = True, init_from: bool = True) -> None:
    p.add_argument("--config", help="TOML config file; keys not in it keep the recipe's defaults")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config key (repeatable), e.g. --set zero.stage=2")
    p.add_argument("--model", metavar="SPEC", help="what is trained (= --set model.source=SPEC): 'gpt' (the "
                   "built-in GPT of [model]), 'hf:DIR' (a local Hugging Face model directory; nothing is "
                   "downloaded, no code from it runs) or 'package.module:factory' returning an nn.Module (it may "
                   "define loss_fn, example_batch, optimizer, param_groups; docs/planner.md) (default: gpt)")
    if init_from:
        p.add_argument("--init-from", metavar="PATH", help="start from these weights (= --set train.init_from=PATH): "
                       "a Hugging Face model directory, a .safetensors file, or an mct run dir or checkpoint")
    if nproc:
        p.add_argument("--nproc", type=int, default=1, help="local worker processes (torchrun's environment)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mct", description="memory-constrained trainer for PyTorch",
                     formatter_class=_DefaultsFormatter)
    parser.add_argument("--version", action="version", version=f"mct {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    kw: dict = {"formatter_class": _DefaultsFormatter,
                "epilog": "Config keys default to the field defaults in mct/config.py, except "
                          "train.grad_clip = 1.0 (the mct recipe; the Python API does not clip)."}
    t = sub.add_parser("train", help="train the configured GPT on the configured corpus", **kw)
    _common(t, nproc=False)
    t.add_argument("--nproc", type=int, default=None,
                   help="local worker processes, with torchrun's environment (default: 1); with --resume, the "
                        "run's recorded number of local ranks unless given (another number reshards)")
    t.add_argument("--run-dir", help="a new directory for the run, one that holds no run yet "
                                     "(default: runs/<timestamp>)")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest complete "
                                                       "checkpoint, with its recorded config (--set may change "
                                                       "steps, checkpointing, zero, logging)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--max-restarts", type=int, default=0,
                   help="restart the worker group up to R times when a worker dies (torchrun --max-restarts)")
    t.add_argument("--nnodes", type=int, default=1, help="machines (one launcher each; c10d rendezvous)")
    t.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous, the same on every machine (--nnodes > 1)")
    t.add_argument("--rdzv-id", default="mct", help="job id shared by the machines of one run (--nnodes > 1)")
    v = sub.add_parser("verify", help="compare the configured engine with the fp32 reference", **kw)
    _common(v)
    v.add_argument("--steps", type=int, default=10, help="steps to compare")
    pl = sub.add_parser("plan", help="predict per-rank peak memory of every configuration; pick one for a budget",
                        **kw)
    _common(pl, nproc=False, init_from=False)
    pl.add_argument("--world-size", type=int, default=1, help="data-parallel ranks")
    pl.add_argument("--budget", help="per-rank budget, e.g. 24GiB (default: memory.budget)")
    pl.add_argument("--json", action="store_true", help="print JSON instead of the table")
    pl.add_argument("--plot", metavar="FILE.png", help="also draw the predicted peaks as stacked bars (a new file, "
                    "or a regular file with --force; never a link, FIFO or a run's own file)")
    pl.add_argument("--force", action="store_true", help="replace --plot if it is an existing regular file")
    pl.add_argument("--stages", default="0,1,2,3", help="ZeRO stages to plan, comma-separated")
    pl.add_argument("--policies", default=None, help="checkpointing policies to plan (default none,selective,sqrt,all, "
                    "and per_block when the config sets checkpointing.per_block)")
    pl.add_argument("--precisions", default="fp32,bf16", help="precision modes to plan")
    pl.add_argument("--offloads", default=None, help="offload choices to plan, comma-separated: none, optimizer=cpu|disk, "
                    "optimizer+params=cpu|disk (default: the config's own offload setting)")
    pl.add_argument("--act-offloads", default=None, help="activation offload tiers to plan (checkpointing.offload), "
                    "comma-separated: none, cpu, disk (default: the config's own)")
    pl.add_argument("--loss-chunks", default=None, help="train.loss_chunk_tokens values to plan, comma-separated "
                    "tokens, 0 = off, e.g. 0,1024 (default: the config's own)")
    pl.add_argument("--mlp-tiles", default=None, help="checkpointing.mlp_tile_tokens values to plan, comma-separated "
                    "tokens, 0 = off, e.g. 0,1024 (default: the config's own)")
    pl.add_argument("--full-depth", action="store_true", help="dry-run every configuration at the model's full "
                    "depth instead of extending two shallow copies of its repeated blocks (slower; same numbers "
                    "where the blocks repeat, docs/planner.md)")
    pl.add_argument("--solve", action="store_true", help="search for the fastest configuration that fits the "
                    "budget instead of the grid: the stage, per-block recompute, activation offload and the levers "
                    "--allow names; prints the frontier, the pick and why (docs/planner.md, 'The solver')")
    pl.add_argument("--allow", default=None, help="with --solve: levers that change numerics or move the state it "
                    "may choose, comma-separated: micro_batch, loss_chunk, offload (default: memory.solver_allow)")
    pl.add_argument("--workers", type=int, default=None, help="processes that dry-run the grid's configurations "
                    "(default: one per usable CPU core, at most 8; used only when the grid takes seconds; 1: "
                    "all in this process)")
    r = sub.add_parser("report", help="summarize a run directory", **kw)
    r.add_argument("run_dir", help="a directory made by `mct train`")
    r.add_argument("--plot", metavar="FILE.png", help="also draw loss, throughput, time and memory (a new file, "
                   "or a regular file with --force; never a link, FIFO or a run's own file)")
    r.add_argument("--force", action="store_true", help="replace --plot if it is an existing regular file")
    e = sub.add_parser("export", help="consolidated fp32 weights (safetensors) from a run's newest checkpoint",
                       **kw)
    e.add_argument("source", metavar="RUN_DIR|CHECKPOINT_DIR", help="a run directory or one of its checkpoints")
    e.add_argument("--out", required=True, help="the .safetensors file to write (a new file, or a regular file "
                                                "with --force; never a run's own files); --format hf: a new or "
                                                "empty directory")
    e.add_argument("--force", action="store_true", help="replace --out if it is an existing regular file (--format "
                   "hf: an earlier export, a directory holding only an export's files)")
    e.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                   help="safetensors: one fp32 file, names as named_parameters; hf: a Hugging Face model directory "
                        "(config.json, tokenizer files, sharded safetensors) of a run of an hf: model")
    e.add_argument("--dtype", default="fp32", help="--format hf: the weights' dtype, fp32 or bf16")
    e.add_argument("--max-shard-size", default="2GB", help="--format hf: the largest safetensors file; more "
                   "weights are split into shards listed by model.safetensors.index.json")
    e.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)  # refused in one clear line
    sm = sub.add_parser("sample", help="text from a run's final weights, with its tokenizer", **kw)
    sm.add_argument("run_dir", help="a directory made by `mct train`")
    sm.add_argument("--prompt", default="", help="text the sample continues (default: a newline)")
    sm.add_argument("--tokens", type=int, default=200, help="tokens to generate")
    sm.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy")
    sm.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    c = sub.add_parser("calibrate", help="measure this machine's matmul FLOP/s per dtype and copy bandwidth "
                       "(the peak MFU divides by), cached per machine", formatter_class=_DefaultsFormatter)
    c.add_argument("--force", action="store_true", help="measure again even when the cache holds this machine")
    c.add_argument("--json", action="store_true", help="print JSON instead of the table")
    c.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="what to measure; auto: the CUDA device where there is one, else the CPU")
    c.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="also measure what the time model needs for N ranks on this machine (collectives at N, "
                        "the per-op and per-byte overhead and the wait of N ranks stepping at once, and one process's "
                        "at every core); `mct plan` measures them on first use")
    pr = sub.add_parser("prepare", help="tokenize text and JSON Lines into a dataset that data.path trains on "
                        "(docs/data.md)", formatter_class=_DefaultsFormatter)
    pr.add_argument("inputs", nargs="+", metavar="INPUT",
                    help="text files (one document each), .jsonl / .jsonl.gz files (one document per line), "
                         "or directories of them")
    pr.add_argument("--out", required=True, metavar="DIR", help="the dataset directory to create: a new name or an "
                    "empty directory (an earlier dataset with --force)")
    pr.add_argument("--force", action="store_true", help="replace --out if it is an earlier dataset (a directory "
                    "holding only a dataset's files; nothing else is ever deleted)")
    pr.add_argument("--tokenizer", default="bytes", metavar="SPEC",
                    help="'bytes' (UTF-8 bytes + EOS, vocab 257), a tokenizer.json file or a directory holding one, "
                         "or train:VOCAB (a byte-level BPE of VOCAB ids trained here on the inputs)")
    pr.add_argument("--text-field", default="text", metavar="NAME", help="the JSON field holding a record's text")
    pr.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), metavar="N",
                    help="encoding processes (default: the CPU cores, at most 8)")
    pr.add_argument("--split", default="file", choices=("file", "paragraph", "line"),
                    help="documents of a plain text file: the whole file, each paragraph (blank-line separated) "
                         "or each line")
    pr.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def _launch(argv: list[str], nproc: int, *, max_restarts: int = 0, nnodes: int = 1,
            rdzv_endpoint: str | None = None, rdzv_id: str | None = None) -> int:
    """Run ``mct <argv>`` in ``nproc`` local workers (the launcher's own agent on one machine,
    torch.distributed.run's on several); returns the workers' exit code (see mct.run.launch)."""
    from mct.run.launch import launch, launch_local, torchrun_command
    if nnodes == 1:
        return launch_local(argv, nproc, max_restarts)
    cmd = torchrun_command(argv, nproc=nproc, max_restarts=max_restarts, nnodes=nnodes,
                           rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id)
    return launch(cmd, nproc)


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


def _check_host_memory(cfg: EngineConfig, nproc: int, task) -> None:
    """On CPU, refuse a model whose parameters alone (at 2 or 4 bytes each: nproc copies,
    or one copy split across the ranks at stage 3; a lower bound on what training needs)
    exceed the machine's physical memory, before anything is allocated: allocating it
    would end in swapping or the OOM killer, not an error. Not checked when the
    parameters are offloaded (offload.params) or the planner decides (zero.stage = auto).
    Raises ValueError naming the size and the fix."""
    import torch
    if torch.cuda.is_available() or not hasattr(os, "sysconf"):
        return
    if cfg.offload.params != "none" or cfg.zero.stage == "auto":
        return
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return
    from mct.task.meta import build_on_meta
    n = sum(p.numel() for p in build_on_meta(task.model_fn).parameters())
    need = n * (4 if cfg.precision.mode == "fp32" else 2) * (1 if cfg.zero.stage == 3 else nproc)
    if need > ram:
        raise ValueError(f"the model has {n:,} parameters: {need / 2**30:.1f} GiB for the parameters alone on "
                         f"{nproc} worker(s), more than this machine's {ram / 2**30:.1f} GiB of memory; shrink "
                         f"model.n_layer/model.d_model, set zero.stage=3 with offload.optimizer=disk and "
                         f"offload.params=disk, or run `mct plan` for the memory a configuration needs")


def _model_flags(args: argparse.Namespace) -> list[str]:
    """--set overrides with --model / --init-from appended as model.source / train.init_from."""
    extra = [f"model.source={args.model}"] if args.model else []
    if getattr(args, "init_from", None):
        extra.append(f"train.init_from={args.init_from}")
    return [*args.set, *extra]


def _train_config(args: argparse.Namespace):
    """(config, run dir or None) of a new run, or of the run that ``--resume`` continues."""
    if not args.resume:
        return load_config(args.config, _model_flags(args), defaults=CLI_RECIPE), args.run_dir
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
    from mct.persistence.resume import recorded_local_ranks
    recorded = args.nproc is None and args.resume and not _under_torchrun()
    if args.nproc is None:
        args.nproc = recorded_local_ranks(args.resume, args.nnodes) if recorded else 1
    if (args.nproc > 1 or args.nnodes > 1 or args.max_restarts) and not _under_torchrun():
        from mct.run.apart import apart
        # the checks import torch and the model library: in a forked child, so the launcher
        # that waits for the workers stays lean (mct.run.apart)
        worker_argv = apart(lambda: _launch_checks(args, argv, recorded))
        if worker_argv is None:
            return 0
        return _launch(worker_argv, args.nproc, max_restarts=args.max_restarts, nnodes=args.nnodes,
                       rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id)
    checked = _train_checks(args, recorded)
    if checked is None:
        return 0
    cfg, run_dir, task = checked
    from mct.run.worker import run_worker
    return run_worker(cfg, run_dir, resume=bool(args.resume), progress=not args.no_progress, task=task)


def _train_checks(args: argparse.Namespace, recorded: bool):
    """(config, run dir or None, task) of a run once the checks before training passed; None
    when a --resume has no steps left (its weights written if missing). Raises ValueError."""
    from mct.persistence.resume import finished_step
    cfg, run_dir = _train_config(args)
    done = finished_step(args.resume, cfg.train.steps) if args.resume and not _under_torchrun() else None
    if done is not None:  # a resume with no steps left leaves the run as it is
        _finish_weights(Path(args.resume), done[1])
        _note(f"--resume {args.resume!r}: the run already completed {done[0]} steps (train.steps = "
              f"{cfg.train.steps}); nothing to do (raise it with --set train.steps=N to train further)")
        return None
    if recorded and args.nproc > 1:  # resuming on one rank is what a user expects without --nproc: no news
        _note(f"--resume without --nproc: continuing on the run's recorded {args.nproc} local ranks "
              f"(pass --nproc M to reshard)")
    from mct.task import task_for
    task = task_for(cfg)  # a bad model source fails here, in one line, before any launch
    _check_host_memory(cfg, args.nproc if not _under_torchrun() else 1, task)
    _config_warnings(cfg, args.nproc)
    return cfg, run_dir, task


def _launch_checks(args: argparse.Namespace, argv: list[str], recorded: bool) -> list[str] | None:
    """The launcher's checks (``_train_checks``, an impossible budget, a run dir that holds a
    run): the workers' argv (``--run-dir`` added where defaulted), or None when there is
    nothing to do. Raises ValueError before any worker starts."""
    checked = _train_checks(args, recorded)
    if checked is None:
        return None
    cfg, run_dir, task = checked
    from mct.planner import resolve_auto
    from mct.planner.plan import planned_device
    from mct.persistence.run_dir import check_new_run_dir
    # an impossible budget fails here, in one line, before any launch
    resolve_auto(cfg, args.nproc * args.nnodes, task, device=planned_device(cfg))
    extra: list[str] = []
    if not args.resume:
        run_dir = run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}"
        if args.nnodes == 1:  # several machines: global rank 0 checks, once, under torchrun
            check_new_run_dir(run_dir)  # refused here, before any worker starts
        extra = [] if args.run_dir else ["--run-dir", run_dir]
    return [*_strip_nproc(argv), *extra]


def _finish_weights(run_dir: Path, checkpoint: Path) -> None:
    """A run stopped between its last checkpoint and its weights export: write
    ``model.safetensors`` from that checkpoint (the same bytes the run would have written)."""
    from mct.persistence.export import export_checkpoint
    from mct.persistence.run_dir import RunLock
    if (run_dir / "model.safetensors").is_file():
        return
    lock = RunLock(run_dir)  # not while the run itself may be writing it
    try:
        if not (run_dir / "model.safetensors").is_file():
            export_checkpoint(checkpoint, run_dir / "model.safetensors")
            _note(f"wrote {run_dir / 'model.safetensors'} from {checkpoint.name}")
    finally:
        lock.release()


def _note(msg: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"mct: {msg}", file=sys.stderr)


def cmd_export(args: argparse.Namespace, argv: list[str]) -> int:
    from mct.config import parse_bytes
    if args.resume:
        raise ValueError("mct export has no --resume: each export reads the run's newest complete checkpoint "
                         "whole, into a new --out; `mct train --resume RUN_DIR` continues training")
    if args.format == "hf":
        from mct.persistence.hf_export import export_hf
        path, warning = export_hf(args.source, args.out, args.dtype,
                                  parse_bytes(args.max_shard_size, "--max-shard-size"), force=args.force)
    else:
        if args.dtype != "fp32" or args.max_shard_size != "2GB":
            raise ValueError("--dtype and --max-shard-size apply to --format hf; the .safetensors export is fp32, "
                             "one file")
        from mct.persistence.export import export
        path, warning = export(args.source, args.out, force=args.force)
    if warning:
        print(f"mct: warning: {warning}", file=sys.stderr)
    print(f"wrote {args.out} from {path}")
    return 0


def cmd_sample(args: argparse.Namespace, argv: list[str]) -> int:
    from mct.run.generate import sample_text
    text, made, interrupted = sample_text(args.run_dir, args.prompt, args.tokens, args.temperature, args.seed)
    print(text)
    if interrupted:  # Ctrl-C: what was generated is kept (printed above)
        _note(f"interrupted after {made} of {args.tokens} tokens")
        return 130
    return 0


def cmd_verify(args: argparse.Namespace, argv: list[str]) -> int:
    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    cfg = load_config(args.config, _model_flags(args), defaults=CLI_RECIPE)
    if args.nproc > 1 and not _under_torchrun():
        from mct.run.apart import apart
        from mct.task import task_for
        def check_task() -> None:
            task_for(cfg)  # a bad model source fails here, in one line, before any launch
        apart(check_task)  # in a forked child: the launcher stays without torch (mct.run.apart)
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.nproc > 1 and not _under_torchrun():
        return _launch(_strip_nproc(argv), args.nproc)  # verify: no restarts, one node
    import torch.distributed

    from mct.dist import broadcast_from_main, init_distributed, teardown
    from mct.verify.compare import run_verify
    ctx = init_distributed(cfg.distributed.backend, cfg.distributed.timeout_s)
    try:
        report = run_verify(cfg, args.steps, ctx)
        if report is not None:
            print(report.table())
        passed = broadcast_from_main(report.passed if report is not None else True)
        if ctx.world_size > 1:  # no rank tears the group down while a peer still reads from it
            torch.distributed.barrier()
        return 0 if passed else 1
    finally:
        teardown()


def cmd_plan(args: argparse.Namespace, argv: list[str]) -> int:
    """``mct plan``: dry-run every configuration and print the table (or JSON). Returns
    0 when a configuration fits (or no budget was given); raises ValueError (exit 2,
    one line) when nothing fits. ``--plot FILE.png`` also draws it (``mct.reporting.plots``)."""
    import json

    from mct.config import parse_bytes
    from mct.planner import make_plan, plan_workers
    from mct.planner.plan import for_device, planned_device
    from mct.planner.pool import WorkerDied
    from mct.persistence.run_dir import check_outside_runs
    from mct.reporting.plots import check_plot_path
    cfg = load_config(args.config, _model_flags(args), defaults=CLI_RECIPE)
    if args.plot:
        check_plot_path(args.plot, args.force, check_outside_runs)  # before minutes of planning
    if args.world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
    limit = parse_bytes(args.budget, "--budget") if args.budget else cfg.memory.budget_bytes
    from mct.task import task_for
    work = task_for(cfg)
    grid = _plan_grid(args, cfg)
    if args.solve or args.allow is not None:
        return _cmd_solve(args, cfg, limit, work, grid)
    try:
        # a CUDA plan's dry runs take native matmuls; its step times stay this machine's rates
        plan = make_plan(work, for_device(cfg, planned_device(cfg)), args.world_size, limit, grid,
                         extrapolate=not args.full_depth, workers=plan_workers(args.workers))
    except WorkerDied as e:
        print(f"mct: error: {e}", file=sys.stderr)
        return 1
    from mct.planner.tables import format_plan
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    if args.plot:
        from mct.reporting.plots import plot_plan
        plot_plan(plan.to_dict(), args.plot)
    if limit is not None and plan.recommended is None:
        raise ValueError(plan.advice)
    return 0


def _cmd_solve(args: argparse.Namespace, cfg: EngineConfig, limit: int | None, work: Any, grid: Any) -> int:
    """``mct plan --solve``: the solver's frontier, pick and why (or JSON; ``--plot``: the
    frontier). Raises ValueError (exit 2, one line) without a budget or when nothing fits."""
    import json

    from mct.planner import plan_workers
    from mct.planner.auto import check_allow, format_solution, nothing_fits, solve_auto, space_for
    from mct.planner.plan import planned_device
    if not args.solve:
        raise ValueError(f"--allow {args.allow!r} is for the solver: add --solve")
    if limit is None:
        raise ValueError("--solve needs a per-rank budget: pass --budget (e.g. --budget 24GiB) or set memory.budget")
    allow = check_allow(args.allow, "--allow") if args.allow is not None else tuple(cfg.memory.solver_allow)
    if len(grid.precisions) == 1 and grid.precisions[0] != cfg.precision.mode:  # --precisions bf16: that one
        import dataclasses
        cfg = dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, mode=grid.precisions[0]))
    device = planned_device(cfg)
    space = space_for(work, cfg, allow, device, stages=tuple(grid.stages), search_policy=True)
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


def _plan_grid(args: argparse.Namespace, cfg: EngineConfig) -> "Grid":
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
        grid[key] = tuple(int(v) for v in values) if key == "stages" else values
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


def cmd_report(args: argparse.Namespace, argv: list[str]) -> int:
    from mct.reporting.report import load_run, plot_title, report_table
    if args.plot:
        from mct.persistence.run_dir import check_outside_runs
        from mct.reporting.plots import check_plot_path
        check_plot_path(args.plot, args.force, check_outside_runs)
    run = load_run(args.run_dir)
    for w in run.warnings:
        print(f"mct: warning: {w}", file=sys.stderr)
    print(report_table(run))
    if args.plot:
        from mct.reporting.plots import plot_run
        plot_run(run.rows, run.events, run.meta, args.plot, budget=run.budget, title=plot_title(run))
        print(f"wrote {args.plot}")
    return 0


def cmd_calibrate(args: argparse.Namespace, argv: list[str]) -> int:
    import json

    import dataclasses

    from mct.machine import calibrate, calibration_table, default_device
    device = default_device() if args.device == "auto" else args.device
    if args.world_size is not None and args.world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
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


def cmd_prepare(args: argparse.Namespace, argv: list[str]) -> int:
    from mct.data.pipeline import prepare, summary, terminate_as_interrupt
    from mct.persistence.run_dir import check_outside_runs
    with terminate_as_interrupt():
        meta = prepare(args.inputs, args.out, tokenizer=args.tokenizer, text_field=args.text_field,
                       workers=args.workers, progress=not args.no_progress, split=args.split, force=args.force,
                       owned=check_outside_runs)
    line, warning = summary(meta, args.out)
    print(line)
    if warning:
        _warn(warning)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    handler = {"train": cmd_train, "plan": cmd_plan, "verify": cmd_verify, "report": cmd_report,
               "export": cmd_export, "sample": cmd_sample,
               "prepare": cmd_prepare, "calibrate": cmd_calibrate}[args.command]
    from mct.run.launch import WorkerLink
    link = WorkerLink.from_env()
    if _under_torchrun():
        link.setup()  # die with the launcher (or torchrun); tell the launcher this worker's pid
    code, line = 0, ""
    try:
        from mct.conflicts import check_conflicts
        for warning in check_conflicts(args, argv):  # flags that contradict: one line naming both
            _warn(warning)
        code = handler(args, argv)
    except ValueError as e:
        code, line = 2, "mct: error: " + " ".join(str(e).split())  # one line, whatever the message held
    except OSError as e:  # a path the user named: missing, denied, full, damaged (mct.errors)
        from mct.errors import describe
        code, line = 2, "mct: error: " + " ".join(describe(e).split())
    except KeyboardInterrupt:
        code = 130
    link.finish(code, line)  # a no-op when train's worker already reported
    if line and not link.active:
        print(line, file=sys.stderr)
    return code
