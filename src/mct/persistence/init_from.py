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
first few, raised identically on every rank before anything changes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
from safetensors import safe_open

from mct.adapters import is_adapter_name
from mct.persistence.lazy import LazyModule
from mct.persistence.manifest import FROZEN, MANIFEST
from mct.persistence.export import pick_checkpoint
from mct.persistence.files import read_json
from mct.zero.state_io import param_slices

from mct.errors import user_error

Read = Callable[[str, int, int], torch.Tensor]
"""(name, start, end) -> fp32 1-D elements [start, end) of the flattened tensor."""

shards = LazyModule("mct.persistence.shards")  # DCP: imported on first use


def _safetensors_files(path: Path) -> dict[str, Path]:
    """name -> file holding it, for one file or an HF directory."""
    if path.is_file():
        files = [path]
    else:
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except OSError as e:
                raise user_error(e, index) from None
            except (ValueError, KeyError, TypeError, RecursionError) as e:
                raise ValueError(f"--init-from {str(path)!r}: {index.name} is not a safetensors index ({e})") from None
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise ValueError(f"--init-from {str(path)!r}: {index.name}'s weight_map is not an object of "
                                 f"file names")
            files = {name: path / file for name, file in weight_map.items()}
            missing = sorted({str(f.name) for f in files.values() if not f.is_file()})
            if missing:
                raise ValueError(f"--init-from {str(path)!r}: {index.name} names shard(s) that are not in the "
                                 f"directory: {', '.join(missing[:3])}; copy them there or save the model again")
            return files
        files = [path / "model.safetensors"] if (path / "model.safetensors").is_file() else sorted(
            path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"--init-from {str(path)!r} holds no safetensors weights (only .safetensors is read, "
                             f"never pickled .bin files; save with save_pretrained(DIR))")
    out: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                out.update({k: f for k in handle.keys()})
        except OSError as e:
            raise user_error(e, f) from None
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ValueError(f"--init-from {str(f)!r} is not a readable safetensors file ({e})") from None
    return out


class _SafetensorsSource:
    """Shapes and ranged reads of tensors in safetensors files. A file is opened (memory
    mapped) for one read and closed after it: the pages a read touched leave the
    process's resident set with the mapping."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self.shapes: dict[str, tuple[int, ...]] = {}
        for f in sorted(set(files.values())):
            try:
                with safe_open(str(f), framework="pt") as handle:
                    self.shapes.update({k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()
                                        if files.get(k) == f})
            except OSError as e:
                raise user_error(e, f) from None
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise ValueError(f"--init-from {str(f)!r} is not a readable safetensors file ({e})") from None
        unlisted = sorted(k for k, f in files.items() if k not in self.shapes)
        if unlisted:
            raise ValueError(f"--init-from: the index lists {', '.join(unlisted[:3])} in {files[unlisted[0]].name}, "
                             f"which does not hold it; save the model again")

    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the flattened tensor, reading the rows around them."""
        shape = self.shapes[name]
        with safe_open(str(self.files[name]), framework="pt") as handle:
            if len(shape) == 0:
                return handle.get_tensor(name).reshape(1).float()[start:end]
            row = math.prod(shape[1:])
            r0, r1 = start // row, -(-end // row)
            rows = handle.get_slice(name)[r0:r1].reshape(-1)
            return rows[start - r0 * row:end - r0 * row].float().clone()


class _CheckpointSource:
    """Shapes and ranged reads from an mct checkpoint: one unit's flat master in memory
    at a time (the unit of the last read)."""

    def __init__(self, checkpoint: Path) -> None:
        self.path = checkpoint
        info = read_json(checkpoint / "engine.json")
        self.where: dict[str, tuple[dict[str, Any], int]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for unit in info["units"]:
            for name, shape, start, _ in param_slices(unit):
                self.where[name], self.shapes[name] = (unit, start), shape
        self.frozen = {k[len(FROZEN):]: spec for k, spec in info["tensors"].items() if k.startswith(FROZEN)}
        self.shapes.update({n: tuple(spec["shape"]) for n, spec in self.frozen.items()})
        self._unit: tuple[str, torch.Tensor] | None = None

    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        if name in self.frozen:
            spec = self.frozen[name]
            t = torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"]))
            shards.load_full(self.path / "engine", {FROZEN + name: t})
            return t.reshape(-1)[start:end].float()
        unit, offset = self.where[name]
        if self._unit is None or self._unit[0] != unit["name"]:
            self._unit = None  # free the previous unit before reading the next
            flat = torch.empty(int(unit["numel"]), dtype=torch.float32)
            shards.load_full(self.path / "engine", {f"{unit['name']}/master": flat})
            self._unit = (unit["name"], flat)
        return self._unit[1][offset + start:offset + end]


def open_source(path: str | Path) -> _SafetensorsSource | _CheckpointSource:
    """The weights at ``path`` (see the module docstring). Raises ValueError (one line)
    for a path that is none of the accepted sources."""
    p = Path(path)
    if p.is_file() and p.suffix.lower() == ".safetensors":
        return _SafetensorsSource(_safetensors_files(p))
    if not p.is_dir():
        raise ValueError(f"--init-from {str(path)!r}: no such directory or .safetensors file; pass a Hugging Face "
                         f"model directory, a .safetensors file, or an mct run directory or checkpoint")
    if (p / MANIFEST).is_file() or (p / "checkpoints").is_dir():
        return _CheckpointSource(pick_checkpoint(p)[0])
    return _SafetensorsSource(_safetensors_files(p))


def check_names(model: nn.Module, model_shapes: dict[str, tuple[int, ...]], shapes: dict[str, tuple[int, ...]],
                what: str) -> dict[str, str]:
    """Match the source's names to the model's parameters: returns {parameter name (as
    named_parameters) -> source name}. A tied parameter may come under any of its names
    (once); buffers the source also holds are ignored; adapter parameters (``lora_A``,
    ``lora_B``) the source lacks keep their own values (a base model's weights under new
    adapters) and are left out of the result. Raises ValueError naming the
    first few missing or unexpected names, or wrong shapes. ``model_shapes``: each
    parameter's shape (stage 3 frees the module's own tensors between gathers)."""
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    known = {n for names in aliases.values() for n in names} | buffers
    source_of, missing, wrong = {}, [], []
    for name, p in model.named_parameters():
        found = [a for a in aliases[id(p)] if a in shapes]
        if not found:
            if not is_adapter_name(name):
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


def load_pretrained(engine: Any, path: str | Path) -> None:
    """Load the weights at ``path`` into ``engine``'s master shards (and working
    parameters), reading only this rank's ranges. Optimizer state and counters are
    left as they are (a fresh engine: none). Collective at stages 1/2 (as
    ``Engine.load_state_dict``): every rank calls it. Raises ValueError, the engine
    untouched, for a bad source or names/shapes that do not match the model."""
    source = open_source(path)
    state = engine.state_dict()  # under offload: copies of the masters (filled in place below)
    in_units = {name: tuple(shape) for unit in state["units"] for name, shape, _ in unit["params"]}
    frozen = [(n, p) for n, p in engine.model.named_parameters() if n not in in_units]
    source_of = check_names(engine.model, {**in_units, **{n: tuple(p.shape) for n, p in frozen}}, source.shapes,
                            repr(str(path)))
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
    # frozen parameters: this rank's shard of each frozen unit (stages 1-3), or the whole tensor
    engine.frozen.load(lambda name, a, b: source.read(source_of[name], a, b))
