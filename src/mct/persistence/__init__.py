"""Persistence: run checkpoints (sharded, resharding on load), resume, export.

Named apart from ``mct.checkpointing`` (activation recompute). The engine's state
comes from ``Engine.state_dict()`` and goes back through ``Engine.load_state_dict()``;
this package does the file I/O around them and imports nothing of the engine
(``Checkpointable`` and ``StateOwner`` are the protocols it needs), so ``Engine.save``/
``load`` and the engine's state API can call it.

    engine_state.py  the engine's state dict (``mct.engine/1``): header, validation, loads
                   through its residency; full-state reads (no file I/O)
    checkpoint.py  one checkpoint directory: save, verify, load (DCP + JSON + manifest)
    shards.py      the DCP layer: 1-D element-range pieces as DTensors, safe metadata reads
    files.py       durable writes (temp, fsync, rename, dir fsync), checked JSON reads, digests
    run_dir.py     a run directory: checkpoint names, newest usable one, pruning, reuse checks
    resume.py      `mct train --resume`: the run's config, allowed overrides, clean history
    export.py      consolidated fp32 safetensors from a checkpoint, in one process
"""

from __future__ import annotations

from mct.persistence.checkpoint import (MANIFEST, Checkpointable, load_engine, load_engine_state, save_checkpoint, save_engine,
                                        verify_checkpoint)

__all__ = ["Checkpointable", "save_engine", "load_engine", "save_checkpoint", "load_engine_state", "verify_checkpoint"]
