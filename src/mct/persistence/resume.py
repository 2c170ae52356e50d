"""``mct train --resume RUN_DIR``: the run's config, the overrides a resume may make,
the per-rank split of the run's global batch, and one clean metrics history.

The global batch (``global_micro_batches`` micro-batches of ``data.micro_batch_size``
sequences per step) and the sample order belong to the run. On M ranks each rank runs
``global_micro_batches / M`` micro-batches (``data.grad_accum`` is set to that), so the
same samples are seen at the same steps with the same dropout on any world size.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from mct.config import EngineConfig, apply_overrides
from mct.reporting.events import append_event, utc_now
from mct.persistence.files import read_json, write_atomic, write_json
from mct.persistence.run_dir import checkpoints

FIXED = ("seed", "model", "data", "precision", "train.lr", "train.warmup_steps", "train.weight_decay",
         "train.grad_clip")
"""Config keys (or whole sections) a resume may not change: they would make it another run."""


def _changed(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        key = f"{prefix}{k}"
        if isinstance(a.get(k), dict) and isinstance(b.get(k), dict):
            out += _changed(a[k], b[k], key + ".")
        elif a.get(k) != b.get(k):
            out.append(key)
    return out


def run_trainer_state(run_dir: str | Path) -> dict[str, Any]:
    """trainer.json of the newest complete checkpoint whose trainer.json reads (the
    full check of the checkpoint happens when it is loaded). Raises ValueError."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir() or not (run_dir / "metadata.json").is_file():
        raise ValueError(f"--resume {str(run_dir)!r} is not a run directory (no metadata.json); pass the "
                         f"--run-dir of an earlier `mct train`")
    found = checkpoints(run_dir)
    for _, path in reversed(found):
        try:
            state = read_json(path / "trainer.json")
            EngineConfig.from_dict(state["config"])
            return state
        except (ValueError, KeyError, TypeError):
            continue
    raise ValueError(f"--resume {str(run_dir)!r}: no complete checkpoint in {run_dir / 'checkpoints'} "
                     f"({len(found)} found); the run saved none (train.checkpoint_every = 0 and it did not finish)")


def resume_config(run_dir: str | Path, overrides: list[str], world_size: int) -> EngineConfig:
    """The config to continue ``run_dir`` with on ``world_size`` ranks: the run's own
    (from its newest checkpoint) with ``overrides`` applied. Raises ValueError (one
    line) for an override of a FIXED key or a world size that cannot split the run's
    global batch."""
    state = run_trainer_state(run_dir)
    saved = state["config"]
    new = apply_overrides(saved, overrides)
    for key in _changed(saved, new):
        if any(key == f or key.startswith(f + ".") for f in FIXED):
            raise ValueError(f"--resume cannot change {key} (it would make a different run); start a new run "
                             f"with --run-dir, or change only train.steps, train.checkpoint_every, zero.*, "
                             f"checkpointing.*, memory.* and logging/eval keys")
    global_micro = int(state["global_micro_batches"])
    if global_micro % world_size:
        options = [n for n in range(1, global_micro + 1) if global_micro % n == 0]
        raise ValueError(f"the run's global batch is {global_micro} micro-batches per step, which {world_size} "
                         f"ranks cannot split evenly; use --nproc in {options}")
    new["data"] = {**new["data"], "grad_accum": global_micro // world_size}
    return EngineConfig.from_dict(new)


def check_corpus(run_dir: str | Path, fingerprint: str) -> None:
    """Raise ValueError if the corpus now at ``data.path`` is not the one the run
    started with (its fingerprint in metadata.json): the samples would differ."""
    saved = (read_json(Path(run_dir) / "metadata.json").get("corpus") or {}).get("fingerprint")
    if saved is not None and saved != fingerprint:
        raise ValueError(f"the corpus at data.path changed since the run in {run_dir} started (fingerprint "
                         f"{fingerprint[:12]} != {saved[:12]}); restore it, or start a new run with --run-dir")


def rewind_metrics(run_dir: str | Path, step: int, files: list[Path] | None = None) -> int:
    """Keep only rows with ``step`` < ``step`` in the run's metrics*.jsonl (or ``files``),
    so the history reads as one run; the rows removed (and torn lines) are appended to
    ``metrics.rewound.jsonl`` with the file they came from. When the kept rows are the
    file's head (a rollback, a resume after a crash), the file is truncated in place, so
    a writer holding it open in append mode keeps working; otherwise it is replaced
    atomically. Returns how many rows moved. The one way mct drops metric rows."""
    run_dir = Path(run_dir)
    moved: list[str] = []
    for f in files if files is not None else sorted(run_dir.glob("metrics*.jsonl")):
        if f.name == "metrics.rewound.jsonl" or not f.is_file():
            continue
        data = f.read_bytes()
        keep, dropped, head, off = [], False, True, 0
        for line in data.decode(errors="replace").splitlines(keepends=True):
            try:
                ok = json.loads(line)["step"] < step
            except (json.JSONDecodeError, KeyError, TypeError):
                ok = False
            head = head and not (ok and dropped)  # a kept row after a dropped one: not a head
            dropped = dropped or not ok
            off += len(line.encode()) if not dropped else 0
            if ok:
                keep.append(line if line.endswith("\n") else line + "\n")
            else:
                moved.append(json.dumps({"file": f.name, "line": line.rstrip("\n")}))
        if head:
            os.truncate(f, off)
        else:
            write_atomic(f, "".join(keep).encode())
    if moved:
        with open(run_dir / "metrics.rewound.jsonl", "a") as out:
            out.write("".join(m + "\n" for m in moved))
    return len(moved)


def record_resume(run_dir: str | Path, *, from_step: int, world_size: int, zero_stage: int,
                  checkpoint: str, reason: str | None = None) -> None:
    """Append to metadata.json's ``resumes`` list (time, from_step, world_size,
    zero_stage, and the checkpoint used) and a ``resume`` event to events.jsonl
    (``reason``: e.g. the damaged checkpoints that were skipped)."""
    path = Path(run_dir) / "metadata.json"
    meta = read_json(path)
    meta.setdefault("resumes", []).append({"time": utc_now(), "from_step": from_step, "world_size": world_size,
                                           "zero_stage": zero_stage, "checkpoint": checkpoint})
    write_json(path, meta)
    append_event(run_dir, step=from_step, kind="resume", action=f"restore {checkpoint}",
                 reason=reason or f"mct train --resume on {world_size} rank(s), zero.stage {zero_stage}")
