"""Checkpoints of an offloaded state, streamed: a save reads one stored piece at a time,
a load stages one unit at a time in the store and swaps the staged records in only once
every unit passed its checks. The ``OffloadedState`` methods of the same names call
these; ``offload`` is that state.

Staging records are ``load.u<i>.master`` and ``load.u<i>.<state name>``; a commit swaps
them with the live ``u<i>.*`` records (no data moves), then releases them (host memory
freed; a disk range kept for the next load of that key).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from mct.offload.protocols import OffloadedUnits
from mct.offload.store import UnitState, put_record
from mct.offload.stream import Item

STAGE = "load"


def unit_pieces(offload: OffloadedUnits, i: int, n: int) -> list[tuple[str, torch.Tensor, Callable[[], torch.Tensor] | None]]:
    """Unit ``i``'s state for a streamed save, without reading the store: (what,
    tensor, reader) for ``master`` and each ``optim/<name>`` (scalars first, as torch's
    optimizers order them). A stored piece is a meta-device placeholder of its first
    ``n`` elements (a per-block state: the entries covering them) with a ``reader()``
    that reads them into a new CPU tensor; resident ones (a master that is a view,
    scalars) are themselves, with no reader."""
    u = offload.units[i]
    out: list[tuple[str, torch.Tensor, Callable[[], torch.Tensor] | None]] = []

    def stored(key: str, dtype: torch.dtype, count: int) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
        def read() -> torch.Tensor:
            t = torch.empty(count, dtype=dtype)
            offload.stream.fetch(Item(key, offload.store, key, 0, count), t)
            return t
        return torch.empty(count, dtype=dtype, device="meta"), read
    out.append(("master", u.master.detach()[:n], None) if u.master_is_view
               else ("master", *stored(f"u{i}.master", torch.float32, n)))
    st = offload.states[i]
    if st is not None:
        out += [(f"optim/{k}", v.detach() if isinstance(v, torch.Tensor) else v, None) for k, v in st.scalars.items()]
        out += [(f"optim/{k}", *stored(f"u{i}.{k}", dt, offload.state_numel(k, n))) for k, dt in st.elementwise.items()]
    return out


def stage_unit(offload: OffloadedUnits, i: int, pieces: dict[str, torch.Tensor], n: int) -> None:
    """Write unit ``i``'s loaded ``master`` and per-element ``optim/<name>`` pieces
    (``n`` elements each; per-block ones the entries covering them; the shard's
    padding becomes zeros) into staging records; the live state is untouched until
    ``commit_staged``."""
    S = offload.units[i].layout.shard_numel
    for what, t in pieces.items():
        name = what.removeprefix("optim/")
        key, size, have = f"{STAGE}.u{i}.{name}", offload.state_numel(name, S), offload.state_numel(name, n)
        old = offload.store.records.get(key)
        if old is not None and (old.dtype != t.dtype or old.numel != size):
            offload.store.release(key)  # a leftover of another dtype or size (a load that failed part-way)
        offload.ensure_record(key, size, t.dtype)
        put_record(offload.store, key, t.detach().reshape(-1)[:have])
        if size > have:
            put_record(offload.store, key, torch.zeros(size - have, dtype=t.dtype), offset=have)


def drop_staged(offload: OffloadedUnits) -> None:
    """Release every staging record (after a commit, or a load that failed)."""
    for key in [k for k in offload.store.records if k.startswith(f"{STAGE}.")]:
        offload.store.release(key)


def commit_staged(offload: OffloadedUnits, elementwise: list[dict[str, torch.dtype]], scalars: list[dict[str, Any]],
                  on_device: list[bool]) -> None:
    """Make the staged state live: each unit's staged records swap places with the live
    ones (a resident master is read back in), its optimizer state becomes
    ``elementwise`` (names, dtypes) and ``scalars`` (on the device where the group is
    fused or capturable); then the working parameters and stage-3 parameter shards
    are rebuilt from the masters. Call between steps."""
    offload.stream.drain()
    store = offload.store
    for i, u in enumerate(offload.units):
        if u.master_is_view:
            offload.fetch(store, f"{STAGE}.u{i}.master", u.master)
        else:
            store.swap(f"{STAGE}.u{i}.master", f"u{i}.master")
        for k, dt in elementwise[i].items():
            offload.ensure_record(f"u{i}.{k}", offload.state_numel(k, u.layout.shard_numel), dt)
            store.swap(f"{STAGE}.u{i}.{k}", f"u{i}.{k}")
        resident = {k: (v.to(offload.device) if on_device[i] else v.clone()) if isinstance(v, torch.Tensor) else v
                    for k, v in scalars[i].items()}
        offload.states[i] = UnitState(dict(elementwise[i]), resident) if elementwise[i] or scalars[i] else None
    drop_staged(offload)
    for i, u in enumerate(offload.units):
        offload.refresh_params(i, u)
    offload.publish()
    offload.end_step()
    offload.report_offloaded()


def streamed_pieces(offload: OffloadedUnits, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, list[int]],
                                                        dict[str, Callable[[], torch.Tensor]]]:
    """``Engine.state_dict()``'s ``tensors`` and ``extents`` (see ``mct.zero.state_io``)
    for this rank, plus ``readers``: every stored piece is a meta placeholder whose
    reader reads it when it is written. Raises ValueError for non-tensor optimizer state."""
    from mct.zero import state_io as zstate
    offload.stream.drain()
    tensors: dict[str, torch.Tensor] = {}
    extents: dict[str, list[int]] = {}
    readers: dict[str, Callable[[], torch.Tensor]] = {}
    for i, u in enumerate(offload.units):
        off, n = zstate.extent(u, rank)
        for what, t, read in unit_pieces(offload, i, n):
            k = zstate.key(u, what)
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"optimizer state {what!r} of unit {u.name!r} is a {type(t).__name__}, not a "
                                 f"tensor: only tensor state can be checkpointed; use a torch.optim optimizer")
            tensors[k] = t
            span = offload.spans.get(what.removeprefix("optim/"), 1)
            if span > 1 and read is not None:  # per-block state: whole blocks, one entry each
                extents[k] = [zstate.block_extent(u, rank, span)[0], -(-u.layout.numel // span)]
            elif what == zstate.MASTER or read is not None:
                extents[k] = [off, u.layout.numel]
            if read is not None:
                readers[k] = read
    return tensors, extents, readers


def stage_units(offload: OffloadedUnits, group_of_unit: list[int], optimizer: torch.optim.Optimizer, rank: int,
                read_units: Callable[[list[int]], tuple[dict, dict]],
                agree: Callable[[str | None], None]) -> tuple[list, list, list]:
    """Read (``read_units([i])``), check (``mct.zero.state_io.check_units``; ``agree``
    raises any rank's fault on every rank) and stage each unit in turn: one unit in memory. Returns what ``commit_staged`` takes: per unit the
    per-element state's dtypes, the scalars, and whether its group keeps them on the
    device. Raises ValueError (every staging record dropped, the live state untouched)."""
    from mct.zero import state_io as zstate
    elementwise, scalars, on_device = [], [], []
    try:
        for i, tensors, extents in zstate.read_checked(offload.units, optimizer, rank, read_units, agree):
            u = offload.units[i]
            per = {k[len(u.name) + 1:]: t for k, t in tensors.items() if k in extents}
            stage_unit(offload, i, per, zstate.extent(u, rank)[1])
            elementwise.append({k.removeprefix("optim/"): t.dtype for k, t in per.items() if k != zstate.MASTER})
            scalars.append({k.split("/optim/")[1]: t for k, t in tensors.items() if "/optim/" in k and k not in extents})
            group = optimizer.param_groups[group_of_unit[i]]
            on_device.append(bool(group.get("fused") or group.get("capturable")))
    except BaseException:
        drop_staged(offload)
        raise
    return elementwise, scalars, on_device
