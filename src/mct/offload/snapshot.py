"""Rollback snapshots: objects that know how to restore themselves, so whoever keeps
one (the rollback) never looks at its format. Three kinds, one per place the copy lives:

  MemorySnapshot  ``Engine.state_dict()`` copied to CPU (resident stages 0-2)
  StoreSnapshot   records ``<tag>.u<i>.*`` in the offload store (any stage under offload)
  DiskSnapshot    each tensor of ``state_dict()`` in a private disk store (resident stage 3:
                  the state that stage 3 spread over the ranks is not copied into host
                  memory a second time; restored a unit at a time, ``load_state_streamed``)

``handle`` is each one's plain-dict form, what ``Engine.snapshot_state`` returns and
``Engine.load_snapshot_state`` takes (``snapshot_from`` turns it back into the object).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from mct.offload.store import DiskStore, put_record

if TYPE_CHECKING:
    from mct.offload.runtime import OffloadedState
    from mct.precision import LossScaler


def cpu_copy(obj: Any) -> Any:
    """Deep copy with every tensor cloned to CPU (a snapshot that the next steps cannot
    modify in place)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


class Restorable(Protocol):
    """What a snapshot restores through (``mct.Engine`` is one)."""

    steps_done: int
    scaler: LossScaler
    device: torch.device

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def load_state_streamed(self, header: dict[str, Any],
                            read_units: Callable[[list[int]], tuple[dict, dict]]) -> None: ...

    def set_counters(self, scaler: dict[str, Any], steps_done: int) -> None: ...


class EngineSnapshot(Protocol):
    """A copy of an engine's state that puts itself back: ``restore()`` (between steps;
    at stages 1/2 collective). ``tag``: the store tag it occupies (a new snapshot must
    take another one to keep this one), None for a copy in memory."""

    tag: str | None
    handle: dict[str, Any]

    def restore(self) -> None: ...


class MemorySnapshot:
    def __init__(self, state: dict[str, Any], engine: Restorable) -> None:
        self.tag, self.handle, self._engine = None, state, engine

    def restore(self) -> None:
        self._engine.load_state_dict(self.handle)


class StoreSnapshot:
    def __init__(self, handle: dict[str, Any], runtime: OffloadedState, engine: Restorable) -> None:
        self.tag, self.handle = handle["offload_snapshot"]["tag"], handle
        self._runtime, self._engine = runtime, engine

    def restore(self) -> None:
        self._runtime.restore_snapshot(self.handle["offload_snapshot"])
        self._engine.set_counters(self.handle["scaler"], self.handle["steps_done"])


class DiskSnapshot:
    def __init__(self, handle: dict[str, Any], store: DiskSnapshots, unit_names: list[str],
                 engine: Restorable) -> None:
        self.tag, self.handle = handle["disk_snapshot"]["tag"], handle
        self._store, self._names, self._engine = store, unit_names, engine

    def restore(self) -> None:
        h = self.handle
        self._engine.load_state_streamed({**h, "keys": list(h["specs"])},
                                         self._store.reader(h, self._names, self._engine.device))


class DiskSnapshots:
    """Tagged copies of a state dict's tensors in one disk store under ``root``
    ('' = the system's temp dir); a new snapshot under a tag replaces the old one."""

    def __init__(self, root: str, name: str) -> None:
        self.root, self.name = root, name
        self.store: DiskStore | None = None

    def write(self, tag: str, sd: dict[str, Any]) -> dict[str, Any]:
        """Copy every tensor of ``sd["tensors"]`` to the store under ``tag``; returns the
        handle (no tensors): tag, tensor specs, extents, and the rest of ``sd``."""
        if self.store is None:
            self.store = DiskStore(self.root, name=self.name)
        specs = {}
        for k, t in sd["tensors"].items():
            rec = f"{tag}/{k}"
            old = self.store.records.get(rec)
            if old is not None and (old.numel != t.numel() or old.dtype != t.dtype):
                self.store.release(rec)
            if rec not in self.store.records:
                self.store.allocate(rec, t.numel(), t.dtype)
            put_record(self.store, rec, t.detach())
            specs[k] = (list(t.shape), t.dtype)
        return {**{k: v for k, v in sd.items() if k != "tensors"}, "disk_snapshot": {"tag": tag}, "specs": specs}

    def reader(self, handle: dict[str, Any], unit_names: list[str],
               device: torch.device) -> Callable[[list[int]], tuple[dict, dict]]:
        """``read_units(indices)`` for ``Engine.load_state_streamed``: fresh tensors of
        those units' pieces, read from the store."""
        tag, specs, extents = handle["disk_snapshot"]["tag"], handle["specs"], handle["extents"]
        assert self.store is not None

        def read_units(indices: list[int]) -> tuple[dict, dict]:
            wanted = {unit_names[i] for i in indices}
            tensors = {}
            for k, (shape, dtype) in specs.items():
                if k.rsplit("/optim/", 1)[0].removesuffix("/master") not in wanted:
                    continue
                t = torch.empty(shape, dtype=dtype)
                self.store.read(f"{tag}/{k}", 0, t.numel(), t.view(-1))
                tensors[k] = t.to(device)
            return tensors, {k: v for k, v in extents.items() if k in tensors}
        return read_units

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
