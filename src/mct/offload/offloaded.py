"""Offloaded: the ``Residency`` (see ``residency.py``) whose masters, optimizer state
and gradient shards (stages 2/3) live in the offload store. It owns the live runtime
(``runtime.OffloadedState``: the stores, the buffer pool, the chunked step) and hands
checkpoint work to ``persist.py`` and rollback snapshots to ``snapshot.StoreSnapshot``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ContextManager

import torch

from mct.offload import persist
from mct.offload.runtime import OffloadedState
from mct.offload.snapshot import EngineSnapshot, MemorySnapshot, Restorable, StoreSnapshot, cpu_copy
from mct.zero import state_io as zstate

if TYPE_CHECKING:
    from mct.zero.flat import FlatParamUnit
    from mct.zero.sharded import ShardedModel


class Offloaded:
    def __init__(self, runtime: OffloadedState) -> None:
        self.offloaded = runtime

    def add_unit(self, unit: FlatParamUnit) -> None:
        self.offloaded.add_unit(unit)

    def bind(self, sharded: ShardedModel, optimizer: torch.optim.Optimizer) -> None:
        self.sharded, self.optimizer = sharded, optimizer
        self.offloaded.bind(optimizer)

    # ---- the step ----
    def step_masters(self) -> list[torch.Tensor]:
        """The step runs on one chunk at a time, in the pool's buffers."""
        return [torch.empty(min(m.numel(), self.offloaded.chunk_numel)) for m in self.sharded.masters()]

    def local_sq_norm(self, inv_divisor: float) -> torch.Tensor:
        """Stages 2/3: the norms taken as each gradient shard was stored; stages 0/1:
        the resident shards, averaged here (the chunked step reads them)."""
        if self.offloaded.offload_grads:
            return self.offloaded.local_sq_norm()
        return self.sharded.local_sq_norm(inv_divisor)

    def update(self, clip_coef: float | None) -> None:
        self.offloaded.step(self.optimizer, self.sharded.group_of_unit, clip_coef)

    def end_step(self) -> None:
        self.sharded.zero_grad()
        self.offloaded.end_step()

    def step_metrics(self) -> dict[str, Any]:
        stream = self.offloaded.stream
        m = {"offloaded_bytes": self.offloaded.tracker.offloaded(),
             "time_offload_wait_s": stream.io_wait_s, "time_offload_io_s": stream.io_busy_s}
        stream.io_wait_s = stream.io_busy_s = 0.0
        return m

    def model_state_bytes(self, by_category: dict[str, int]) -> dict[str, int]:
        return self.offloaded.resident_adjustment(by_category)

    # ---- persistence ----
    def masters_resident(self, write_back: bool) -> ContextManager[None]:
        return self.offloaded.masters_resident(write_back)

    def master_of(self, i: int) -> ContextManager[torch.Tensor]:
        return self.offloaded.master_of(i)

    def export(self) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
        """Copies read back from the store (the whole local state in memory while held)."""
        with self.offloaded.resident_state(self.optimizer, write_back=False):
            tensors, extents = zstate.export_units(self.sharded.units, self.optimizer, self.offloaded.comm.rank)
            # masters are views of storage freed on exit; optimizer state was read into fresh tensors
            tensors = {k: v.clone() if k.endswith("/master") else v for k, v in tensors.items()}
        return tensors, extents

    def export_streamed(self) -> tuple[dict[str, torch.Tensor], dict[str, list[int]],
                                       dict[str, Callable[[], torch.Tensor]]]:
        return persist.streamed_pieces(self.offloaded, self.offloaded.comm.rank)

    def load(self, tensors: dict[str, torch.Tensor], extents: dict[str, list[int]],
             hyper: list[dict[str, Any]]) -> None:
        with self.offloaded.masters_resident(write_back=True):  # the old optimizer state is not read
            zstate.load_units(self.sharded.units, self.optimizer, self.offloaded.comm.rank, tensors, extents, hyper)
            self.sharded.publish()  # while the masters are resident
        self.offloaded.load_optimizer_state_dict(self.optimizer, self.optimizer.state_dict())  # -> the store
        self.offloaded.end_step()

    def load_streamed(self, read_units: Callable[[list[int]], tuple[dict, dict]], hyper: list[dict[str, Any]],
                      agree: Callable[[str | None], None]) -> None:
        """Each unit read, checked and staged in the store; the staged records replace
        the live state only once all passed."""
        elementwise, scalars, on_device = persist.stage_units(self.offloaded, self.sharded.group_of_unit,
                                                              self.optimizer, self.offloaded.comm.rank,
                                                              read_units, agree)
        # Everything checked and staged: from here on only mutation.
        zstate.set_optimizer_state(self.optimizer, {}, hyper)  # hyperparameters; the state is in the store
        self.optimizer.state.clear()
        self.offloaded.commit_staged(elementwise, scalars, on_device)

    # ---- rollback ----
    def snapshot_bytes(self) -> int:
        return 0  # the copy is made inside the offload store

    def snapshot(self, tag: str, engine: Restorable) -> EngineSnapshot:
        """A copy in the offload store under ``tag`` (never the whole state in memory)."""
        handle = {"offload_snapshot": self.offloaded.snapshot(tag), "steps_done": engine.steps_done,
                  "scaler": engine.scaler.state_dict()}
        return StoreSnapshot(cpu_copy(handle), self.offloaded, engine)

    def snapshot_from(self, handle: dict[str, Any], engine: Restorable) -> EngineSnapshot:
        if "offload_snapshot" in handle:
            return StoreSnapshot(handle, self.offloaded, engine)
        return MemorySnapshot(handle, engine)

    def close(self) -> None:
        self.offloaded.close()
