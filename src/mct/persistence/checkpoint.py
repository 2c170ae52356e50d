"""One checkpoint directory: write it, check it, load an engine from it.

    <checkpoint>/engine/__<rank>_0.distcp, engine/.metadata   DCP: masters, optimizer state
                                                              (mct.zero.state_io keys)
    <checkpoint>/base.json      rank 0, a run's checkpoint with frozen parameters: its frozen base
                                by content hash and source, not its values
                                (mct.persistence.base_manifest); a bare ``Engine.save`` and
                                checkpoints of older mct embed it as DCP keys ``frozen/<name>``
    <checkpoint>/engine.json    rank 0: steps_done, loss scaler, optimizer hyperparameters,
                                unit layouts, and which tensors are per-element
    <checkpoint>/trainer.json   rank 0: the trainer's state (step, data position, counters,
                                resolved config); absent for a bare ``Engine.save``
    <checkpoint>/rank<r>.json   each rank: its RNG streams (torch CPU/CUDA, numpy, python)
    <checkpoint>/meta.json      the manifest, written last: format, step, world size, ZeRO
                                stage, precision, and size + sha256 of every file above

A checkpoint is complete once ``meta.json`` exists (it is renamed into place after every
other file is fsynced), so a crash at any moment leaves older checkpoints as they were.
"""

from __future__ import annotations

import base64
import random
import shutil
import os
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import torch

from mct.dist import agree
from mct.persistence.base_manifest import BASE, base_manifest, base_mismatch, frozen_digests, read_base
from mct.persistence.lazy import LazyModule
from mct.persistence.files import file_digest, fsync_dir, read_json, write_failure, write_json
from mct.persistence.manifest import CHECKPOINT_FORMAT, FROZEN, MANIFEST, check_layout, read_manifest, verify_checkpoint
from mct.reporting.events import utc_now

shards = LazyModule("mct.persistence.shards")  # DCP takes a second to import: loaded on first use



class Checkpointable(Protocol):
    """What a checkpoint needs of an engine (``mct.Engine`` is one): its state as
    ``state_dict()`` pieces (``streamed_state_dict()``: read one at a time as they are
    written), their loader, its ``layout()``, the communicator, the step counter and its
    frozen parameters."""

    comm: Any
    steps_done: int
    frozen: Any
    """``mct.zero.frozen.FrozenModel``: the frozen parameters (``items()``: collective)."""

    def layout(self) -> dict[str, Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def streamed_state_dict(self) -> tuple[dict[str, Any], dict[str, Callable[[], torch.Tensor]]]: ...

    def load_state_streamed(self, header: dict[str, Any],
                            read_units: Callable[[list[int]], tuple[dict, dict]]) -> None: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...



# ---- RNG streams (per rank) ----
def rng_state() -> dict[str, Any]:
    """This process's RNG streams as JSON-ready values."""
    np_state = np.random.get_state()
    out = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
           "numpy": [np_state[0], np_state[1].tolist(), *[float(x) if isinstance(x, float) else int(x)
                                                           for x in np_state[2:]]],
           "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned (CUDA streams only where CUDA is in use)."""
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), *n[2:]))
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
    if "cuda" in state and torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8) for s in state["cuda"]]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


# ---- save ----
def _engine_pieces(engine: Checkpointable, embed_base: bool) -> tuple[dict[str, Any], dict[str, torch.Tensor],
                                                                     dict[str, list[int]],
                                                                     dict[str, Callable[[], torch.Tensor]]]:
    sd, readers = engine.streamed_state_dict()
    tensors, extents = dict(sd["tensors"]), dict(sd["extents"])
    if embed_base:  # the frozen base by value (else base.json references it by hash)
        for name, t in engine.frozen.items():  # sharded: gathered a unit at a time, copies
            tensors[FROZEN + name] = t
    info = {k: sd[k] for k in ("format", "steps_done", "scaler", "param_groups", "units")}
    info["tensors"] = {k: {"per_element": k in extents, "dtype": str(t.dtype).removeprefix("torch."),
                           "shape": list(t.shape) if k not in extents else None} for k, t in tensors.items()}
    return info, tensors, extents, readers


def save_checkpoint(path: str | Path, engine: Checkpointable, *, step: int, trainer: dict[str, Any] | None = None,
                    rank_state: dict[str, Any] | None = None, embed_base: bool = True) -> None:
    """Write a complete checkpoint into directory ``path`` (created; a leftover without a
    manifest is replaced; a complete one is an error). Collective: every rank calls it,
    and returns once the manifest is in place. ``trainer`` (rank 0's, JSON-ready) and
    ``rank_state`` (each rank's, JSON-ready) are stored as given. The frozen parameters
    (if any): ``embed_base`` writes their values (``frozen/<name>``, gathered a unit at a
    time); else only ``base.json``, their content hashes and source (a run's checkpoints:
    ``trainer``'s config says how to rebuild them). A failed write on any
    rank (a full disk, a read-only place) removes ``path`` again and raises ValueError
    on every rank naming the path and the bytes needed: older checkpoints stay as
    they were, the newest complete one is still the newest."""
    path = Path(path)
    rank, comm = engine.comm.rank, engine.comm
    error = None
    if rank == 0:
        if (path / MANIFEST).exists():
            error = f"{path} already holds a complete checkpoint; save to a new directory"
        else:
            shutil.rmtree(path, ignore_errors=True)  # a torn save from before a crash
            error = _attempt(lambda: path.mkdir(parents=True), path, 0)
    agree(error, comm)
    info, tensors, extents, readers = _engine_pieces(engine, embed_base)
    # the frozen base never changes: referenced by content hash (base.json), rebuilt from its source on load
    has_base = not embed_base and bool(engine.frozen.units or engine.frozen.loose)
    base = base_manifest(engine.frozen, engine.config) if has_base else None
    need = sum(comm.all_gather_object(sum(t.numel() * t.element_size() for t in tensors.values())))
    # before a byte is written
    agree(_free_space_error(path, need) if rank == 0 else None, comm, on_error=_remove_torn(engine, path))
    mine = [path / f"rank{rank}.json"]

    def write_mine() -> None:
        shards.save_pieces(tensors, extents, path / "engine", readers=readers, device=engine.device)
        write_json(path / f"rank{rank}.json", {"step": step, "rank": rank, **(rank_state or {})})
        mine.extend(sorted((path / "engine").glob(f"__{rank}_*")))
        if rank == 0:
            write_json(path / "engine.json", info)
            mine.extend([path / "engine.json", path / "engine" / ".metadata"])
            if base is not None:
                write_json(path / BASE, base)
                mine.append(path / BASE)
            if trainer is not None:
                write_json(path / "trainer.json", {"step": step, **trainer})
                mine.append(path / "trainer.json")
    agree(_attempt(write_mine, path, need), comm, on_error=_remove_torn(engine, path))
    digests = comm.all_gather_object({str(f.relative_to(path)): file_digest(f) for f in mine})
    error = None
    if rank == 0:
        def write_manifest() -> None:
            fsync_dir(path / "engine")
            write_json(path / MANIFEST, {
                "format": CHECKPOINT_FORMAT, "step": step, "world_size": comm.world, "zero_stage": engine.stage,
                "precision": engine.config.precision.mode,
                "time": utc_now(),
                "files": {k: v for d in digests for k, v in sorted(d.items())}})
            fsync_dir(path.parent)
        error = _attempt(write_manifest, path, need)
    agree(error, comm, on_error=_remove_torn(engine, path))


def _free_space_error(path: Path, need: int) -> str | None:
    """The one-line error when the file system of ``path`` has less room than ``need``."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    if free >= need:
        return None
    return (f"cannot write {path} ({need:,} bytes needed, {free:,} free): no space left on device; free space "
            f"there or choose another place; the newest complete checkpoint is unchanged")


def _attempt(write: Callable[[], None], path: Path, need: int) -> str | None:
    """Run ``write``; the one-line message of an OSError it raised, else None."""
    try:
        write()
    except OSError as e:
        return str(write_failure(path, need, e)) + "; the newest complete checkpoint is unchanged"
    return None


def _remove_torn(engine: Checkpointable, path: Path) -> Callable[[], None]:
    """What every rank does when a rank failed to write ``path`` (``agree``'s
    ``on_error``): rank 0 removes the torn directory, the others wait for it."""
    def remove() -> None:
        if engine.comm.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        engine.comm.barrier()
    return remove


# ---- check ----
# ---- load ----
def load_engine_state(engine: Checkpointable, path: str | Path, *, verified: bool = False) -> dict[str, Any]:
    """Load ``engine`` from checkpoint ``path`` (any world size and stage). Checks the
    checkpoint first (on rank 0, unless ``verified``), then hands the engine a reader
    of its pieces (``engine.load_state_streamed``: one unit at a time, checked on every
    rank before anything changes): any failure raises
    ValueError on every rank with the engine untouched. Collective. Returns the manifest."""
    path = Path(path)
    layout = engine.layout()
    error = None
    if engine.comm.rank == 0 and not verified:
        try:
            verify_checkpoint(path, layout["units"])
        except ValueError as e:
            error = str(e)
    agree(error, engine.comm)
    meta = read_manifest(path)
    info = read_json(path / "engine.json")
    check_layout(path, info.get("units"), layout["units"])
    specs = {k: spec for k, spec in info["tensors"].items() if not k.startswith(FROZEN)}
    names = [u["name"] for u in layout["units"]]

    def read_units(indices: list[int]) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
        wanted = {names[i] for i in indices}
        template, extents = {}, {}
        for k, spec in specs.items():
            unit = k.rsplit("/optim/", 1)[0].removesuffix("/master")
            if unit not in wanted:
                continue
            dtype = getattr(torch, spec["dtype"])
            if spec["per_element"]:
                at = k if k in layout["extents"] else f"{unit}/master"  # per-block state has its own extent
                extents[k] = layout["extents"][at]
                template[k] = torch.empty(layout["local_numel"][at], dtype=dtype, device=engine.device)
            else:
                template[k] = torch.empty(spec["shape"], dtype=dtype, device=engine.device)
        return shards.load_pieces(template, extents, path / "engine"), extents
    _check_or_load_base(engine, path, info)
    engine.load_state_streamed({**{k: info[k] for k in ("format", "steps_done", "scaler", "param_groups", "units")},
                                "keys": list(specs)}, read_units)
    return meta


def _check_or_load_base(engine: Checkpointable, path: Path, info: dict[str, Any]) -> None:
    """The engine's frozen base against the checkpoint's: ``base.json``'s digests checked
    against the base the engine built (ValueError on every rank naming the first tensor
    that differs, the engine untouched), or an older checkpoint's embedded ``frozen/``
    tensors loaded into it (this rank's shards; NF4 keeps its bytes where they decode to
    the saved values). Collective."""
    saved = read_base(path)
    if saved is not None:
        digests = frozen_digests(engine.frozen)  # collective: every rank
        agree(base_mismatch(saved, digests, path) if engine.comm.rank == 0 else None, engine.comm)
        return
    embedded = {k[len(FROZEN):]: spec for k, spec in info["tensors"].items() if k.startswith(FROZEN)}
    held: dict[str, torch.Tensor] = {}  # the tensor of the last read: each is loaded once

    def read(name: str, start: int, end: int) -> torch.Tensor | None:
        if name not in embedded:
            return None
        if name not in held:
            held.clear()
            held[name] = shards.load_whole(path / "engine", FROZEN + name, embedded[name]).reshape(-1)
        return held[name][start:end].float()
    if embedded:
        engine.frozen.load(read)


def save_engine(engine: Checkpointable, path: str | os.PathLike) -> None:
    """``Engine.save``: write a checkpoint to ``path``, replacing one already there only
    once the new one is complete (written beside it, then swapped in). It embeds the
    frozen base (the engine cannot know where a caller's weights came from, so nothing
    could rebuild it). Collective."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    old = path.with_name(f".{path.name}.old")
    save_checkpoint(partial, engine, step=engine.steps_done)
    if engine.comm.rank == 0:
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
        partial.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    engine.comm.barrier()


def load_engine(engine: Checkpointable, path: str | os.PathLike) -> None:
    """``Engine.load``: load a checkpoint of any world size and stage. Raises ValueError
    naming the file and fault, the engine untouched. Collective."""
    load_engine_state(engine, path)
