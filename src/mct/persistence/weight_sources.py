"""Weight sources that ``--init-from`` and the adapter import/export read: a Hugging Face
model directory (``model.safetensors``, or shards listed by its index), one
``.safetensors`` file, or an mct run directory or checkpoint (its newest usable
checkpoint). Each reads element ranges of a named tensor as fp32, never a whole tensor
of another rank (safetensors through ``get_slice``; a checkpoint a unit's flat master at
a time)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import torch

from mct.errors import user_error
from mct.persistence.export import pick_checkpoint
from mct.persistence.files import read_json
from mct.persistence.lazy import LazyModule
from mct.persistence.base_manifest import Rebuild, frozen_specs, need_rebuild
from mct.persistence.manifest import FROZEN, MANIFEST
from mct.zero.state_io import param_slices

Read = Callable[[str, int, int], torch.Tensor]
"""(name, start, end) -> fp32 1-D elements [start, end) of the flattened tensor."""

shards = LazyModule("mct.persistence.shards")  # DCP: imported on first use


def _open(path: Path) -> Any:
    """``safetensors.safe_open`` of ``path`` for torch. Imported here, at the first read: a
    training process that reads no weights never loads it (about 1 MiB resident)."""
    from safetensors import safe_open
    return safe_open(str(path), framework="pt")


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
            with _open(f) as handle:
                out.update({k: f for k in handle.keys()})
        except OSError as e:
            raise user_error(e, f) from None
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ValueError(f"--init-from {str(f)!r} is not a readable safetensors file ({e})") from None
    return out


class SafetensorsSource:
    """Shapes and ranged reads of tensors in safetensors files. A file is opened (memory
    mapped) for one read and closed after it: the pages a read touched leave the
    process's resident set with the mapping."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self.shapes: dict[str, tuple[int, ...]] = {}
        for f in sorted(set(files.values())):
            try:
                with _open(f) as handle:
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
        with _open(self.files[name]) as handle:
            if len(shape) == 0:
                return handle.get_tensor(name).reshape(1).float()[start:end]
            row = math.prod(shape[1:])
            r0, r1 = start // row, -(-end // row)
            rows = handle.get_slice(name)[r0:r1].reshape(-1)
            return rows[start - r0 * row:end - r0 * row].float().clone()


class CheckpointSource:
    """Shapes and ranged reads from an mct checkpoint: one unit's flat master in memory
    at a time (the unit of the last read)."""

    def __init__(self, checkpoint: Path, rebuild: Rebuild | None = None) -> None:
        """``rebuild``: what builds the frozen base a checkpoint references by hash
        (``mct.persistence.init_from.rebuilt_frozen``); None: reading one is a ValueError."""
        self.path, self.rebuild = checkpoint, rebuild
        info = read_json(checkpoint / "engine.json")
        self.where: dict[str, tuple[dict[str, Any], int]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for unit in info["units"]:
            for name, shape, start, _ in param_slices(unit):
                self.where[name], self.shapes[name] = (unit, start), shape
        self.frozen = {k[len(FROZEN):]: spec for k, spec in info["tensors"].items() if k.startswith(FROZEN)}
        self.shapes.update({n: tuple(spec["shape"]) for n, spec in self.frozen.items()})
        self.referenced = frozen_specs(checkpoint)  # a base by hash (base.json): rebuilt on first read
        self.shapes.update(self.referenced)
        self._base: dict[str, torch.Tensor] | None = None
        self._unit: tuple[str, torch.Tensor] | None = None

    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        if name in self.referenced:
            if self._base is None:
                self._base = dict(need_rebuild(self.rebuild, self.path)(self.path))
            return self._base[name].reshape(-1)[start:end].float()
        if name in self.frozen:
            t = shards.load_whole(self.path / "engine", FROZEN + name, self.frozen[name])
            return t.reshape(-1)[start:end].float()
        unit, offset = self.where[name]
        if self._unit is None or self._unit[0] != unit["name"]:
            self._unit = None  # free the previous unit before reading the next
            flat = torch.empty(int(unit["numel"]), dtype=torch.float32)
            shards.load_full(self.path / "engine", {f"{unit['name']}/master": flat})
            self._unit = (unit["name"], flat)
        return self._unit[1][offset + start:offset + end]


def open_source(path: str | Path, rebuild: Rebuild | None = None) -> SafetensorsSource | CheckpointSource:
    """The weights at ``path`` (see the module docstring). Raises ValueError (one line)
    for a path that is none of the accepted sources."""
    p = Path(path)
    if p.is_file() and p.suffix.lower() == ".safetensors":
        return SafetensorsSource(_safetensors_files(p))
    if not p.is_dir():
        raise ValueError(f"--init-from {str(path)!r}: no such directory or .safetensors file; pass a Hugging Face "
                         f"model directory, a .safetensors file, or an mct run directory or checkpoint")
    if (p / MANIFEST).is_file() or (p / "checkpoints").is_dir():
        return CheckpointSource(pick_checkpoint(p)[0], rebuild)
    return SafetensorsSource(_safetensors_files(p))
