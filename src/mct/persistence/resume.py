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

from mct.config import EngineConfig, apply_overrides, config_value, resume_rules
from mct.reporting.events import append_event, utc_now
from mct.persistence.files import read_json, write_atomic, write_json
from mct.persistence.manifest import read_manifest
from mct.persistence.run_dir import checkpoints, newest_usable


def resume_changes(saved: dict[str, Any], new: dict[str, Any], refuse: bool = True) -> dict[str, list[Any]]:
    """{key: [saved value, new value]} for every key of the schema (``resume_rules``) whose
    value differs between the configs ``saved`` and ``new`` (dicts of the TOML shape, missing
    keys at their defaults) and whose declaration allows the change. ``refuse``: raise
    ValueError (one line) for the first change the schema forbids, naming the key, both
    values, why and the fix; else leave such keys out (the resume's own settings: data.grad_accum
    for the number of ranks, model.source for the run's copy of an hf: model)."""
    old_cfg, new_cfg = EngineConfig.from_dict(saved), EngineConfig.from_dict(new)
    changes: dict[str, list[Any]] = {}
    for key, rule in resume_rules().items():
        was, now = config_value(old_cfg, key), config_value(new_cfg, key)
        if was == now:
            continue
        if not rule.allowed and refuse:
            raise ValueError(f"--resume cannot change {key} from {was!r} to {now!r}: {rule.effect}; "
                             f"{rule.fix.format(old=was, new=now)}")
        if rule.allowed:
            changes[key] = [was, now]
    return changes


def read_run_metadata(run_dir: str | Path) -> dict[str, Any]:
    """The run's metadata.json as a dict. Raises ValueError naming the file when it is
    missing, unreadable, or not a JSON object with the fields a resume reads."""
    path = Path(run_dir) / "metadata.json"
    if not Path(run_dir).is_dir() or not path.is_file():
        raise ValueError(f"--resume {str(run_dir)!r} is not a run directory (no metadata.json); pass the "
                         f"--run-dir of an earlier `mct train`")
    meta = read_json(path)
    bad = None
    if not isinstance(meta, dict):
        bad = f"holds a JSON {type(meta).__name__}, not an object"
    elif not isinstance(meta.get("config", {}), dict) or not isinstance(meta.get("resumes", []), list):
        bad = "'config' or 'resumes' has the wrong type"
    elif not isinstance(meta.get("corpus") or {}, dict):
        bad = "'corpus' has the wrong type"
    if bad:
        raise ValueError(f"{path}: {bad}; it was damaged (restore it from a backup to resume)")
    return meta


def run_trainer_state(run_dir: str | Path) -> dict[str, Any]:
    """trainer.json of the newest complete checkpoint whose trainer.json reads (the
    full check of the checkpoint happens when it is loaded). Raises ValueError."""
    run_dir = Path(run_dir)
    meta = read_run_metadata(run_dir)
    found = checkpoints(run_dir)
    for _, path in reversed(found):
        try:
            state = read_json(path / "trainer.json")
            EngineConfig.from_dict(state["config"])
            if not isinstance(state.get("step"), int) or not isinstance(state.get("global_micro_batches"), int):
                raise TypeError("no step")
            return state
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    every = (meta.get("config") or {}).get("train", {}).get("checkpoint_every")
    why = (f"{len(found)} complete one(s), none with a readable trainer.json" if found else
           f"the run saves every {every} steps, so they were deleted or it stopped before its first"
           if isinstance(every, int) and every > 0 else
           "the run saved none (train.checkpoint_every = 0 and it did not finish)")
    raise ValueError(f"--resume {str(run_dir)!r}: no usable checkpoint in {run_dir / 'checkpoints'} ({why}); "
                     f"start a new run with --run-dir")


def recorded_world_size(run_dir: str | Path) -> int:
    """The number of ranks the run last ran on: its newest complete checkpoint's world
    size, else the last resume's or the start's in metadata.json. Raises ValueError."""
    meta = read_run_metadata(run_dir)
    for _, path in reversed(checkpoints(run_dir)):
        try:
            return int(read_manifest(path)["world_size"])
        except ValueError:
            continue
    last = (meta.get("resumes") or [meta])[-1]
    world = last.get("world_size") if isinstance(last, dict) else None
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"{Path(run_dir) / 'metadata.json'}: no valid world_size; pass --nproc")
    return world


def recorded_packing(config: dict[str, Any]) -> dict[str, Any]:
    """A recorded config with ``data.packing`` spelled out: a run recorded before the key
    existed cut stream windows, and resumes with them whatever the default is now (a new
    dict; ``config`` is not mutated)."""
    data = config.get("data")
    if not isinstance(data, dict) or "packing" in data:
        return config
    return {**config, "data": {**data, "packing": "stream"}}


def resume_config(run_dir: str | Path, overrides: list[str], world_size: int) -> EngineConfig:
    """The config to continue ``run_dir`` with on ``world_size`` ranks: the run's own
    (from its newest checkpoint) with ``overrides`` applied. Raises ValueError (one
    line) for an override of a key whose ``OnResume`` declaration refuses it
    (``resume_changes``), or a world size that cannot split the run's global batch."""
    state = run_trainer_state(run_dir)
    saved = recorded_packing(state["config"])
    new = apply_overrides(saved, overrides)
    resume_changes(saved, new)
    global_micro = int(state["global_micro_batches"])
    context = int(new.get("parallel", {}).get("context", 1))  # ranks that share one window
    if world_size % context or global_micro % (world_size // context):  # a degree above the world: no split
        options = [n * context for n in range(1, global_micro + 1) if global_micro % n == 0]
        raise ValueError(f"the run's global batch is {global_micro} micro-batches per step, which {world_size} "
                         f"ranks (parallel.context = {context}) cannot split evenly; use --nproc in {options}")
    new["data"] = {**new["data"], "grad_accum": global_micro // (world_size // context)}
    kept = Path(run_dir) / "hf"
    if str(new["model"].get("source", "")).startswith("hf:") and (kept / "config.json").is_file():
        # the architecture the run has trained since it started, not the source directory (since
        # edited or removed): RUN_DIR/hf/config.json, copied when the run began
        new["model"] = {**new["model"], "source": f"hf:{kept}"}
    return EngineConfig.from_dict(new)


def planned_for_budget(run_dir: str | Path | None) -> bool:
    """Whether the run in ``run_dir`` (None: no run) started with ``auto`` (zero.stage or
    checkpointing.policy), the planner choosing for its ``memory.budget``: its recorded
    config holds the choice, metadata.json the plan. False when unreadable."""
    if run_dir is None:
        return False
    try:
        return bool(read_run_metadata(run_dir).get("plan"))
    except ValueError:
        return False


def check_corpus(run_dir: str | Path, fingerprint: str) -> None:
    """Raise ValueError if the corpus now at ``data.path`` is not the one the run
    started with (its fingerprint in metadata.json): the samples would differ."""
    saved = (read_run_metadata(run_dir).get("corpus") or {}).get("fingerprint")
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
                  checkpoint: str, reason: str | None = None, changed: dict[str, list[Any]] | None = None) -> None:
    """Append to metadata.json's ``resumes`` list (time, from_step, world_size,
    zero_stage, the checkpoint used, and ``changed``: {key: [old, new]} of the config
    keys the resume changed, from ``resume_changes``) and a ``resume`` event to
    events.jsonl (``reason``: e.g. the damaged checkpoints that were skipped)."""
    path = Path(run_dir) / "metadata.json"
    meta = read_run_metadata(run_dir)
    meta.setdefault("resumes", []).append({"time": utc_now(), "from_step": from_step, "world_size": world_size,
                                           "zero_stage": zero_stage, "checkpoint": checkpoint,
                                           "changed": changed or {}})
    write_json(path, meta)
    append_event(run_dir, step=from_step, kind="resume", action=f"restore {checkpoint}",
                 reason=reason or f"mct train --resume on {world_size} rank(s), zero.stage {zero_stage}")


def recorded_local_ranks(run_dir: str | Path, nnodes: int = 1) -> int:
    """Local ranks per machine of the run in ``run_dir`` (``recorded_world_size`` split
    over ``nnodes`` machines). Raises ValueError when it does not split evenly."""
    world = recorded_world_size(run_dir)
    if world % nnodes:
        raise ValueError(f"--resume {str(run_dir)!r}: the run has {world} ranks, which --nnodes {nnodes} cannot "
                         f"split evenly; pass --nproc to reshard")
    return world // nnodes


def finished_step(run_dir: str | Path, steps: int) -> tuple[int, Path] | None:
    """(steps completed, checkpoint) when the run has nothing left to do for
    ``train.steps = steps``: its newest usable checkpoint is at or past them. None: a
    resume has steps to run. Raises ValueError when no checkpoint is usable."""
    if run_trainer_state(run_dir)["step"] < steps:  # cheap: the full check only when it may be done
        return None
    path, meta, _ = newest_usable(run_dir)  # the one a resume would load
    return (meta["step"], path) if meta["step"] >= steps else None
