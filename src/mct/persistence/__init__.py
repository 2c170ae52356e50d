"""Persistence: run checkpoints (sharded, resharding on load), resume, export.

Named apart from ``mct.checkpointing`` (activation recompute). The engine's state
comes from ``Engine.state_dict()`` and goes back through ``Engine.load_state_dict()``;
this package does the file I/O around them and imports nothing of the engine
(``Checkpointable`` and ``StateOwner`` are the protocols it needs), so ``Engine.save``/
``load`` and the engine's state API can call it. One exception, above everything the engine
imports: ``init_from.rebuilt_frozen`` builds a run's engine to give back the frozen base a
checkpoint references by hash; the readers below it take it as their ``rebuild`` argument.

    engine_state.py  the engine's state dict (``mct.engine/1``): header, validation, loads
                   through its residency; full-state reads (no file I/O)
    checkpoint.py  one checkpoint directory: save, verify, load (DCP + JSON + manifest)
    manifest.py    a checkpoint's manifest and the checks before a load (no torch)
    shards.py      the DCP layer: 1-D element-range pieces as DTensors, safe metadata reads
                   (imported on first use, ``lazy.py``: DCP takes a second to import)
    files.py       durable writes (temp, fsync, rename, dir fsync), checked JSON reads, digests
    run_dir.py     a run directory: checkpoint names, newest usable one, pruning, reuse checks,
                   a run's own files (no user output lands there: ``mct.outputs``)
    resume.py      `mct train --resume`: the run's config, allowed overrides, clean history
    export.py      consolidated fp32 safetensors from a checkpoint, in one process
    export_file.py `mct export --out FILE.safetensors [--merge]` (the command's own checks)
    weight_sources.py  what --init-from and the adapter import/export read: HF dirs, files, runs
    base_manifest.py  a checkpoint's frozen base by content hash (base.json): digests, checks
    init_from.py   --init-from into an engine; a referenced base rebuilt (``rebuilt_frozen``)
    adapter_export.py / adapter_source.py  adapters out (peft, merged) and back in (--init-from)
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Checkpointable", "save_engine", "load_engine", "save_checkpoint", "load_engine_state", "verify_checkpoint",
           "MANIFEST"]


def __getattr__(name: str) -> Any:
    """The names above come from ``checkpoint.py``, imported on first use: ``mct train``'s
    launcher and error paths read run directories through ``resume.py`` / ``run_dir.py``
    without importing torch."""
    if name in __all__:
        return getattr(importlib.import_module("mct.persistence.checkpoint"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
