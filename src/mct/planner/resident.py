"""The process model a plan's rows use (``mct.memory.process_peak``): the runtime baseline
for the model's library on this machine (``mct.memory.baseline``), the device and the
config's ``memory.host_malloc``."""

from __future__ import annotations

import json
from pathlib import Path

from mct.config import EngineConfig
from mct.memory.baseline import cached_baseline, runtime_baseline
from mct.memory.process_peak import ProcessModel
from mct.task.spec import Task


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
    which gets None. A library that cannot be imported or a failed probe: None and the reason."""
    modules = library_modules(task)
    baseline = cached_baseline(modules)
    if baseline is None and measure:
        try:
            baseline, _ = runtime_baseline(modules)
        except (ValueError, RuntimeError, OSError) as e:
            return None, f"no process peak: the runtime baseline could not be measured ({e})"
    if baseline is None:
        return None, "no process peak: no runtime baseline cached (mct calibrate)"
    return ProcessModel(baseline, device, cfg.memory.host_malloc), ""
