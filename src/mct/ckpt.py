"""Engine checkpoints: one file per rank with its master shards, optimizer state and
loss scaler, plus ``meta.json`` (world size, stage, layout digest). Files are written
to a temporary name and renamed, so a crash mid-save never leaves a torn checkpoint
where the last good one was.

Loading requires the same world size and ZeRO stage (resharding across world sizes
goes through ``Engine.full_state_dict`` / ``load_full_state_dict``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mct.engine import Engine


def _layout_digest(engine: "Engine") -> list:
    return [[u.name, list(u.names), u.layout.padded_numel] for u in engine.sharded.units]


def save_engine(engine: "Engine", path: str | os.PathLike) -> None:
    """Collective: every rank writes its own shard file; rank 0 writes meta.json last."""
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    rank = engine.comm.rank
    with engine._masters_resident(write_back=False):  # offloaded masters are read back
        masters = [u.master.detach().clone() for u in engine.sharded.units]
    offload = engine.offload
    state = {"masters": masters,
             "optimizer": (offload.optimizer_state_dict(engine.optimizer) if offload is not None
                           else engine.optimizer.state_dict()),
             "scaler": engine.scaler.state_dict(),
             "steps_done": engine.steps_done}
    tmp = d / f"rank{rank}.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, d / f"rank{rank}.pt")
    engine.comm.barrier()
    if rank == 0:
        meta = {"world_size": engine.comm.world, "stage": engine.stage, "layout": _layout_digest(engine),
                "precision": engine.config.precision.mode}
        (d / "meta.json.tmp").write_text(json.dumps(meta))
        os.replace(d / "meta.json.tmp", d / "meta.json")
    engine.comm.barrier()


def load_engine(engine: "Engine", path: str | os.PathLike) -> None:
    d = Path(path)
    meta_path = d / "meta.json"
    if not meta_path.is_file():
        raise ValueError(f"{str(d)!r} is not an mct checkpoint (no meta.json): pass a directory made by Engine.save")
    meta = json.loads(meta_path.read_text())
    if meta["world_size"] != engine.comm.world or meta["stage"] != engine.stage:
        raise ValueError(f"checkpoint {str(d)!r} was saved with world_size={meta['world_size']}, "
                         f"zero.stage={meta['stage']}; this engine has world_size={engine.comm.world}, "
                         f"zero.stage={engine.stage}. Use the same, or reshard through full_state_dict().")
    if meta["layout"] != _layout_digest(engine):
        raise ValueError(f"checkpoint {str(d)!r} holds a different model (parameter layout differs)")
    f = d / f"rank{engine.comm.rank}.pt"
    if not f.is_file():
        raise ValueError(f"checkpoint {str(d)!r} has no shard for rank {engine.comm.rank} ({f.name})")
    state = torch.load(f, map_location=engine.device, weights_only=True)
    with torch.no_grad(), engine._masters_resident(write_back=True):
        for u, m in zip(engine.sharded.units, state["masters"]):
            u.master.copy_(m)
        engine.sharded.publish()  # while offloaded masters are resident
    if engine.offload is not None:
        engine.offload.load_optimizer_state_dict(engine.optimizer, state["optimizer"])
    else:
        engine.optimizer.load_state_dict(state["optimizer"])
        engine._opt_state_tracked = False
        engine._register_optimizer_state()
    engine.scaler.load_state_dict(state["scaler"])
    engine.steps_done = state["steps_done"]
