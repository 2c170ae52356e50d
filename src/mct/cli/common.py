"""What every command shares: the launcher under torchrun, the one-line warnings and notes, the
``--model`` / ``--init-from`` flags as config keys."""

from __future__ import annotations

import argparse
import os
import sys



def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ

def _launch(argv: list[str], nproc: int, *, max_restarts: int = 0, nnodes: int = 1,
            rdzv_endpoint: str | None = None, rdzv_id: str | None = None) -> int:
    """Run ``mct <argv>`` in ``nproc`` local workers (the launcher's own agent on one machine,
    torch.distributed.run's on several); returns the workers' exit code (see mct.run.launch)."""
    if nnodes == 1:
        from mct.run.agent import launch_local
        return launch_local(argv, nproc, max_restarts)
    from mct.run.launch import launch, torchrun_command
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

def _note(msg: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"mct: {msg}", file=sys.stderr)

def _model_flags(args: argparse.Namespace) -> list[str]:
    """--set overrides with --model / --init-from appended as model.source / train.init_from."""
    extra = [f"model.source={args.model}"] if args.model else []
    if getattr(args, "init_from", None):
        extra.append(f"train.init_from={args.init_from}")
    return [*args.set, *extra]
