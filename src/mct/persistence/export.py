"""Consolidated fp32 weights (safetensors), streamed: from a checkpoint (``mct export``,
one process) or from a live engine (a run's ``model.safetensors``, collective).

From a checkpoint no process group and no model are needed: each unit's global flat
master is read from DCP (whatever world size wrote it), cut into its parameters by the
unit layout saved in ``engine.json``, written, and freed before the next. From an
engine, one unit is all-gathered at a time. Either way peak memory is one unit, not the
model; the file holds the names of ``model.named_parameters()`` and is written through
a temporary and a rename (see ``safetensors_out``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Protocol

import torch

from mct.adapters import is_adapter_name
from mct.dist import agree
from mct.outputs import check_file_output
from mct.persistence.lazy import LazyModule
from mct.persistence.base_manifest import BASE
from mct.persistence.base_manifest import Rebuild, frozen_specs, need_rebuild
from mct.persistence.manifest import FROZEN, MANIFEST, verify_checkpoint
from mct.persistence.files import read_json
from mct.persistence.run_dir import RunLock, check_outside_runs, newest_usable
from mct.persistence.safetensors_out import SafetensorsWriter
from mct.zero.state_io import param_slices

shards = LazyModule("mct.persistence.shards")  # DCP: imported on first use


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
        path, _, warning = newest_usable(src, using="exporting")
        return path, warning
    raise ValueError(f"{str(src)!r} is neither a run directory nor a complete checkpoint (no {MANIFEST})")


def consolidated_state(checkpoint: str | Path, rebuild: Rebuild | None = None) -> dict[str, torch.Tensor]:
    """Every parameter in fp32, names as ``model.named_parameters()``, from a verified
    checkpoint, all in memory (``export`` streams the same tensors to a file instead).
    ``rebuild``: for a checkpoint that references its frozen base (``base_manifest.Rebuild``)."""
    return {name: t.clone() for name, t in _checkpoint_items(Path(checkpoint), rebuild)}


def checkpoint_specs(checkpoint: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    info = read_json(checkpoint / "engine.json")
    specs = {name: (torch.float32, shape) for unit in info["units"] for name, shape, _, _ in param_slices(unit)}
    for key, spec in info["tensors"].items():
        if key.startswith(FROZEN):
            specs[key[len(FROZEN):]] = (torch.float32, tuple(spec["shape"]))
    specs.update({name: (torch.float32, shape) for name, shape in frozen_specs(checkpoint).items()})
    return specs


def _checkpoint_items(checkpoint: Path, rebuild: Rebuild | None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, fp32 tensor) from a verified checkpoint, one unit read at a time: each
    tensor is a view valid until the next unit is read."""
    info = read_json(checkpoint / "engine.json")
    for unit in info["units"]:
        flat = torch.empty(int(unit["numel"]), dtype=torch.float32)
        shards.load_full(checkpoint / "engine", {f"{unit['name']}/master": flat})
        for name, shape, start, end in param_slices(unit):
            yield name, flat[start:end].view(shape)
        del flat
    for key, spec in info["tensors"].items():
        if key.startswith(FROZEN):
            yield key[len(FROZEN):], shards.load_whole(checkpoint / "engine", key, spec).float()
    if (checkpoint / BASE).is_file():  # referenced by hash: rebuilt from its source and checked
        for name, t in need_rebuild(rebuild, checkpoint)(checkpoint):
            yield name, t.float()


class Exportable(Protocol):
    """What ``export_engine`` needs of an engine (``mct.Engine`` is one)."""

    comm: Any

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]: ...

    def full_state_items(self) -> Iterator[tuple[str, torch.Tensor]]: ...


def export_engine(engine: Exportable, path: str | Path) -> None:
    """Write the engine's consolidated fp32 weights (names as ``named_parameters()``)
    to the safetensors file ``path`` (replaced once the new one is complete): one unit
    gathered at a time, rank 0 writing each tensor as it arrives. Collective: every
    rank calls it. Raises ValueError on every rank (one line: path and bytes needed)
    when rank 0 cannot write, the old file untouched and no temporary left."""
    main = engine.comm.rank == 0
    writer, error = None, None
    if main:
        try:
            writer = SafetensorsWriter(path, {n: (torch.float32, s) for n, s in engine.parameter_shapes().items()})
        except ValueError as e:
            error = str(e)
    agree(error, engine.comm)  # no rank starts gathering while rank 0 cannot write
    for name, t in engine.full_state_items():  # every rank takes part in each gather
        if writer is not None and error is None:
            try:
                writer.put(name, t)
            except ValueError as e:
                error, writer = str(e), None
    if writer is not None:
        try:
            writer.commit()
        except ValueError as e:
            error = str(e)
    agree(error, engine.comm)


def check_target(out: Path, force: bool) -> None:
    """Raise ValueError (one line) unless ``out`` may receive an export: a new file in an
    existing directory, or (``force``) an existing regular file; never a symlink, FIFO,
    device or directory, and never a file of a run's own tree (``mct.outputs``)."""
    check_file_output(out, "--out", force=force, example="model.safetensors", owned=check_outside_runs)


def export_checkpoint(checkpoint: str | Path, out: str | Path, deltas: dict[str, torch.Tensor] | None = None,
                      rebuild: Rebuild | None = None) -> None:
    """Write the verified ``checkpoint``'s consolidated fp32 weights to ``out`` (replaced
    once complete; no target checks: ``export`` makes them for a user's ``--out``). One
    unit in memory at a time. ``deltas``: merged adapters, added to their weights, the
    LoRA tensors left out. ``rebuild``: as ``consolidated_state``. Raises ValueError (one
    line) when the write fails."""
    checkpoint = Path(checkpoint)
    specs = checkpoint_specs(checkpoint)
    if deltas is not None:
        specs = {n: s for n, s in specs.items() if not is_adapter_name(n)}
    writer = SafetensorsWriter(out, specs)
    try:
        for name, t in _checkpoint_items(checkpoint, rebuild):
            if name in specs:
                writer.put(name, t + deltas[name] if deltas is not None and name in deltas else t)
    except BaseException:
        writer.abort()
        raise
    writer.commit()


def finish_weights(run_dir: Path, checkpoint: Path, rebuild: Rebuild | None = None) -> bool:
    """A run stopped between its last checkpoint and its weights export: write
    ``model.safetensors`` from that checkpoint (the same bytes the run would have written).
    Returns whether it wrote it (False: the run had). ``rebuild``: as ``consolidated_state``."""
    if (run_dir / "model.safetensors").is_file():
        return False
    lock = RunLock(run_dir)  # not while the run itself may be writing it
    try:
        if not (run_dir / "model.safetensors").is_file():
            export_checkpoint(checkpoint, run_dir / "model.safetensors", rebuild=rebuild)
            return True
        return False
    finally:
        lock.release()
