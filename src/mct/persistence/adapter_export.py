"""Adapters out of a run: ``mct export --format peft`` (the LoRA tensors and their config,
as ``peft.PeftModel.from_pretrained`` loads them) and the merged weights ``--merge`` writes
(``W + B A * alpha/rank`` for each adapted ``nn.Linear``, adapters gone).

An adapted module at path P holds ``P.lora_A.weight`` [rank, in] and ``P.lora_B.weight``
[out, rank] (``mct.adapters``): peft's names without its ``base_model.model.`` prefix and
its ``.default`` adapter name. The adapter tensors are small: they are read whole, one
checkpoint unit at a time (``init_from.CheckpointSource``), never with the base.
What the run trained (rank, alpha, dropout, model source) is read from the run's
``metadata.json``, as ``mct train`` recorded it.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from mct.adapters import is_adapter_name as is_adapter
from mct.errors import WRITE, user_error
from mct.outputs import check_dir_output, install_dir, temporary
from mct.persistence.export import pick_checkpoint
from mct.persistence.files import read_json
from mct.persistence.run_dir import check_outside_runs
from mct.persistence.safetensors_out import SafetensorsWriter

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"
PEFT_PREFIX = "base_model.model."
PEFT_WEIGHTS, PEFT_CONFIG = "adapter_model.safetensors", "adapter_config.json"
PEFT_WRITES = (PEFT_WEIGHTS, PEFT_CONFIG)
"""What a peft export directory holds: what ``--force`` may replace."""


def module_of(name: str) -> str:
    """The adapted module's path of a LoRA tensor name (``P.lora_A.weight`` -> ``P``)."""
    assert name.endswith((LORA_A, LORA_B)), name
    return name[:-len(LORA_A)]


@dataclass(frozen=True)
class RunAdapter:
    """What a run's ``[adapter]`` trained: kind, rank, alpha, dropout, and the base's
    Hugging Face directory (None for other model sources)."""

    kind: str
    rank: int
    alpha: float
    dropout: float
    base_dir: str | None

    @property
    def scale(self) -> float:
        """The factor on ``B A`` (peft's ``scaling``, without rsLoRA)."""
        return self.alpha / self.rank


def run_adapter(checkpoint: Path, flag: str) -> RunAdapter:
    """The ``[adapter]`` section of the run that wrote ``checkpoint`` (its run directory's
    metadata.json). Raises ValueError (one line, naming ``flag``) when the checkpoint is
    not in a run directory or the run trained no adapters."""
    meta = checkpoint.parent.parent / "metadata.json"
    if not meta.is_file():
        raise ValueError(f"{flag} reads what the run trained from its metadata.json, and {str(checkpoint)!r} is "
                         f"not inside a run directory; pass the run directory made by mct train")
    config = read_json(meta).get("config") or {}
    section = config.get("adapter") or {}
    kind = section.get("kind", "none")
    if kind == "none":
        raise ValueError(f"{flag} needs a run that trained adapters (adapter.kind = 'lora' or 'qlora'); "
                         f"{str(checkpoint.parent.parent)!r} trained every weight (adapter.kind = 'none'): export "
                         f"it with --out FILE.safetensors or --format hf")
    source = (config.get("model") or {}).get("source", "gpt")
    return RunAdapter(kind, int(section.get("rank", 8)), float(section.get("alpha", 16.0)),
                      float(section.get("dropout", 0.0)), source[3:] if source.startswith("hf:") else None)


def adapter_tensors(checkpoint: Path, spec: RunAdapter) -> dict[str, torch.Tensor]:
    """Every LoRA tensor of ``checkpoint`` in fp32, names as named_parameters, checked
    in pairs: each adapted module has both, shaped [rank, in] and [out, rank]. Raises
    ValueError naming the first bad tensor (a damaged or foreign checkpoint)."""
    from mct.persistence.weight_sources import CheckpointSource
    source = CheckpointSource(checkpoint)
    out = {n: source.read(n, 0, math.prod(s)).view(s).clone() for n, s in source.shapes.items() if is_adapter(n)}
    if not out:
        raise ValueError(f"{checkpoint} holds no LoRA tensors (*{LORA_A}) though its run trained adapters; "
                         f"the checkpoint is not that run's")
    for module in sorted({module_of(n) for n in out}):
        a, b = out.get(module + LORA_A), out.get(module + LORA_B)
        if a is None or b is None:
            raise ValueError(f"{checkpoint}: {module} has only one of lora_A / lora_B")
        if a.shape[0] != spec.rank or b.shape[1] != spec.rank:
            raise ValueError(f"{checkpoint}: {module}{LORA_A} {list(a.shape)} and {module}{LORA_B} "
                             f"{list(b.shape)} do not have the run's adapter.rank = {spec.rank}")
    return out


def stored_in_out(checkpoint: Path, modules: list[str]) -> set[str]:
    """Which of the adapted ``modules`` store their weight as [in, out] (transformers'
    ``Conv1D``, GPT-2's projections; peft's ``fan_in_fan_out``) rather than nn.Linear's
    [out, in]: read off the run's base model, built on the meta device from its recorded
    config (no values, nothing allocated). Raises ValueError (one line) when the run's
    model source can no longer be built."""
    from mct.adapters import linear_shape
    from mct.config import EngineConfig
    from mct.task import task_for
    run_dir = checkpoint.parent.parent
    config = dict(read_json(run_dir / "metadata.json")["config"])
    config["adapter"] = {"kind": "none"}  # the base alone: its layers' types are what matters
    if (run_dir / "hf" / "config.json").is_file():  # the run keeps its own copy of the architecture
        config["model"] = {**config["model"], "source": f"hf:{run_dir / 'hf'}"}
    with torch.device("meta"):
        model = task_for(EngineConfig.from_dict(config)).model_fn()
    found = dict(model.named_modules())
    missing = [m for m in modules if m not in found or linear_shape(found[m]) is None]
    if missing:
        raise ValueError(f"{checkpoint}: the adapted layer {missing[0]} is no linear layer of the run's model "
                         f"({config['model'].get('source', 'gpt')}); the checkpoint is not that run's")
    return {m for m in modules if not isinstance(found[m], torch.nn.Linear)}


def merged_deltas(tensors: dict[str, torch.Tensor], scale: float, in_out: set[str]) -> dict[str, torch.Tensor]:
    """``{P.weight: B A * scale}`` (fp32) for each adapted module P of ``tensors``, transposed
    for the modules of ``in_out`` (weights stored [in, out])."""
    out = {}
    for m in sorted({module_of(n) for n in tensors}):
        delta = (tensors[m + LORA_B] @ tensors[m + LORA_A]) * scale
        out[m + ".weight"] = delta.T.contiguous() if m in in_out else delta
    return out


def peft_config(spec: RunAdapter, modules: list[str], in_out: set[str]) -> dict:
    """peft's ``adapter_config.json`` (a ``LoraConfig``) for ``modules`` (the adapted
    module paths, listed exactly: peft matches a list entry by the whole path); ``in_out``:
    those storing [in, out] weights (all or none, as peft's one ``fan_in_fan_out``)."""
    if in_out and set(modules) - in_out:
        raise ValueError(f"--format peft: the run adapted both nn.Linear and Conv1D layers ({sorted(in_out)[0]}), "
                         f"which one peft config (fan_in_fan_out) cannot describe; export with --merge instead")
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM" if spec.base_dir is not None else None,
            "base_model_name_or_path": spec.base_dir, "r": spec.rank, "lora_alpha": spec.alpha,
            "lora_dropout": spec.dropout, "target_modules": modules, "bias": "none",
            "fan_in_fan_out": bool(in_out), "use_rslora": False, "use_dora": False, "init_lora_weights": True,
            "modules_to_save": None, "inference_mode": True}


def write_peft(checkpoint: Path, out: Path, spec: RunAdapter) -> None:
    """Write ``adapter_model.safetensors`` and ``adapter_config.json`` of ``checkpoint``
    into the existing directory ``out``."""
    tensors = adapter_tensors(checkpoint, spec)
    names = sorted(tensors)
    writer = SafetensorsWriter(out / PEFT_WEIGHTS, {PEFT_PREFIX + n: (torch.float32, tuple(tensors[n].shape))
                                                    for n in names}, metadata={"format": "pt"})
    try:
        for n in names:
            writer.put(PEFT_PREFIX + n, tensors[n])
    except BaseException:
        writer.abort()
        raise
    writer.commit()
    modules = sorted({module_of(n) for n in names})
    config = peft_config(spec, modules, stored_in_out(checkpoint, modules))
    (out / PEFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def export_peft(source: str | Path, out: str | Path, force: bool = False) -> tuple[Path, str | None]:
    """``mct export SOURCE --format peft --out DIR``: the adapters of the newest usable
    checkpoint of an adapter run, as peft saves them. ``out`` must be new, empty or (with
    ``force``) an earlier peft export; it appears complete or not at all. Returns
    (checkpoint used, warning or None). Raises ValueError (one line) for a run without
    adapters, a bad source or target."""
    out = check_dir_output(out, "--out", force=force, writes=PEFT_WRITES, command="mct export --format peft",
                           owned=check_outside_runs)
    path, warning = pick_checkpoint(source)
    spec = run_adapter(path, "--format peft")
    tmp = temporary(out)
    try:
        tmp.mkdir()
        write_peft(path, tmp, spec)
        install_dir(tmp, out, force=force)
    except OSError as e:
        raise user_error(e, e.filename or out, WRITE) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path, warning


def deltas_for(checkpoint: Path, names: list[str], merge: bool, flag: str) -> dict[str, torch.Tensor] | None:
    """What an export of ``checkpoint`` (its parameter ``names``) adds to the base weights:
    with ``merge``, ``merged_deltas`` of the run's adapters; without, None. Raises
    ValueError (one line, naming ``flag``) for ``merge`` of a run without adapters."""
    if not merge:
        return None
    spec = run_adapter(checkpoint, flag)
    if not any(is_adapter(n) for n in names):
        raise ValueError(f"{flag}: {checkpoint} holds no LoRA tensors (*{LORA_A}) though its run trained adapters; "
                         f"the checkpoint is not that run's")
    tensors = adapter_tensors(checkpoint, spec)
    return merged_deltas(tensors, spec.scale, stored_in_out(checkpoint, sorted({module_of(n) for n in tensors})))
