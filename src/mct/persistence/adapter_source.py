"""``train.init_from`` for a model with adapters (``adapter.kind = 'lora'``): which weights
come from where.

- A source holding LoRA tensors (a peft directory as ``mct export --format peft`` or peft's
  ``save_pretrained`` writes it, or an mct run directory / checkpoint of an adapter run)
  continues those adapters: A and B are loaded; the base comes from the source when it
  holds it (an mct run of the same base), else from the model source (``hf:DIR``'s
  safetensors). A factory model keeps the base it builds; the built-in GPT has no base
  outside a run, so a peft directory alone is refused for it.
- A source holding no LoRA tensors (an HF directory of the base, a run of full training)
  gives the base; the adapters keep their initial values (B = 0: the base's function).

Rank, alpha and the adapted layers must be the run's: a mismatch is one ValueError naming
the config key, or the tensor, and both values.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

import torch

from mct.config import AdapterConfig
from mct.adapters import is_adapter_name as is_adapter
from mct.persistence.adapter_export import LORA_A, PEFT_CONFIG, PEFT_PREFIX, PEFT_WEIGHTS, module_of
from mct.persistence.files import read_json


class WeightSource(Protocol):
    """What ``load_pretrained`` reads: each tensor's shape, and ranged fp32 reads."""

    shapes: dict[str, tuple[int, ...]]

    def read(self, name: str, start: int, end: int) -> torch.Tensor: ...


class Renamed:
    """``source`` under other names: ``names`` maps a model name to the source's."""

    def __init__(self, source: WeightSource, names: dict[str, str]) -> None:
        self.source, self.names = source, names
        self.shapes = {n: source.shapes[s] for n, s in names.items()}

    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        return self.source.read(self.names[name], start, end)


class Combined:
    """The adapters from one source, the base from another (or none: kept as built)."""

    def __init__(self, adapters: WeightSource, base: WeightSource | None) -> None:
        self.parts = {n: adapters for n in adapters.shapes if is_adapter(n)}
        if base is not None:
            self.parts.update({n: base for n in base.shapes if not is_adapter(n)})
        self.shapes = {n: src.shapes[n] for n, src in self.parts.items()}

    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        return self.parts[name].read(name, start, end)


def is_peft_dir(path: Path) -> bool:
    """Is ``path`` a peft adapter directory (adapter_config.json + adapter_model.safetensors)?"""
    return path.is_dir() and (path / PEFT_CONFIG).is_file() and (path / PEFT_WEIGHTS).is_file()


def open_peft(path: Path) -> tuple[WeightSource, dict[str, Any]]:
    """The LoRA tensors of a peft directory under mct's names (peft's ``base_model.model.``
    prefix dropped), and its adapter_config.json. Raises ValueError (one line) for an
    adapter mct does not train (not LoRA, DoRA, rsLoRA, trained biases, saved modules)."""
    from mct.persistence.weight_sources import SafetensorsSource
    try:
        config = json.loads((path / PEFT_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"--init-from {str(path)!r}: {PEFT_CONFIG} is not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--init-from {str(path)!r}: {PEFT_CONFIG} is not a JSON object")
    unsupported = [f"{k} = {config.get(k)!r}" for k, ok in (("peft_type", "LORA"), ("use_dora", False),
                                                            ("use_rslora", False), ("bias", "none"))
                   if config.get(k, ok) != ok]
    if config.get("modules_to_save"):
        unsupported.append(f"modules_to_save = {config['modules_to_save']!r}")
    if unsupported:
        raise ValueError(f"--init-from {str(path)!r}: the adapter has {', '.join(unsupported)}; mct continues "
                         f"plain LoRA adapters only (peft_type LORA, no DoRA/rsLoRA, bias none)")
    source = SafetensorsSource({k: path / PEFT_WEIGHTS for k in _keys(path / PEFT_WEIGHTS)})
    names = {}
    for key in source.shapes:
        name = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        if not is_adapter(name):
            raise ValueError(f"--init-from {str(path)!r}: {key} is no LoRA tensor (*{LORA_A} or *.lora_B.weight); "
                             f"mct continues plain LoRA adapters only")
        names[name] = key
    return Renamed(source, names), config


def _keys(file: Path) -> list[str]:
    from safetensors import safe_open
    try:
        with safe_open(str(file), framework="pt") as handle:
            return list(handle.keys())
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"--init-from {str(file)!r} is not a readable safetensors file ({e})") from None


def _recorded_adapter(path: Path, peft_config: dict[str, Any] | None) -> tuple[int, float] | None:
    """(rank, alpha) the source's adapters were trained with, when it says."""
    if peft_config is not None:
        return int(peft_config.get("r", 0)), float(peft_config.get("lora_alpha", 0.0))
    # a run dir, its checkpoints/step_N, or its model.safetensors
    meta = next((d / "metadata.json" for d in (path, path.parent.parent, path.parent)
                 if (d / "metadata.json").is_file()), None)
    if meta is None:
        return None
    try:
        section = (read_json(meta).get("config") or {}).get("adapter") or {}
    except (ValueError, AttributeError):
        return None
    return (int(section["rank"]), float(section["alpha"])) if "rank" in section and "alpha" in section else None


def check_adapters(what: str, model_names: list[str], source: WeightSource, adapter: AdapterConfig,
                   recorded: tuple[int, float] | None) -> None:
    """Raise ValueError (one line: the key or tensor and both values) unless the source's
    adapters are the model's: the same adapted layers, rank and alpha."""
    if recorded is not None:
        for key, theirs, ours in (("adapter.rank", recorded[0], adapter.rank),
                                  ("adapter.alpha", recorded[1], adapter.alpha)):
            if theirs != ours:
                raise ValueError(f"--init-from {what}: its adapters were trained with {key} = {theirs}, this run "
                                 f"has {key} = {ours}; set {key} = {theirs} to continue them")
    ours = {module_of(n) for n in model_names if is_adapter(n)}
    theirs = {module_of(n) for n in source.shapes if is_adapter(n)}
    for label, extra in (("this run adapts", ours - theirs), ("the source adapts", theirs - ours)):
        if extra:
            first = sorted(extra)[0]
            raise ValueError(f"--init-from {what}: {label} {first} (and {len(extra) - 1} more) which the other "
                             f"does not ({len(ours)} adapted layers here, {len(theirs)} in the source); set "
                             f"adapter.targets to the layers the adapters were trained on")


def adapter_init_source(path: str | Path, source: WeightSource, model_names: list[str], adapter: AdapterConfig,
                        model_source: str) -> tuple[WeightSource, set[str]]:
    """The source ``load_pretrained`` reads for a model with adapters (see the module
    docstring), and the names it may leave as built. ``source``: what ``open_source``
    made of ``path`` (None for a peft directory). Raises ValueError (one line) for
    adapters that are not the model's, or a peft directory with no base to go with."""
    p, what = Path(path), repr(str(path))
    peft_config = None
    if source is None:
        source, peft_config = open_peft(p)
    adapters = [n for n in model_names if is_adapter(n)]
    base = [n for n in model_names if not is_adapter(n)]
    if not any(is_adapter(n) for n in source.shapes):  # the base alone: adapters stay at init
        return Combined(Renamed(source, {}), source), set(adapters)
    check_adapters(what, model_names, source, adapter, _recorded_adapter(p, peft_config))
    if all(n in source.shapes for n in base):  # an adapter run of mct: it holds its base
        return source, set()
    if model_source.startswith("hf:"):
        from mct.persistence.weight_sources import open_source
        return Combined(source, open_source(model_source[3:])), set()
    if model_source == "gpt":
        raise ValueError(f"--init-from {what} holds adapters only, and the built-in GPT (model.source = 'gpt') "
                         f"has no base weights outside a run: pass the adapter run's directory (it holds its base)")
    return Combined(source, None), set(base)  # a factory's model: the base it builds
