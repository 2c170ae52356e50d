"""``train.init_from``: pretrained weights into the engine's fp32 master shards.

Sources: a Hugging Face model directory (``model.safetensors``, or shards listed by
``model.safetensors.index.json``), one ``.safetensors`` file, or an mct run directory
or checkpoint (its newest usable checkpoint). Names are those of
``model.named_parameters()``; a tied parameter is read once, under whichever of its
names the source holds.

Each rank reads only the element ranges its shards hold: safetensors through
``safe_open(...).get_slice`` (whole rows around the range, never a whole tensor of
another rank), an mct checkpoint one unit's flat master at a time. The values go into
a copy of the rank's own state (``Engine.state_dict()``), which ``Engine.load_state_dict``
validates and loads (resident or offloaded); no rank ever holds the whole model.
Strict: a missing or unexpected name or a wrong shape is one ValueError naming the
first few, raised identically on every rank before anything changes. A model with
adapters reads its adapters and its base as ``mct.persistence.adapter_source`` says (a peft
directory continues its adapters; a base alone leaves them at their initial values).

``rebuilt_frozen``: the frozen base of a checkpoint that references it (``base.json``),
built exactly as its run built it (``task_for`` of the run's recorded config, this module's
``load_pretrained`` of its ``train.init_from``, QLoRA's NF4) in one process at stage 0 and
checked against the manifest. The readers below this module (``weight_sources``,
``export``) take it as their ``rebuild`` argument: a run started from a run rebuilds
through this module again.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn as nn

from mct.adapters import is_adapter_name
from mct.persistence.adapter_source import adapter_init_source, is_peft_dir
from mct.persistence.base_manifest import base_mismatch, frozen_digests, read_base
from mct.persistence.files import read_json
from mct.persistence.weight_sources import open_source  # noqa: F401 - re-exported: the --init-from sources


def check_names(model: nn.Module, model_shapes: dict[str, tuple[int, ...]], shapes: dict[str, tuple[int, ...]],
                what: str, keep: set[str] = frozenset()) -> dict[str, str]:
    """Match the source's names to the model's parameters: returns {parameter name (as
    named_parameters) -> source name}. A tied parameter may come under any of its names
    (once); buffers the source also holds are ignored; adapter parameters (``lora_A``,
    ``lora_B``) the source lacks keep their own values (a base model's weights under new
    adapters), as do parameters in ``keep``; both are left out of the result. Raises
    ValueError naming the first few missing or unexpected names, or wrong shapes.
    ``model_shapes``: each parameter's shape (stage 3 frees the module's own tensors
    between gathers)."""
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    known = {n for names in aliases.values() for n in names} | buffers
    source_of, missing, wrong = {}, [], []
    for name, p in model.named_parameters():
        found = [a for a in aliases[id(p)] if a in shapes]
        if not found:
            if name not in keep and not is_adapter_name(name):
                missing.append(name)
            continue
        source_of[name] = found[0]
        if tuple(shapes[found[0]]) != tuple(model_shapes[name]):
            wrong.append(f"{found[0]} {list(shapes[found[0]])} (model: {list(model_shapes[name])})")
    unexpected = sorted(n for n in shapes if n not in known)
    for label, bad in (("missing", missing), ("unexpected", unexpected), ("wrong shapes", wrong)):
        if bad:
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            raise ValueError(f"--init-from {what}: {label}: {', '.join(bad[:3])}{more}; the weights must be those "
                             f"of this model (names as model.named_parameters())")
    return source_of


def _source_for(engine: Any, path: str | Path) -> tuple[Any, set[str]]:
    """The source ``load_pretrained`` reads for ``engine``'s model, and the parameter names
    it may leave as they are (``adapter_source``, for a model with adapters)."""
    names = [n for n, _ in engine.model.named_parameters()]
    peft = is_peft_dir(Path(path))
    if not any(is_adapter_name(n) for n in names):
        if peft:
            raise ValueError(f"--init-from {str(path)!r} is a peft adapter: set adapter.kind = 'lora' (with the "
                             f"adapter's rank, alpha and targets) to continue it")
        return open_source(path, rebuilt_frozen), set()
    cfg = engine.config
    source = None if peft else open_source(path, rebuilt_frozen)
    return adapter_init_source(path, source, names, cfg.adapter, cfg.model.source)


def load_pretrained(engine: Any, path: str | Path) -> None:
    """Load the weights at ``path`` into ``engine``'s master shards (and working
    parameters), reading only this rank's ranges. Optimizer state and counters are
    left as they are (a fresh engine: none). Collective at stages 1/2 (as
    ``Engine.load_state_dict``): every rank calls it. Raises ValueError, the engine
    untouched, for a bad source or names/shapes that do not match the model."""
    source, keep = _source_for(engine, path)
    state = engine.state_dict()  # under offload: copies of the masters (filled in place below)
    in_units = {name: tuple(shape) for unit in state["units"] for name, shape, _ in unit["params"]}
    frozen = [(n, p) for n, p in engine.model.named_parameters() if n not in in_units]
    source_of = check_names(engine.model, {**in_units, **{n: tuple(p.shape) for n, p in frozen}}, source.shapes,
                            repr(str(path)), keep)
    tensors = dict(state["tensors"])
    for unit in state["units"]:
        key = f"{unit['name']}/master"
        piece = tensors[key]
        lo = state["extents"][key][0]
        hi = lo + piece.numel()
        # Offloaded masters come as copies: fill them. Resident ones are the live state, which
        # must not change before load_state_dict has validated everything: fill a new tensor.
        # Parameters the source lacks (new adapters) keep their values.
        new = piece if engine.config.offload.enabled else piece.detach().to("cpu", torch.float32, copy=True)
        for name, shape, offset in unit["params"]:
            a, b = max(lo, offset), min(hi, offset + math.prod(shape))
            if a < b and name in source_of:
                new[a - lo:b - lo] = source.read(source_of[name], a - offset, b - offset)
        tensors[key] = new.to(piece.device)
    engine.load_state_dict({**state, "tensors": tensors})
    # frozen parameters: this rank's shard of each frozen unit (stages 1-3), or the whole tensor;
    # one the source lacks (the base of a module:factory model continued from a peft directory) stays
    engine.frozen.load(lambda name, a, b: source.read(source_of[name], a, b) if name in source_of else None)


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
