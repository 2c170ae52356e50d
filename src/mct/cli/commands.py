"""``mct export | sample | verify | report | prepare``: each hands its flags to the module that does
the work."""

from __future__ import annotations

import argparse
import sys

from mct.config import CLI_RECIPE, load_config
from mct.cli.common import _launch, _model_flags, _note, _strip_nproc, _under_torchrun, _warn


def cmd_export(args: argparse.Namespace, argv: list[str]) -> int:
    from mct.config import parse_bytes
    if args.resume:
        raise ValueError("mct export has no --resume: each export reads the run's newest complete checkpoint "
                         "whole, into a new --out; `mct train --resume RUN_DIR` continues training")
    if args.format == "peft":
        if args.merge or args.dtype != "fp32" or args.max_shard_size != "2GB":
            raise ValueError("--merge, --dtype and --max-shard-size do not apply to --format peft (the adapters, "
                             "fp32); merged weights: --format hf --merge or --out FILE.safetensors --merge")
        from mct.persistence.adapter_export import export_peft
        path, warning = export_peft(args.source, args.out, force=args.force)
    elif args.format == "hf":
        from mct.persistence.hf_export import export_hf
        path, warning = export_hf(args.source, args.out, args.dtype,
                                  parse_bytes(args.max_shard_size, "--max-shard-size"), force=args.force,
                                  merge=args.merge)
    else:
        if args.dtype != "fp32" or args.max_shard_size != "2GB":
            raise ValueError("--dtype and --max-shard-size apply to --format hf; the .safetensors export is fp32, "
                             "one file")
        from mct.persistence.export_file import export
        path, warning = export(args.source, args.out, force=args.force, merge=args.merge)
    if warning:
        print(f"mct: warning: {warning}", file=sys.stderr)
    print(f"wrote {args.out} from {path}")
    return 0

def cmd_sample(args: argparse.Namespace, argv: list[str]) -> int:
    from mct.task.sample import sample_text
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
