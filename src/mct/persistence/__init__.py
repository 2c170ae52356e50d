"""Persistence: run checkpoints (sharded, resharding on load), resume, export.

Named apart from ``mct.checkpointing`` (activation recompute). The engine's state
comes from ``Engine.state_dict()`` and goes back through ``Engine.load_state_dict()``;
this package only does file I/O around them.

    checkpoint.py  one checkpoint directory: save, verify, load (DCP + JSON + manifest)
    shards.py      the DCP layer: 1-D element-range pieces as DTensors, safe metadata reads
    files.py       durable writes (temp, fsync, rename, dir fsync), checked JSON reads, digests
    run_dir.py     a run directory: checkpoint names, newest usable one, pruning, reuse checks
    resume.py      `mct train --resume`: the run's config, allowed overrides, clean history
    export.py      consolidated fp32 safetensors from a checkpoint, in one process
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from mct.persistence.checkpoint import MANIFEST, load_engine_state, save_checkpoint, verify_checkpoint

if TYPE_CHECKING:
    from mct.engine import Engine

__all__ = ["save_engine", "load_engine", "save_checkpoint", "load_engine_state", "verify_checkpoint"]


def save_engine(engine: "Engine", path: str | os.PathLike) -> None:
    """``Engine.save``: write a checkpoint to ``path``, replacing one already there only
    once the new one is complete (written beside it, then swapped in). Collective."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    old = path.with_name(f".{path.name}.old")
    save_checkpoint(partial, engine, step=engine.steps_done)
    if engine.comm.rank == 0:
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
        partial.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    engine.comm.barrier()


def load_engine(engine: "Engine", path: str | os.PathLike) -> None:
    """``Engine.load``: load a checkpoint of any world size and stage. Raises ValueError
    naming the file and fault, the engine untouched. Collective."""
    load_engine_state(engine, path)
