"""A run directory: where its checkpoints are, which one to resume, what to keep, and
whether a directory may receive a new run (no collectives; callers pick the rank).

    RUN_DIR/metadata.json, metrics.jsonl, metrics.rank<r>.jsonl, model.safetensors, tb/
    RUN_DIR/checkpoints/step_<N, 8 digits>/   (see checkpoint.py), N = steps completed
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

from mct.outputs import kind
from mct.persistence.manifest import MANIFEST, verify_checkpoint
from mct.persistence.files import fsync_dir, read_json

CHECKPOINTS = "checkpoints"
RUN_FILES = ("metadata.json", "metrics.jsonl", CHECKPOINTS, "model.safetensors")
"""Any of these in a directory means it holds a run."""
_STEP_DIR = re.compile(r"step_(\d{8,})")


def step_dir(run_dir: str | Path, step: int) -> Path:
    """``RUN_DIR/checkpoints/step_<step>`` (zero-padded so names sort by step)."""
    return Path(run_dir) / CHECKPOINTS / f"step_{step:08d}"


def checkpoints(run_dir: str | Path, complete_only: bool = True) -> list[tuple[int, Path]]:
    """(step, path) of the run's checkpoint directories, oldest first; by default only
    complete ones (their manifest exists)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.fullmatch(p.name)
        if m and p.is_dir() and (not complete_only or (p / MANIFEST).is_file()):
            found.append((int(m.group(1)), p))
    return sorted(found)


TRUSTED = "trusted"
"""Marks a run checkpoint whose state a later step updated from and passed (run_checkpoint.py)."""


def mark_trusted(path: Path) -> None:
    """Add the trust mark to checkpoint ``path`` (durably: a crash never leaves a mark
    on a checkpoint that was not trusted)."""
    (path / TRUSTED).write_bytes(b"")
    fsync_dir(path)


def is_trusted(path: Path) -> bool:
    """A checkpoint with the trust mark, or one written without trust tracking (by
    ``Engine.save``, or before it existed: no ``"trust"`` key in trainer.json)."""
    if (path / TRUSTED).exists():
        return True
    try:
        return "trust" not in json.loads((path / "trainer.json").read_text())
    except (OSError, ValueError):
        return True  # no readable trainer.json: verify_checkpoint says what is wrong


def newest_usable(run_dir: str | Path, units: list[dict[str, Any]] | None = None, *,
                  using: str = "resuming from") -> tuple[Path, dict, str | None]:
    """The newest complete checkpoint that passes ``verify_checkpoint`` (against
    ``units`` when given), trusted ones first: one whose state was never confirmed by a
    later step is chosen only when no trusted one is usable. Returns (path, manifest,
    warning): the warning is one line naming each newer checkpoint that was skipped and
    why, ending ``<using> step_N``, or None. Raises ValueError (one line) when no
    checkpoint is usable."""
    found = list(reversed(checkpoints(run_dir)))
    trusted = [c for c in found if is_trusted(c[1])]
    order = trusted + [c for c in found if c not in trusted]
    skipped = [(step, f"{path.name} (not trusted: no step after it passed)")
               for step, path in found if trusted and (step, path) not in trusted]
    for step, path in order:
        try:
            meta = verify_checkpoint(path, units, step=step)
        except ValueError as e:
            skipped.append((step, f"{path.name} ({e})"))
            continue
        newer = [text for s, text in sorted(skipped, reverse=True) if s > step]
        warning = f"skipped checkpoint(s) {'; '.join(newer)}; {using} {path.name}" if newer else None
        return path, meta, warning
    if skipped:
        raise ValueError(f"no usable checkpoint in {run_dir}: {'; '.join(text for _, text in skipped)}")
    raise ValueError(f"{run_dir} has no complete checkpoint to resume from (none in {CHECKPOINTS}/); "
                     f"start a new run with --run-dir, or set train.checkpoint_every")


def resume_candidate(run_dir: str | Path) -> Path | None:
    """The checkpoint ``--resume`` would start from, by the trust marks alone (the newest
    trusted complete one, else the newest complete one; ``newest_usable`` also verifies
    the files), or None when the run has no complete checkpoint. Reads no tensor."""
    found = checkpoints(run_dir)
    trusted = [p for _, p in found if is_trusted(p)]
    return (trusted or [p for _, p in found] or [None])[-1]


def prune(run_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints, torn ones older than the
    newest complete one, and checkpoints set aside as ``.untrusted`` (``set_aside_newer``)
    at or below the step of the newest trusted one (a good checkpoint superseded them).
    Never deletes the newest complete checkpoint. Returns what was deleted."""
    complete = checkpoints(run_dir)
    if not complete:
        return []
    newest = complete[-1][0]
    trusted = [(s, p) for s, p in complete if is_trusted(p)]
    doomed = [p for _, p in complete[:-max(1, keep)] if not trusted or p != trusted[-1][1]]
    doomed += [p for s, p in checkpoints(run_dir, complete_only=False) if s < newest and not (p / MANIFEST).exists()]
    if trusted:
        doomed += [p for s, p in set_aside(run_dir, "untrusted") if s <= trusted[-1][0]]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def set_aside(run_dir: str | Path, tag: str) -> list[tuple[int, Path]]:
    """(step, path) of the checkpoints ``set_aside_newer`` renamed ``step_N.<tag>[k]``, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    pattern = re.compile(rf"step_(\d{{8,}})\.{re.escape(tag)}\d*")
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := pattern.fullmatch(p.name)) and p.is_dir())


def set_aside_newer(run_dir: str | Path, step: int, why: str | None = None) -> list[Path]:
    """Before a resume or after a rollback to ``step``: rename complete checkpoints newer
    than it to ``step_N.damaged`` (they failed the check), ``.untrusted`` (never
    confirmed) or ``.diverged`` (``why``: of a trajectory a rollback left) so that they
    are kept for inspection but never picked again, and delete torn ones. Returns the
    renamed paths."""
    moved = []
    for s, p in checkpoints(run_dir, complete_only=False):
        if s <= step:
            continue
        if (p / MANIFEST).exists():
            tag = why or ("damaged" if is_trusted(p) else "untrusted")
            target = p.with_name(f"{p.name}.{tag}")
            n = 1
            while target.exists():
                target, n = p.with_name(f"{p.name}.{tag}{n}"), n + 1
            p.rename(target)
            moved.append(target)
        else:
            shutil.rmtree(p, ignore_errors=True)
    return moved


def _not_a_directory(what: str) -> str:
    """Why a path that ``mct.outputs.kind`` calls ``what`` cannot be a run directory."""
    if what.startswith("a symbolic link") and what.endswith("which does not exist)"):
        return f"a dangling {what[2:]}"  # mkdir would say "File exists"
    if what == "a regular file":
        return "a file, not a directory (a regular file)"
    return f"not a directory ({what})"


def check_new_run_dir(run_dir: str | Path) -> None:
    """Raise ValueError (one line) unless ``run_dir`` may receive a new run: it must not
    hold a run already, must not be a file, FIFO or dangling link (``mct.outputs.kind``)
    nor inside another run's own tree, and must be creatable and writable. Leaves
    the file system as it was (a probe directory and file are removed again)."""
    path = Path(run_dir)
    what = kind(path)
    if what is not None and not path.is_dir():  # a link to a directory is fine: the run writes into it
        raise ValueError(f"--run-dir {str(path)!r} is {_not_a_directory(what)}; pass a new directory")
    check_outside_runs(path, "--run-dir", example="new-run")
    if path.is_dir():
        held = [n for n in RUN_FILES if (path / n).exists()]
        if held:
            raise ValueError(f"--run-dir {str(path)!r} already holds a run ({held[0]}); continue it with "
                             f"`mct train --resume {path}`, or pass a new directory")
    created = [p for p in [path, *path.parents] if not p.exists()]
    try:  # a real write tells more than permission bits (root, read-only mounts); then undo it all
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".mct-probe-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"--run-dir {str(path)!r} is not writable ({e.strerror or e}); pass a directory "
                         f"you can write to") from None
    finally:
        for p in created:  # deepest first
            try:
                p.rmdir()
            except OSError:
                pass


LOCK_FILE = ".lock"
"""In a run directory while a process trains in it (removed when it stops)."""


class RunLock:
    """An exclusive ``fcntl.flock`` on ``RUN_DIR/.lock``, held by the process that runs
    the run (rank 0) for as long as it trains, so a second run or ``--resume`` on the
    same directory is refused before it changes anything. The lock dies with the
    process (a killed run leaves no stale lock); ``release`` also removes the file."""

    def __init__(self, run_dir: str | Path) -> None:
        """Take the lock, creating ``run_dir`` if missing. Raises ValueError (one line)
        when another process holds it or the directory cannot hold the lock file."""
        import fcntl  # POSIX only: loaded where a lock is taken, so reading a run dir works anywhere
        self.path = Path(run_dir) / LOCK_FILE
        while True:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise ValueError(f"cannot lock run dir {str(run_dir)!r} ({e.strerror or e}); pass a directory "
                                 f"you can write to") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
                os.close(fd)
                raise ValueError(f"run dir {str(run_dir)!r} is in use by a running mct (pid {holder}); wait for "
                                 f"it to finish or stop it, or pass another directory") from None
            try:  # the holder before us may have removed the file after we opened it: retry on the new one
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent)."""
        if self._fd < 0:
            return
        try:
            self.path.unlink()
        except OSError:
            pass
        os.close(self._fd)
        self._fd = -1


BOOKKEEPING = ("metadata.json", "events.jsonl", "model.safetensors", "tokenizer.json", "metrics.rewound.jsonl",
               LOCK_FILE)
"""Files of a run directory that only the run writes (with metrics*.jsonl)."""

RUN_FOLDERS = ("checkpoints", "hf")
"""Folders of a run directory that the run replaces or prunes (a resume deletes ``hf/``,
old checkpoints are pruned): nothing a user keeps may go there."""


def check_outside_runs(out: Path, flag: str = "--out", example: str | None = None) -> None:
    """Raise ValueError (one line, naming ``flag``) when ``out`` (a file or directory to
    create) is part of a run's own tree: inside a checkpoint, anywhere under a run's
    subfolders (``checkpoints/``, ``hf/``), or one of its bookkeeping names. A new name
    directly in a run directory is allowed: no run writes or deletes it. Links are resolved
    first, so a path through a symbolic link is judged where it lands. ``example``: the
    name the message suggests instead (default: 'exported' with ``out``'s suffix). An
    ``mct.outputs.Owned`` check."""
    shown = f"{flag} {str(out)!r}"
    example = example or f"exported{out.suffix}"
    parent = out.parent.resolve()
    landing = out.resolve() if out.is_symlink() else parent / out.name
    for where in dict.fromkeys((parent / out.name, landing)):
        for folder in where.parents:
            if (folder / MANIFEST).is_file():
                raise ValueError(f"{shown} is inside checkpoint {str(folder)!r}; write it elsewhere")
            if is_run_dir(folder):
                name = where.name
                own = (name in BOOKKEEPING or name in RUN_FOLDERS or name.startswith((".hf.tmp", ".tokenizer.json"))
                       or (name.startswith("metrics") and name.endswith(".jsonl")))
                if folder != where.parent or own:
                    raise ValueError(f"{shown} is part of run {str(folder)!r}'s own files, which the run "
                                     f"replaces or prunes; pass another name (e.g. {str(folder / example)!r}) "
                                     f"or another directory")


def is_run_dir(folder: Path) -> bool:
    """A directory made by `mct train`: a checkpoints/ folder, or a metadata.json that is
    a run's (a JSON object with its config and world size)."""
    if (folder / CHECKPOINTS).is_dir() and (folder / "metadata.json").exists():
        return True
    try:
        meta = read_json(folder / "metadata.json") if (folder / "metadata.json").is_file() else None
    except ValueError:
        return False
    return isinstance(meta, dict) and "config" in meta and "world_size" in meta
