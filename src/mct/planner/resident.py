"""The process model a plan's rows use (``mct.memory.process_peak``): the runtime baseline
for the model's library on this machine (``mct.memory.baseline``), the device and the
config's ``memory.host_malloc``."""

from __future__ import annotations

import json
from pathlib import Path

from mct.config import EngineConfig
from mct.memory.baseline import cached_baseline, runtime_baseline
from mct.memory.process_peak import ProcessModel
from mct.memory.tracker import format_bytes
from mct.task.spec import Task


DYNAMO = "torch._dynamo"
"""The module a run that saves sharded state loads at its save (``_added``)."""


def library_modules(task: Task) -> tuple[str, ...]:
    """The model library modules a training process of ``task`` imports beyond torch and mct:
    for a Hugging Face directory, transformers' modeling module of its ``model_type``; none
    for the built-in GPT and for a user's factory (its own imports are not counted)."""
    if not task.hf_dir:
        return ()
    try:
        model_type = json.loads((Path(task.hf_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        model_type = None
    if not isinstance(model_type, str) or not model_type.isidentifier():
        return ("transformers",)
    return (f"transformers.models.{model_type}.modeling_{model_type}",)


def process_model(task: Task, cfg: EngineConfig, device: str, *, measure: bool = True) -> tuple[ProcessModel | None, str]:
    """(model, note): the process model for ``task``'s rows under ``cfg`` on ``device``, and a
    note ('' or why there is none). The baseline comes from the cache; when none is cached it is
    measured (a few seconds, then cached) unless ``measure`` is False, as on a training rank,
    which gets None. A library that cannot be imported or a failed probe: None and the reason.
    On 'cuda' nothing is measured: nvidia-smi counts the CUDA context, not the host's baseline."""
    if device == "cuda":
        return ProcessModel(0, device, cfg.memory.host_malloc), ""
    modules = library_modules(task)
    baseline = cached_baseline(modules)
    if baseline is None and measure:
        try:
            baseline, _ = runtime_baseline(modules)
        except (ValueError, RuntimeError, OSError) as e:
            return None, f"no process peak: the runtime baseline could not be measured ({e})"
    if baseline is None:
        return None, "no process peak: no runtime baseline cached (mct calibrate)"
    every = cfg.train.checkpoint_every
    # a save before the last step leaves the checkpoint writer imported for the steps after it
    writer = _added(baseline, modules, False, measure, less=True) if every <= 0 or every >= cfg.train.steps else 0
    return ProcessModel(baseline, device, cfg.memory.host_malloc, _added(baseline, (*modules, DYNAMO), True, measure),
                        writer, steps=cfg.train.steps, snapshot_every=cfg.train.snapshot_every), ""


def _added(baseline: int, modules: tuple[str, ...], writer: bool, measure: bool, less: bool = False) -> int:
    """What one import adds to ``baseline`` (the baseline of the model's modules with the
    checkpoint writer): measured as the baseline of ``modules`` and ``writer``, less ``baseline``
    (``torch._dynamo``: a run that saves sharded state loads it, ``DTensor`` is wrapped for it),
    or ``baseline`` less it (``less``: the checkpoint writer, left out). 0 where that is
    not cached and may not be measured, or cannot be."""
    value = cached_baseline(modules, writer=writer)
    if value is None and measure:
        try:
            value, _ = runtime_baseline(modules, writer=writer)
        except (ValueError, RuntimeError, OSError):
            value = None
    if value is None:
        return 0
    return max(0, baseline - value if less else value - baseline)


def check_process_floor(task: Task, cfg: EngineConfig, device: str) -> None:
    """Refuse a budget that no configuration can meet: where ``memory.budget`` counts the
    process and is enforced or planned for (``auto``), it must exceed what a training process of
    ``task`` holds before its first tensor (the runtime baseline, measured now if not cached,
    plus the allocator's fixed overhead; on CUDA the context). Raises ValueError (one line: the
    budget, the floor and its terms, the two ways out); a no-op where no baseline can be known."""
    mem = cfg.memory
    auto = cfg.zero.stage == "auto" or cfg.checkpointing.policy == "auto"
    if mem.budget is None or not mem.counts_process or not (mem.enforce or auto):
        return
    process, _ = process_model(task, cfg, device)
    if process is None:
        return
    floor = process.predict(0, {}, offload=cfg.offload.enabled)
    if mem.budget <= floor.total:
        raise ValueError(
            f"memory.budget = {format_bytes(mem.budget)} is below what any configuration's process needs on this "
            f"machine: {format_bytes(floor.total)} before its first tensor (runtime baseline "
            f"{format_bytes(floor.baseline)} + allocator {format_bytes(floor.allocator_overhead)}; {floor.counts}); "
            f"raise memory.budget above it (`mct plan --budget SIZE` shows each configuration's process peak), or set "
            f"memory.budget_counts=tensors to budget tensor bytes only")
