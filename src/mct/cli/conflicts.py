"""Command-line flags of one command that contradict each other, said plainly.

``check_conflicts(args, argv)`` runs once per command, after argparse and before any work.
A pair where one flag would silently win over the other is a ValueError (the CLI prints one
line ``mct: error: ...``, exit 2) naming both flags and the fix; a pair where one flag is
merely without effect is returned as a warning line. The decisions, per command:

- ``plan --solve`` honours ``--stages``, one ``--precisions`` value and ``--workers``
  (docs/planner.md); every other grid flag, and several precisions, is an error. ``plan
  --nproc N`` (train's flag, copied with a run's command line) is an error naming
  ``--world-size N``.
- ``train`` / ``verify`` / ``plan``: ``--model`` and ``--set model.source=...`` (and
  ``--init-from`` and ``--set train.init_from=...``) with different values is an error.
- ``train``: ``--rdzv-endpoint`` or ``--rdzv-id`` without ``--nnodes`` > 1 is an error (one
  machine runs a standalone rendezvous and would ignore them).
- ``export``: ``--format hf`` with an ``--out`` ending in ``.safetensors`` is an error (a
  directory would get a file's name); ``--dtype`` / ``--max-shard-size`` without
  ``--format hf`` stay refused where they were (``mct.cli.cmd_export``).
- ``sample``: ``--seed`` with ``--temperature 0`` is a warning (greedy decoding draws nothing).

Those already refused elsewhere: ``--resume`` with ``--config``, ``--model``,
``--init-from`` or another ``--run-dir`` (``mct.cli.train._train_config``); ``--allow`` without
``--solve`` (``mct.cli.plan._cmd_solve``). Imports nothing of mct.
"""

from __future__ import annotations

import argparse
from typing import Callable

SOLVE_IGNORES: dict[str, str] = {
    "--policies": "the solver chooses the recompute of each block itself",
    "--offloads": "let it choose state offload with --allow offload, or fix one with --set offload.optimizer=...",
    "--act-offloads": "it searches activation offload itself; fix one with --set checkpointing.offload=...",
    "--loss-chunks": "let it choose loss chunking with --allow loss_chunk, or fix one with "
                     "--set train.loss_chunk_tokens=N",
    "--mlp-tiles": "fix one with --set checkpointing.mlp_tile_tokens=N (it tiles the MLP itself when nothing fits)",
    "--full-depth": "it always extends shallow copies of the repeated blocks",
}
"""``mct plan`` grid flags the solver does not read, and what to do instead."""


def given(argv: list[str], flag: str) -> bool:
    """Whether ``flag`` (e.g. '--policies') is on the command line ``argv``, as itself, as
    ``flag=VALUE`` or as an abbreviation argparse accepted (a prefix of it); tokens after
    '--' are not flags."""
    for token in argv:
        if token == "--":
            return False
        name = token.split("=", 1)[0]
        if name.startswith("--") and len(name) > 2 and flag.startswith(name):
            return True
    return False


def _set_value(sets: list[str], key: str) -> str | None:
    """The last ``--set key=VALUE``'s value (stripped), or None."""
    found = None
    for item in sets:
        k, sep, v = item.partition("=")
        if sep and k.strip() == key:
            found = v.strip()
    return found


def _same_key(args: argparse.Namespace) -> None:
    """--model / --init-from against --set of the same key, with another value."""
    for flag, attr, key in (("--model", "model", "model.source"), ("--init-from", "init_from", "train.init_from")):
        value, other = getattr(args, attr, None), _set_value(getattr(args, "set", None) or [], key)
        if value and other is not None and other != value:
            raise ValueError(f"{flag} {value!r} and --set {key}={other!r} set the same key to different values; "
                             f"pass one of them")


def _plan(args: argparse.Namespace, argv: list[str]) -> list[str]:
    if args.nproc is not None:  # mct train's flag, copied with the rest of a run's command line
        raise ValueError(f"mct plan has no --nproc: it plans {args.nproc} data-parallel ranks with --world-size "
                         f"{args.nproc} (--nproc is mct train's); pass --world-size {args.nproc}")
    if not args.solve:
        return []
    for flag, instead in SOLVE_IGNORES.items():
        if given(argv, flag):
            raise ValueError(f"--solve and {flag} contradict: --solve does not read {flag} ({instead}); drop "
                             f"{flag}, or drop --solve to plan the grid")
    precisions = [v for v in args.precisions.split(",") if v.strip()]
    if given(argv, "--precisions") and len(precisions) > 1:
        raise ValueError(f"--solve plans one precision, but --precisions {args.precisions!r} names {len(precisions)}; "
                         f"pass one (e.g. --precisions {precisions[-1].strip()}), or drop --solve to plan them all")
    return []


def _train(args: argparse.Namespace, argv: list[str]) -> list[str]:
    if args.nnodes == 1:
        for flag in ("--rdzv-endpoint", "--rdzv-id"):
            if given(argv, flag):
                raise ValueError(f"{flag} and --nnodes 1 contradict: one machine runs its own rendezvous and would "
                                 f"ignore {flag}; pass --nnodes N (N > 1) for several machines, or drop {flag}")
    return []


def _export(args: argparse.Namespace, argv: list[str]) -> list[str]:
    if args.format == "hf" and args.out.lower().endswith(".safetensors"):
        raise ValueError(f"--format hf writes a directory, but --out {args.out!r} names a .safetensors file; pass a "
                         f"directory name, or drop --format hf for one .safetensors file")
    return []


def _sample(args: argparse.Namespace, argv: list[str]) -> list[str]:
    if args.temperature == 0 and given(argv, "--seed"):
        return [f"--seed {args.seed} has no effect with --temperature 0 (greedy decoding draws no random numbers)"]
    return []


_BY_COMMAND: dict[str, Callable[[argparse.Namespace, list[str]], list[str]]] = {
    "plan": _plan, "train": _train, "export": _export, "sample": _sample}


def check_conflicts(args: argparse.Namespace, argv: list[str]) -> list[str]:
    """Check the parsed ``args`` of the command line ``argv`` (after ``mct``) for flags
    that contradict each other. Returns warning lines (flags without effect). Raises
    ValueError (one line naming both flags and the fix) for a contradiction."""
    _same_key(args)
    check = _BY_COMMAND.get(args.command)
    return check(args, argv) if check is not None else []
