"""``mct export``: consolidated fp32 weights from a checkpoint, in one process.

No process group and no model are needed: each unit's global flat master is read from
DCP (whatever world size wrote it), cut into its parameters by the unit layout saved in
``engine.json``, and freed before the next; peak memory is the model's fp32 weights plus
one unit. The file holds the names of ``model.named_parameters()``, as the run's own
``model.safetensors``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from mct.persistence import shards
from mct.persistence.checkpoint import FROZEN, MANIFEST, verify_checkpoint
from mct.persistence.files import fsync_dir, read_json
from mct.persistence.run_dir import newest_usable
from mct.zero.state import param_slices


def pick_checkpoint(source: str | Path) -> tuple[Path, str | None]:
    """A checkpoint directory, or a run directory's newest usable checkpoint. Returns
    (path, warning about skipped damaged ones or None). Raises ValueError (one line)."""
    src = Path(source)
    if not src.is_dir():
        raise ValueError(f"{str(src)!r} is not a directory: pass a run directory or one of its "
                         f"checkpoints/step_N directories")
    if (src / MANIFEST).is_file():
        verify_checkpoint(src)
        return src, None
    if (src / "checkpoints").is_dir() or (src / "metadata.json").is_file():
        path, _, warning = newest_usable(src)
        return path, warning
    raise ValueError(f"{str(src)!r} is neither a run directory nor a complete checkpoint (no {MANIFEST})")


def consolidated_state(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """Every parameter in fp32, names as ``model.named_parameters()``, from a verified
    checkpoint. Reads one unit at a time."""
    checkpoint = Path(checkpoint)
    info = read_json(checkpoint / "engine.json")
    out: dict[str, torch.Tensor] = {}
    for unit in info["units"]:
        flat = torch.empty(int(unit["numel"]), dtype=torch.float32)
        shards.load_full(checkpoint / "engine", {f"{unit['name']}/master": flat})
        for name, shape, start, end in param_slices(unit):
            out[name] = flat[start:end].view(shape).clone()
        del flat
    for key, spec in info["tensors"].items():
        if key.startswith(FROZEN):
            t = torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"]))
            shards.load_full(checkpoint / "engine", {key: t})
            out[key[len(FROZEN):]] = t.float()
    return out


def export(source: str | Path, out: str | Path) -> tuple[Path, str | None]:
    """Write the consolidated fp32 weights of ``source`` (run or checkpoint directory)
    to the safetensors file ``out`` (temp file, fsync, rename). Returns (checkpoint
    used, warning or None). Raises ValueError (one line) for a bad source or target."""
    out = Path(out)
    if out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a directory; pass a file name such as model.safetensors")
    if not out.parent.is_dir():
        raise ValueError(f"--out {str(out)!r}: directory {str(out.parent)!r} does not exist")
    path, warning = pick_checkpoint(source)
    state = consolidated_state(path)
    from safetensors.torch import save_file
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        save_file(state, str(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ValueError(f"--out {str(out)!r}: cannot write ({e.strerror or e})") from None
    fsync_dir(out.parent)
    return path, warning


def export_weights(engine: Any, path: Path, ctx: Any) -> None:
    """Consolidated fp32 weights of a live engine (names as ``model.named_parameters()``),
    written by rank 0 to a temporary file and renamed. Collective: every rank must call it."""
    state = engine.full_state_dict()
    if ctx.is_main:
        from safetensors.torch import save_file
        tmp = path.with_suffix(".tmp")
        save_file({k: v.contiguous().cpu() for k, v in state.items()}, str(tmp))
        tmp.replace(path)
