"""The frozen base of a checkpoint that references it (``base.json``), rebuilt for the
readers that need its values outside a run: ``mct export`` (full weights, ``--format hf``
with or without ``--merge``) and ``--init-from`` a run directory.

The base is built exactly as the run built it at its start (``task_for`` of the run's
recorded config, ``train.init_from`` loaded, QLoRA's NF4 encoding) in one process at ZeRO
stage 0, hashed, and checked against the manifest before a value is handed out: a
changed source is a ValueError naming the tensor, never a silently different export.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterator

import torch

from mct.persistence.base_manifest import base_mismatch, frozen_digests, read_base
from mct.persistence.files import read_json


def _run_config(checkpoint: Path) -> Any:
    """The ``EngineConfig`` the run of ``checkpoint`` trained with, for one process at
    stage 0 (no offload, no tracking, no context parallelism): what builds its base."""
    from mct.config import EngineConfig
    if not (checkpoint / "trainer.json").is_file():
        raise ValueError(f"{checkpoint} references its frozen base by hash (base.json) and records no run config "
                         f"(a bare Engine.save): build the model as it was, Engine.load the checkpoint and export "
                         f"from the engine (mct.export_engine)")
    config = dict(read_json(checkpoint / "trainer.json")["config"])
    kept = checkpoint.parent.parent / "hf"
    if str(config["model"].get("source", "")).startswith("hf:") and (kept / "config.json").is_file():
        config["model"] = {**config["model"], "source": f"hf:{kept}"}  # the architecture the run kept
    cfg = EngineConfig.from_dict(config)
    r = dataclasses.replace
    return r(cfg, zero=r(cfg.zero, stage=0), offload=r(cfg.offload, optimizer="none", params="none"),
             memory=r(cfg.memory, track=False, enforce=False), parallel=r(cfg.parallel, context=1))


def rebuilt_frozen(checkpoint: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor in the run's parameter dtype, a copy) of every frozen parameter of
    the checkpoint's run, rebuilt from its source and checked against its ``base.json``
    (the values a resumed run computes on: NF4 decoded). Holds the whole model in this process (one rank, stage 0). Raises
    ValueError (one line) when the checkpoint holds no base manifest, the run's config is
    not recorded, the source cannot be built, or the rebuilt base differs from the saved one."""
    from mct.dist import DistContext
    from mct.engine import Engine
    from mct.persistence.init_from import load_pretrained
    from mct.task import build_model, task_for
    from mct.task.gpt import make_optimizer
    checkpoint = Path(checkpoint)
    saved = read_base(checkpoint)
    if saved is None:
        raise ValueError(f"{checkpoint} holds no base.json: it has no frozen base to rebuild")
    cfg = _run_config(checkpoint)
    task = task_for(cfg)
    model, _ = build_model(task, cfg, on_meta=False)
    engine = Engine(model, task.optimizer or make_optimizer(cfg), cfg,
                    param_groups=task.param_groups(model) if task.param_groups else None,
                    ctx=DistContext(device=torch.device("cpu")))  # this process alone, even inside a run
    try:
        if cfg.train.init_from:
            load_pretrained(engine, cfg.train.init_from)
        error = base_mismatch(saved, frozen_digests(engine.frozen), checkpoint)
        if error is not None:
            raise ValueError(error)
        for name, t in engine.frozen.items():
            yield name, t
    finally:
        engine.close()


def frozen_specs(checkpoint: str | Path) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the frozen base a checkpoint references ({} for none)."""
    saved = read_base(Path(checkpoint))
    return {n: tuple(s["shape"]) for n, s in (saved or {}).get("tensors", {}).items()}
