"""Rollback snapshots of a resident ZeRO-3 engine on disk: the state that stage 3 spread
over the ranks is not copied into host memory a second time. Each tensor of
``Engine.state_dict()`` goes to a record of a private disk store, a chunk at a time,
under its tag; a restore reads one unit back at a time (``Engine.load_state_streamed``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from mct.offload.store import DiskStore, put_record


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
