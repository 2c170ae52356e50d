"""A checkpoint's manifest and the checks made before anything is loaded from it.

Plain JSON and file digests, no torch: the launcher, ``mct train --resume`` and the run
directory's bookkeeping read checkpoints' manifests without importing the engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mct.persistence.files import check_digest, read_json

CHECKPOINT_FORMAT = "mct.checkpoint/1"
MANIFEST = "meta.json"
FROZEN = "frozen/"


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of a complete checkpoint. Raises ValueError naming the fault."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise ValueError(f"{path} is not a complete checkpoint (no {MANIFEST}): pass a directory written by "
                         f"Engine.save or `mct train` (RUN_DIR/checkpoints/step_N)")
    meta = read_json(path / MANIFEST)
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path / MANIFEST}: format {meta.get('format') if isinstance(meta, dict) else None!r}, "
                         f"expected {CHECKPOINT_FORMAT!r}")
    for k, typ in (("step", int), ("world_size", int), ("zero_stage", int), ("files", dict)):
        if not isinstance(meta.get(k), typ):
            raise ValueError(f"{path / MANIFEST}: no valid {k!r}")
    return meta


def verify_checkpoint(path: str | Path, units: list[dict[str, Any]] | None = None,
                      step: int | None = None) -> dict[str, Any]:
    """Check a checkpoint before anything is loaded from it: manifest, every rank's file
    present, sizes and sha256, one step everywhere, and (given ``units``) the layout
    against the model. Returns the manifest; raises ValueError naming the file and fault."""
    path = Path(path)
    meta = read_manifest(path)
    if step is not None and meta["step"] != step:
        raise ValueError(f"{path / MANIFEST}: holds step {meta['step']}, but the directory is named for step {step}")
    files = meta["files"]
    needed = ["engine.json", "engine/.metadata", *[f"rank{r}.json" for r in range(meta["world_size"])]]
    for name in needed:
        if name not in files:
            raise ValueError(f"{path / MANIFEST}: lists no {name}; the checkpoint is incomplete")
    for name, want in files.items():
        check_digest(path / name, want)
    for name in [n for n in files if n.endswith(".json") and n not in ("engine.json", "base.json")]:
        got = read_json(path / name).get("step")
        if got != meta["step"]:
            raise ValueError(f"{path / name}: step {got}, the manifest says {meta['step']}")
    if units is not None:
        check_layout(path, read_json(path / "engine.json").get("units"), units)
    return meta


def check_layout(path: Path, saved: Any, units: list[dict[str, Any]]) -> None:
    """Raise ValueError naming the first parameter whose layout differs."""
    want = {n: (shape, u["name"]) for u in units for n, shape, _ in u["params"]}
    have = {n: (shape, u["name"]) for u in (saved or []) for n, shape, _ in u["params"]}
    for n in want:
        if n not in have:
            raise ValueError(f"{path}: has no parameter {n!r}; it was saved from a different model")
        if list(have[n][0]) != list(want[n][0]):
            raise ValueError(f"{path}: parameter {n!r} has shape {tuple(have[n][0])} in the checkpoint, "
                             f"{tuple(want[n][0])} in this model")
    extra = sorted(set(have) - set(want))
    if extra:
        raise ValueError(f"{path}: holds parameters this model lacks, e.g. {extra[0]!r}")
    if [u["params"] for u in saved] != [u["params"] for u in units] or [u["name"] for u in saved] != [
            u["name"] for u in units]:
        raise ValueError(f"{path}: parameters are grouped differently (checkpointing.blocks or optimizer groups)")
