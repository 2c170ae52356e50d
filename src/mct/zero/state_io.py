"""Flat units' fp32 state as world-size-independent 1-D pieces (no collectives, no I/O).

Each unit's master and each per-element optimizer state tensor is one *global* 1-D
tensor of ``layout.numel`` elements: the unit's flat buffer without the tail padding
(the alignment gaps between parameters stay in, and hold zeros). Its offsets do not
depend on the world size or the ZeRO stage, so any rank of any run can say which
element range ``[offset, offset + n)`` of it it holds:

    rank r of a sharded layout: [r * S, min((r + 1) * S, numel))   (S = shard_numel)
    stage 0 (layout world 1):   [0, numel), the same on every rank (replicated)

These are torch.chunk's ranges, which is also how a DTensor with ``Shard(0)`` splits a
1-D tensor, so a checkpoint format can map them directly. Scalar optimizer state (Adam's
``step``) is the same on every rank: replicated.

Per-block optimizer state (the fp32 scales of int8 moments, one per ``span`` elements,
named by the optimizer's ``block_state`` {name: span}) is a global 1-D tensor of
``ceil(numel / span)`` entries; shards start at multiples of ``span`` (the layout's
``shard_align``), so rank r holds entries ``[lo / span, ceil(min(hi, numel) / span))``:
whole blocks move when a checkpoint is resharded, nothing is re-quantized.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator

import torch

from mct.dist import error_of
from mct.zero.flat import FlatParamUnit

MASTER = "master"


def extent(unit: FlatParamUnit, rank: int) -> tuple[int, int]:
    """(offset, length) of the unpadded global range this rank's shard holds."""
    layout = unit.layout
    if layout.world == 1:
        return 0, layout.numel
    lo, hi = layout.shard_range(rank)
    return min(lo, layout.numel), max(0, min(hi, layout.numel) - lo)


def shard_start(unit: FlatParamUnit, rank: int) -> int:
    """Where this rank's shard starts on the unit's padded global flat index (0 when not
    sharded): ``extent``'s offset, but a shard of tail padding only starts past the end
    (a multiple of ``layout.shard_align``, where ``extent`` would clamp it to ``numel``)."""
    return unit.layout.shard_range(rank)[0] if unit.layout.world > 1 else 0


def block_spans(optimizer: Any) -> dict[str, int]:
    """{state name: elements per entry} of the optimizer's per-block state ({} for torch's)."""
    return dict(getattr(optimizer, "block_state", {}) or {})


def block_extent(unit: FlatParamUnit, rank: int, span: int) -> tuple[int, int]:
    """(offset, length) in entries of a per-block state tensor this rank's shard holds
    (a shard of tail padding only holds none: it sits at the end, as its master piece)."""
    off, n = extent(unit, rank)
    if n == 0:
        return -(-unit.layout.numel // span), 0
    assert off % span == 0, f"unit {unit.name!r}: shard offset {off} is not a multiple of {span}"
    return off // span, -(-n // span)


def unit_record(unit: FlatParamUnit, group: int) -> dict[str, Any]:
    """JSON-ready description of a unit's layout (independent of world size)."""
    return {"name": unit.name, "group": group, "numel": unit.layout.numel,
            "params": [[n, list(s), o] for n, s, o in zip(unit.names, unit.layout.shapes, unit.layout.offsets)]}


def layout(units: list[FlatParamUnit], group_of_unit: list[int], rank: int,
           spans: dict[str, int] | None = None) -> dict[str, Any]:
    """``units`` (``unit_record`` each), ``extents`` ({``<unit>/master``: [offset, global
    numel]}) and ``local_numel`` ({``<unit>/master``: elements ``rank`` holds}): what a
    checkpoint needs to know of a rank's state without reading any of it. Per-block
    state (``spans``, see ``block_spans``) gets its own ``<unit>/optim/<name>`` entries."""
    out = {"units": [unit_record(u, g) for u, g in zip(units, group_of_unit)],
           "extents": {key(u, MASTER): [extent(u, rank)[0], u.layout.numel] for u in units},
           "local_numel": {key(u, MASTER): extent(u, rank)[1] for u in units}}
    for u in units:
        for name, span in (spans or {}).items():
            off, n = block_extent(u, rank, span)
            out["extents"][key(u, f"optim/{name}")] = [off, -(-u.layout.numel // span)]
            out["local_numel"][key(u, f"optim/{name}")] = n
    return out


def key(unit: FlatParamUnit, what: str) -> str:
    """State key of a unit's tensor: ``<unit>/master`` or ``<unit>/optim/<state key>``."""
    return f"{unit.name}/{what}"


def export_units(units: list[FlatParamUnit], optimizer: torch.optim.Optimizer,
                 rank: int) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """This rank's pieces: ({key: tensor}, {key: [offset, global numel]}) for 1-D
    pieces; scalars have no extent (replicated). Tensors are views of the live state
    (no copies): clone them to keep a snapshot. Raises ValueError for optimizer state
    that is neither per-element nor scalar (it could not be resharded)."""
    tensors: dict[str, torch.Tensor] = {}
    extents: dict[str, list[int]] = {}
    spans = block_spans(optimizer)
    for u in units:
        off, n = extent(u, rank)
        tensors[key(u, MASTER)] = u.master.detach()[:n]
        extents[key(u, MASTER)] = [off, u.layout.numel]
        for name, v in optimizer.state.get(u.master, {}).items():
            k = key(u, f"optim/{name}")
            if not isinstance(v, torch.Tensor):
                raise ValueError(f"optimizer state {name!r} of unit {u.name!r} is a {type(v).__name__}, not a "
                                 f"tensor: only tensor state can be checkpointed; use a torch.optim optimizer")
            span = spans.get(name, 1)
            if span > 1 and v.dim() == 1 and v.numel() * span == u.master.numel():
                boff, bn = block_extent(u, rank, span)
                tensors[k] = v.detach()[:bn]
                extents[k] = [boff, -(-u.layout.numel // span)]
            elif v.shape == u.master.shape:
                tensors[k] = v.detach()[:n]
                extents[k] = [off, u.layout.numel]
            elif v.numel() == 1:
                tensors[k] = v.detach()
            else:
                raise ValueError(f"optimizer state {name!r} of unit {u.name!r} has shape {tuple(v.shape)}: "
                                 f"neither per-element ({tuple(u.master.shape)}) nor a scalar")
    return tensors, extents


def _jsonish(v: Any) -> Any:
    """Tuples as lists, so a state that went through JSON compares equal to a live one."""
    if isinstance(v, (list, tuple)):
        return [_jsonish(x) for x in v]
    if isinstance(v, dict):
        return {k: _jsonish(x) for k, x in v.items()}
    return v


def check_header(state: Any, fmt: str, units: list[dict[str, Any]]) -> int:
    """Check an engine state's format, entries, ``steps_done`` and unit layouts against
    ``units`` (this engine's ``unit_record``s). Returns steps_done; raises ValueError."""
    if not isinstance(state, dict) or state.get("format") != fmt:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"engine state has format {got!r}, expected {fmt!r}: pass what Engine.state_dict() returned")
    for k in ("steps_done", "scaler", "param_groups", "units", "tensors", "extents"):
        if k not in state:
            raise ValueError(f"engine state has no {k!r} entry")
    steps = state["steps_done"]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"engine state steps_done = {steps!r} must be an integer >= 0")
    if _jsonish(state["units"]) != _jsonish(units):
        raise ValueError("engine state holds a different model: its flat-unit layout (parameter names, "
                         "shapes, groups) differs from this engine's")
    return steps


def check_keys(units: list[FlatParamUnit], keys: Any) -> None:
    """Raise ValueError unless ``keys`` (of a state's tensors) are a master per unit and
    the same optimizer state names for every unit. Reads only the names."""
    expected = {key(u, MASTER) for u in units}
    optim_keys = {k for k in keys if "/optim/" in k}
    unknown = sorted(set(keys) - expected - optim_keys)
    if unknown:
        raise ValueError(f"unexpected tensors {unknown[:3]}: the state was saved from a different model")
    missing = sorted(expected - set(keys))
    if missing:
        raise ValueError(f"missing tensors {missing[:3]}: the state was saved from a different model")
    names = {u.name for u in units}
    for k in optim_keys:
        if k.split("/optim/")[0] not in names:
            raise ValueError(f"optimizer state {k!r} belongs to no unit of this model")
    per_unit = {frozenset(k.split("/optim/")[1] for k in optim_keys if k.startswith(u.name + "/optim/"))
                for u in units}
    if len(per_unit) > 1:
        raise ValueError(f"optimizer state differs between units ({sorted(map(sorted, per_unit))}): "
                         f"the state is incomplete")


def check_units(units: list[FlatParamUnit], optimizer: torch.optim.Optimizer, rank: int,
                tensors: dict[str, Any], extents: dict[str, Any]) -> None:
    """Raise ValueError naming the first fault if ``tensors``/``extents`` are not this
    rank's pieces for ``units`` (missing or unexpected keys, wrong extent, shape, dtype,
    non-finite masters). Reads only; mutates nothing."""
    check_keys(units, tensors)
    optim_keys = {k for k in tensors if "/optim/" in k}
    spans = block_spans(optimizer)
    _check_state_names(optimizer, optim_keys)
    for u in units:
        for k in [key(u, MASTER)] + sorted(k for k in optim_keys if k.startswith(u.name + "/optim/")):
            span = spans.get(k.split("/optim/")[-1], 1) if "/optim/" in k else 1
            off, n = extent(u, rank) if span == 1 else block_extent(u, rank, span)
            want = [off, -(-u.layout.numel // span)]
            t = tensors[k]
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{k!r} is a {type(t).__name__}, not a tensor")
            if k in extents or k.endswith(MASTER):
                if list(extents.get(k, [])) != want:
                    raise ValueError(f"{k!r} covers elements {extents.get(k)} (offset, total); this rank of "
                                     f"this model needs {want}: a different model or sharding")
                if tuple(t.shape) != (n,):
                    raise ValueError(f"{k!r} has shape {tuple(t.shape)}, expected ({n},)")
            elif t.numel() != 1:
                raise ValueError(f"{k!r} has shape {tuple(t.shape)}: a replicated state must be a scalar")
        master = tensors[key(u, MASTER)]
        if master.dtype != torch.float32:
            raise ValueError(f"{key(u, MASTER)!r} has dtype {master.dtype}, expected torch.float32")
        if not bool(torch.isfinite(master).all()):
            raise ValueError(f"{key(u, MASTER)!r} holds non-finite values")
    for k in optim_keys:
        if not tensors[k].is_floating_point() and tensors[k].dtype not in (torch.int8, torch.uint8):
            raise ValueError(f"{k!r} has dtype {tensors[k].dtype}, expected a floating-point dtype "
                             f"(or int8 / uint8 codes of quantized state)")


def read_checked(units: list[FlatParamUnit], optimizer: torch.optim.Optimizer, rank: int,
                 read_units: Callable[[list[int]], tuple[dict, dict]],
                 agree: Callable[[str | None], None]) -> Iterator[tuple[int, dict, dict]]:
    """(i, tensors, extents) of each unit in turn, read by ``read_units([i])`` and
    checked (``check_units``); ``agree`` raises any rank's fault on every rank after
    each unit, so no rank is left in a collective. One unit in memory at a time."""
    for i, u in enumerate(units):
        tensors, extents = read_units([i])
        agree(error_of(check_units, [u], optimizer, rank, tensors, extents))
        yield i, tensors, extents
        del tensors, extents  # before the next unit is read


def _check_state_names(optimizer: Any, optim_keys: set[str]) -> None:
    """An optimizer that names its state (``state_names``) gets exactly those names."""
    want = getattr(optimizer, "state_names", None)
    have = {k.split("/optim/")[1] for k in optim_keys}
    if want is not None and have and have != set(want):
        raise ValueError(f"the state holds optimizer state {sorted(have)}, this optimizer "
                         f"(state_dtype = {getattr(optimizer, 'state_dtype', '?')!r}) keeps {sorted(want)}: "
                         f"set optimizer.state_dtype to the one the state was saved with")


def load_units(units: list[FlatParamUnit], optimizer: torch.optim.Optimizer, rank: int,
               tensors: dict[str, torch.Tensor], extents: dict[str, list[int]],
               param_groups: list[dict[str, Any]]) -> None:
    """Copy checked pieces into the masters and replace the optimizer's state (padding
    is zero, as in a fresh unit). Call ``check_units`` first; this only mutates."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    index = master_index(optimizer)
    for u in units:
        load_unit(u, index, rank, tensors, extents, state, block_spans(optimizer))
    set_optimizer_state(optimizer, state, param_groups)


def master_index(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """id(master) -> its index in the optimizer's state dict (torch's numbering)."""
    return {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}


def load_unit(u: FlatParamUnit, index: dict[int, int], rank: int, tensors: dict[str, torch.Tensor],
              extents: dict[str, list[int]], state: dict[int, dict[str, torch.Tensor]],
              spans: dict[str, int] | None = None) -> None:
    """Copy one checked unit's master piece into ``u.master`` and put its optimizer state
    (padded to the master's length; per-block state, ``spans``, to its blocks) into
    ``state`` under the master's index (``master_index``)."""
    _, n = extent(u, rank)
    with torch.no_grad():
        u.master.zero_()
        u.master[:n].copy_(tensors[key(u, MASTER)])
        prefix = key(u, "optim/")
        mine = {k[len(prefix):]: t for k, t in tensors.items() if k.startswith(prefix)}
        if mine:
            state[index[id(u.master)]] = {name: _padded(t, u.master, n, key(u, f"optim/{name}") in extents,
                                                        (spans or {}).get(name, 1))
                                          for name, t in mine.items()}


def set_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[int, dict[str, torch.Tensor]],
                        param_groups: list[dict[str, Any]]) -> None:
    """Replace the optimizer's state (by master index) and hyperparameters at once
    (``Optimizer.load_state_dict``: tensors already of the master's dtype and device are
    taken as they are, not copied)."""
    index = master_index(optimizer)
    groups = [{**hyper, "params": [index[id(p)] for p in g["params"]]}
              for hyper, g in zip(param_groups, optimizer.param_groups)]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _padded(t: torch.Tensor, master: torch.Tensor, n: int, per_element: bool, span: int = 1) -> torch.Tensor:
    if not per_element:
        return t.detach().clone().reshape(()) if t.dim() else t.detach().clone()
    out = torch.zeros(master.numel() // span, dtype=t.dtype, device=master.device)
    out[:-(-n // span)].copy_(t)
    return out


def group_hyper(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's hyperparameters (JSON-ready: tuples become lists)."""
    out = []
    for g in optimizer.param_groups:
        hyper = {}
        for k, v in g.items():
            if k == "params":
                continue
            if isinstance(v, torch.Tensor):
                v = v.item()
            hyper[k] = list(v) if isinstance(v, tuple) else v
        out.append(hyper)
    return out


def check_hyper(optimizer: torch.optim.Optimizer, param_groups: Any) -> list[dict[str, Any]]:
    """Validate saved hyperparameters against the optimizer's groups; returns them with
    lists turned back into the tuples the optimizer uses. Raises ValueError."""
    if not isinstance(param_groups, list) or len(param_groups) != len(optimizer.param_groups):
        got = len(param_groups) if isinstance(param_groups, list) else type(param_groups).__name__
        raise ValueError(f"the state has {got} optimizer param groups, this engine has "
                         f"{len(optimizer.param_groups)}: a different optimizer set-up")
    out = []
    for i, (saved, g) in enumerate(zip(param_groups, optimizer.param_groups)):
        mine = {k for k in g if k != "params"}
        if not isinstance(saved, dict) or set(saved) != mine:
            raise ValueError(f"optimizer param group {i}: saved keys {sorted(saved) if isinstance(saved, dict) else saved} "
                             f"!= this optimizer's {sorted(mine)}: a different optimizer")
        out.append({k: (tuple(v) if isinstance(g[k], tuple) and isinstance(v, list) else v) for k, v in saved.items()})
    return out


def param_slices(record: dict[str, Any]) -> list[tuple[str, tuple[int, ...], int, int]]:
    """(name, shape, start, end) of each parameter in a unit's global flat tensor."""
    return [(n, tuple(s), o, o + math.prod(s)) for n, s, o in record["params"]]
