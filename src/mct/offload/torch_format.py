"""Offloaded optimizer state in torch's ``Optimizer.state_dict()`` format, so that
checkpoints move freely between engines with and without offload (and between tiers):
state tensors of full shard size under each master's index (per-block state: one entry
per block of the shard), scalars beside them, in the dtypes the optimizer keeps.
The ``OffloadedState`` methods of the same names call these; ``offload`` is that state.
"""

from __future__ import annotations

from typing import Any

import torch

from mct.offload.protocols import OffloadedUnits
from mct.offload.store import UnitState, put_record
from mct.zero.state_io import master_index


def optimizer_state_dict(offload: OffloadedUnits, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What ``optimizer.state_dict()`` returns in an engine without offload: state
    tensors of full shard size (read from the store) under each master's index, so
    checkpoints move freely between offloaded and resident engines."""
    offload.stream.drain()
    sd = optimizer.state_dict()
    index = master_index(optimizer)
    for i, u in enumerate(offload.units):
        st = offload.states[i]
        if st is None:
            continue
        entry = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.scalars.items()}
        for k, dt in st.elementwise.items():
            entry[k] = torch.empty(offload.state_numel(k, u.layout.shard_numel), dtype=dt, device=offload.device)
            offload.fetch(offload.store, f"u{i}.{k}", entry[k])
        sd["state"][index[id(u.master)]] = entry
    return sd


def load_optimizer_state_dict(offload: OffloadedUnits, optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    """The inverse of ``optimizer_state_dict``: hyperparameters go to ``optimizer``,
    state tensors of the shard's size to the store, the rest stays resident.
    Raises ValueError for a state tensor of the wrong size or dtype."""
    masters = [p for g in optimizer.param_groups for p in g["params"]]
    entries = dict(sd["state"])  # read before the optimizer forgets its own state (sd may be its state_dict())
    optimizer.load_state_dict({"state": {}, "param_groups": sd["param_groups"]})
    optimizer.state.clear()
    for i, u in enumerate(offload.units):
        n = next(k for k, p in enumerate(masters) if p is u.master)
        entry, S = entries.get(n, entries.get(str(n))), u.layout.shard_numel
        if entry is None:
            offload.states[i] = None
            continue
        group = next(g for g in optimizer.param_groups if any(p is u.master for p in g["params"]))
        on_device = bool(group.get("fused") or group.get("capturable"))
        elementwise = {k: v.dtype for k, v in entry.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
        for k, dt in elementwise.items():
            if entry[k].numel() != offload.state_numel(k, S):
                raise ValueError(f"optimizer state {k!r} of unit {u.name} has {entry[k].numel()} entries; "
                                 f"this engine's shard needs {offload.state_numel(k, S)}: the checkpoint is of "
                                 f"another layout")
            key = f"u{i}.{k}"
            if key not in offload.store.records:
                offload.store.allocate(key, offload.state_numel(k, S), dt)
            elif offload.store.records[key].dtype != dt:
                raise ValueError(f"optimizer state {k!r} of unit {u.name} is {dt}, the store holds "
                                 f"{offload.store.records[key].dtype}")
            put_record(offload.store, key, entry[k])
        scalars = {k: (v.to(offload.device) if on_device else v.clone()) if isinstance(v, torch.Tensor) else v
                   for k, v in entry.items() if k not in elementwise}
        offload.states[i] = UnitState(elementwise, scalars)
    offload.report_offloaded()
