"""The engine's state API behind ``Engine``'s facade: the ``mct.engine/1`` state dict
(a header of plain values + this rank's world-size-independent pieces, see
``mct.zero.state_io``), its validation, and loading it through the engine's
``Residency`` (whole, or streamed a unit at a time). Every function takes the engine
as a ``StateOwner`` (its public parts); none does file I/O.

A load validates everything first and raises ValueError naming the fault with the
engine untouched; only then does it mutate (masters and working parameters, optimizer
state and hyperparameters, loss scaler, ``steps_done``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

import torch
import torch.nn as nn

from mct.dist import agree
from mct.precision import LossScaler
from mct.zero import state_io as zstate

if TYPE_CHECKING:
    from mct.config import EngineConfig
    from mct.offload.residency import Residency
    from mct.zero.comm import Comm
    from mct.zero.frozen import FrozenModel
    from mct.zero.sharded import ShardedModel

STATE_FORMAT = "mct.engine/1"


class StateOwner(Protocol):
    config: EngineConfig
    model: nn.Module
    comm: Comm
    sharded: ShardedModel
    frozen: FrozenModel
    optimizer: torch.optim.Optimizer
    residency: Residency
    scaler: LossScaler
    steps_done: int

    def set_counters(self, scaler: dict[str, Any], steps_done: int) -> None: ...


def header(e: StateOwner) -> dict[str, Any]:
    """``format``, ``steps_done``, ``scaler``, ``param_groups`` (JSON-ready) and ``units``."""
    return {"format": STATE_FORMAT, "steps_done": e.steps_done, "scaler": e.scaler.state_dict(),
            "param_groups": zstate.group_hyper(e.optimizer), "units": _units(e)}


def state_dict(e: StateOwner) -> dict[str, Any]:
    """Everything the engine owns that a continuation needs, for this rank:
    ``format``, ``steps_done``, ``scaler`` (plain numbers), ``param_groups`` (each
    optimizer group's hyperparameters, JSON-ready), ``units`` (each flat unit's
    layout, independent of the world size), ``tensors`` ({key: 1-D fp32 piece or
    scalar}: ``<unit>/master`` and ``<unit>/optim/<name>``) and ``extents`` ({key:
    [offset, global numel]} of each 1-D piece in its unit's global flat tensor; see
    ``mct.zero.state_io``). Tensors are views of live state, not copies: clone them to
    keep a snapshot. Under offload they are copies read back from the store (the
    whole local state is in memory while the result is held): the format is the
    same with and without offload, so state moves freely between them. Not
    collective; mutates nothing."""
    tensors, extents = e.residency.export()
    return {**header(e), "tensors": tensors, "extents": extents}


def streamed_state_dict(e: StateOwner) -> tuple[dict[str, Any], dict[str, Callable[[], torch.Tensor]]]:
    """``state_dict()`` for writing out piece by piece: (state, readers). The same
    entries and keys; under offload each stored piece is a meta-device placeholder
    (shape, dtype) and ``readers[key]()`` reads it from the store into a new CPU
    tensor when it is written, so a save holds one piece, not the local state.
    Without offload: (``state_dict()``, {}). Not collective; mutates nothing."""
    tensors, extents, readers = e.residency.export_streamed()
    return {**header(e), "tensors": tensors, "extents": extents}, readers


def load_state_dict(e: StateOwner, state: dict[str, Any]) -> None:
    """Restore what ``state_dict()`` of an engine with the same model, optimizer set-up
    and this rank's sharding returned (tensors may be on any device; with or without
    offload on either side). Validates all of it first and raises ValueError naming
    the fault with the engine untouched; then sets the master shards (and working
    parameters), optimizer state and hyperparameters, loss scaler and
    ``steps_done``. Not collective at stage 0/3; at stages 1/2 publishing the
    masters all-gathers, so every rank must call it."""
    steps = zstate.check_header(state, STATE_FORMAT, _units(e))
    hyper = zstate.check_hyper(e.optimizer, state["param_groups"])
    zstate.check_units(e.sharded.units, e.optimizer, e.comm.rank, state["tensors"], state["extents"])
    LossScaler.from_config(e.config.precision).load_state_dict(state["scaler"])  # validates only
    # Everything checked: from here on only mutation.
    e.residency.load(state["tensors"], state["extents"], hyper)
    e.set_counters(state["scaler"], steps)


def load_state_streamed(e: StateOwner, head: dict[str, Any],
                        read_units: Callable[[list[int]], tuple[dict, dict]]) -> None:
    """``load_state_dict`` for state read a unit at a time, never a second copy of
    this rank's state. ``head``: what ``state_dict()`` holds but ``tensors``/
    ``extents``, plus ``keys`` (every tensor key); ``read_units(indices)`` returns
    (tensors, extents) of those units (collective). How the units are checked and set
    is the residency's (``Residency.load_streamed``: offloaded, staged in the store and
    swapped in once all passed; resident, checked in one pass and read again into
    the state in a second). Every rank learns of a fault found on any rank after each
    unit (no rank is left in a collective). A failure raises ValueError, the engine
    untouched. Collective."""
    steps = zstate.check_header({**head, "tensors": {}, "extents": {}}, STATE_FORMAT, _units(e))
    hyper = zstate.check_hyper(e.optimizer, head["param_groups"])
    LossScaler.from_config(e.config.precision).load_state_dict(head["scaler"])  # validates only
    zstate.check_keys(e.sharded.units, head["keys"])
    e.residency.load_streamed(read_units, hyper, lambda error: agree(error, e.comm))
    e.set_counters(head["scaler"], steps)


def full_state_dict(e: StateOwner) -> dict[str, torch.Tensor]:
    """fp32 copy of every parameter, names as ``model.named_parameters()``.
    Collective under ZeRO: every rank must call it."""
    with e.residency.masters_resident(write_back=False):
        trainable = e.sharded.full_state()
    frozen = {n: t.float().clone() for n, t in e.frozen.items()}
    return {n: (trainable[n] if n in trainable else frozen[n]) for n, _ in e.model.named_parameters()}


def full_state_items(e: StateOwner) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, fp32 tensor) of every parameter, as ``full_state_dict`` but one flat
    unit gathered at a time (its master read where it lives, ``Residency.master_of``):
    a tensor is a view valid until the next unit's first item (copy it to keep it).
    Trainable parameters in unit order, then the others. Collective under ZeRO: every
    rank must iterate to the end; mutates nothing."""
    seen = set()
    for i, u in enumerate(e.sharded.units):
        with e.residency.master_of(i) as m:
            full = e.sharded.gather_unit(u, m)
        for name, shape, off in zip(u.names, u.layout.shapes, u.layout.offsets):
            seen.add(name)
            yield name, full[off:off + math.prod(shape)].view(shape)
        del full
    for n, t in e.frozen.items():  # frozen parameters, a unit gathered at a time
        yield n, t.float()  # a unit's: a copy already (FrozenModel.items), free for numpy to pin


def parameter_shapes(e: StateOwner) -> dict[str, tuple[int, ...]]:
    shapes = {n: tuple(s) for u in e.sharded.units for n, s in zip(u.names, u.layout.shapes)}
    return {**shapes, **{n: tuple(p.shape) for n, p in e.model.named_parameters() if n not in shapes}}


def state_layout(e: StateOwner) -> dict[str, Any]:
    """This rank's state layout without reading any state (cheap under offload):
    ``units`` (as in ``state_dict()``), ``extents`` ({``<unit>/master``: [offset,
    global numel]}: every per-element tensor of a unit has its master's extent) and
    ``local_numel`` ({``<unit>/master``: elements this rank holds}). Not collective."""
    return zstate.layout(e.sharded.units, e.sharded.group_of_unit, e.comm.rank, zstate.block_spans(e.optimizer))


def held_state_bytes(e: StateOwner) -> dict[str, int]:
    """Per-rank bytes of model state held during a step, by category (optimizer
    included). At stages 2/3 this counts the fp32 gradient shards, which exist
    only from backward to the end of the optimizer step (``tracker.live()``
    between steps shows no gradients there); see ``ShardedModel.bytes_by_category``."""
    out = e.sharded.bytes_by_category()
    if e.frozen.units:  # sharded frozen parameters (stages 1-3): their stored shards
        out["frozen"] = e.frozen.stored_bytes()
    out["optimizer"] = sum(v.numel() * v.element_size() for s in e.optimizer.state.values()
                           for v in s.values() if isinstance(v, torch.Tensor))
    return e.residency.model_state_bytes(out)


def _units(e: StateOwner) -> list[dict[str, Any]]:
    return [zstate.unit_record(u, g) for u, g in zip(e.sharded.units, e.sharded.group_of_unit)]
