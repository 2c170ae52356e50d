"""Residency: where a rank's training state lives (fp32 masters, optimizer state,
gradient shards, stage-3 parameter shards), chosen once when the engine is built
(``residency_for``). The engine's step asks it for the local gradient norm, the update
and the end-of-step work; its state API for the pieces to export and import; the
rollback for a snapshot. Two implementations:

  Resident   (this file) everything where the model lives; stage-3 rollback snapshots
             in a private disk store (``snapshot.DiskSnapshot``)
  Offloaded  (``offloaded.py``) masters, optimizer state and gradient shards in the
             offload store (``runtime.OffloadedState``), the step streamed in chunks

Both export and import the same world-size-independent pieces (``mct.zero.state_io``),
so state moves freely between them. A third tier implements ``Residency`` in its own
file and is chosen in ``residency_for``; the engine does not change.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Protocol

import torch

from mct.offload.offloaded import Offloaded
from mct.offload.runtime import OffloadedState
from mct.offload.snapshot import DiskSnapshot, DiskSnapshots, EngineSnapshot, MemorySnapshot, Restorable, cpu_copy
from mct.zero import state_io as zstate
from mct.zero.flat import scale_

if TYPE_CHECKING:
    from mct.config import EngineConfig
    from mct.memory.tracker import MemoryTracker
    from mct.zero.comm import Comm
    from mct.zero.flat import FlatParamUnit
    from mct.zero.sharded import ShardedModel

Pieces = tuple[dict[str, torch.Tensor], dict[str, list[int]]]
"""({key: tensor}, {key: [offset, global numel]}): a rank's state as ``state_io`` keys it."""
ReadUnits = Callable[[list[int]], Pieces]
Agree = Callable[[str | None], None]


class Residency(Protocol):
    """Where the state lives. Built before the units (``add_unit`` takes each as it is
    built), then ``bind`` gives it the sharded model and the optimizer over the masters."""

    offloaded: OffloadedState | None
    """The offload runtime (``Engine.offload``), None when nothing is offloaded."""

    def add_unit(self, unit: FlatParamUnit) -> None: ...

    def bind(self, sharded: ShardedModel, optimizer: torch.optim.Optimizer) -> None: ...

    # ---- the step ----
    def step_masters(self) -> list[torch.Tensor]:
        """Tensors the optimizer steps at once (what its temporaries scale with)."""

    def local_sq_norm(self, inv_divisor: float) -> torch.Tensor:
        """After backward: average this rank's gradient shards (x ``inv_divisor``) and
        return the sum of their squared norms (fp64 scalar), nothing updated yet."""

    def update(self, clip_coef: float | None) -> None:
        """The optimizer step over every master (gradients x ``clip_coef`` first unless
        None), then the working parameters published."""

    def end_step(self) -> None:
        """Drop this step's gradients (after the step, a skipped step, or a failure)."""

    def step_metrics(self) -> dict[str, Any]: ...

    def model_state_bytes(self, by_category: dict[str, int]) -> dict[str, int]:
        """``by_category`` (as if resident) corrected for what lives elsewhere."""

    # ---- persistence ----
    def masters_resident(self, write_back: bool) -> ContextManager[None]:
        """Every master in ``unit.master`` for the duration (stored back if ``write_back``)."""

    def master_of(self, i: int) -> ContextManager[torch.Tensor]:
        """Unit ``i``'s fp32 master shard, readable for the duration."""

    def export(self) -> Pieces:
        """This rank's pieces, in memory (views of live state where it is resident)."""

    def export_streamed(self) -> tuple[dict[str, torch.Tensor], dict[str, list[int]],
                                       dict[str, Callable[[], torch.Tensor]]]:
        """As ``export``, but a stored piece is a meta placeholder read by its reader."""

    def load(self, tensors: dict[str, torch.Tensor], extents: dict[str, list[int]],
             hyper: list[dict[str, Any]]) -> None:
        """Set masters, optimizer state and hyperparameters from checked pieces."""

    def load_streamed(self, read_units: ReadUnits, hyper: list[dict[str, Any]], agree: Agree) -> None:
        """Check every unit (``agree`` raises any rank's fault everywhere), then set
        them; one unit in memory besides the state. ValueError: the state untouched."""

    # ---- rollback ----
    def snapshot(self, tag: str, engine: Restorable) -> EngineSnapshot: ...

    def snapshot_bytes(self) -> int:
        """Host-memory bytes a ``snapshot`` taken now would copy (0 where it is kept on disk
        or in the offload store): what the process model counts per rollback snapshot held."""

    def snapshot_from(self, handle: dict[str, Any], engine: Restorable) -> EngineSnapshot:
        """The snapshot object of a ``snapshot(...).handle``."""

    def close(self) -> None: ...


def residency_for(cfg: EngineConfig, *, stage: int, comm: Comm, device: torch.device, tracker: MemoryTracker,
                  inv_divisor: Callable[[], float], chunk_align: int = 1) -> Residency:
    """The residency ``cfg`` asks for: ``Offloaded`` when ``offload.optimizer`` is set
    (its streamed chunks hold multiples of ``chunk_align`` elements: the optimizer
    state's block), else ``Resident``. Raises ValueError for a bad offload.dir."""
    if cfg.offload.enabled:
        return Offloaded(OffloadedState(cfg.offload, stage=stage, comm=comm, device=device, tracker=tracker,
                                        inv_divisor=inv_divisor, chunk_align=chunk_align))
    return Resident(stage=stage, comm=comm, tracker=tracker, snapshot_dir=cfg.offload.dir)


class Resident:
    """All state where the model lives; the optimizer steps the whole master shards."""

    offloaded = None

    def __init__(self, *, stage: int, comm: Comm, tracker: MemoryTracker, snapshot_dir: str) -> None:
        self.stage, self.comm, self.tracker, self.snapshot_dir = stage, comm, tracker, snapshot_dir
        self._disk: DiskSnapshots | None = None  # stage 3: rollback snapshots on disk
        self._opt_state_tracked = False

    def add_unit(self, unit: FlatParamUnit) -> None:
        pass

    def bind(self, sharded: ShardedModel, optimizer: torch.optim.Optimizer) -> None:
        self.sharded, self.optimizer = sharded, optimizer

    # ---- the step ----
    def step_masters(self) -> list[torch.Tensor]:
        return self.sharded.masters()

    def local_sq_norm(self, inv_divisor: float) -> torch.Tensor:
        return self.sharded.local_sq_norm(inv_divisor)

    def update(self, clip_coef: float | None) -> None:
        shards = self.sharded.grad_shards()
        scale_(shards, clip_coef)
        for m, g in zip(self.sharded.masters(), shards):
            m.grad = g
        self.optimizer.step()
        for m in self.sharded.masters():
            m.grad = None
        self.sharded.publish()
        self._track_optimizer_state()

    def end_step(self) -> None:
        self.sharded.zero_grad()

    def step_metrics(self) -> dict[str, Any]:
        return {}

    def model_state_bytes(self, by_category: dict[str, int]) -> dict[str, int]:
        return by_category

    def _track_optimizer_state(self) -> None:
        """Count the optimizer's state tensors as "optimizer" once they exist (after the
        first step, or after a load replaced them)."""
        if self._opt_state_tracked:
            return
        for state in self.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    self.tracker.register(v, "optimizer")
        self._opt_state_tracked = bool(self.optimizer.state)

    def _forget_optimizer_state(self) -> None:
        for v in (v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)):
            self.tracker.unregister(v)

    # ---- persistence ----
    def masters_resident(self, write_back: bool) -> ContextManager[None]:
        return contextlib.nullcontext()

    def master_of(self, i: int) -> ContextManager[torch.Tensor]:
        return contextlib.nullcontext(self.sharded.units[i].master)

    def export(self) -> Pieces:
        return zstate.export_units(self.sharded.units, self.optimizer, self.comm.rank)

    def export_streamed(self) -> tuple[dict[str, torch.Tensor], dict[str, list[int]],
                                       dict[str, Callable[[], torch.Tensor]]]:
        return (*self.export(), {})

    def load(self, tensors: dict[str, torch.Tensor], extents: dict[str, list[int]],
             hyper: list[dict[str, Any]]) -> None:
        self._forget_optimizer_state()
        zstate.load_units(self.sharded.units, self.optimizer, self.comm.rank, tensors, extents, hyper)
        self._opt_state_tracked = False
        self._track_optimizer_state()
        self.sharded.publish()

    def load_streamed(self, read_units: ReadUnits, hyper: list[dict[str, Any]], agree: Agree) -> None:
        """Every unit read and checked, then (all valid) read again straight into the
        masters and the optimizer state, whose old state is freed first."""
        units, rank = self.sharded.units, self.comm.rank
        for _, tensors, _ in zstate.read_checked(units, self.optimizer, rank, read_units, agree):
            del tensors  # pass 1: check every unit, keep none
        # Everything checked: from here on only mutation (pass 2 reads the same verified bytes).
        self._forget_optimizer_state()
        self.optimizer.state.clear()
        state: dict[int, dict[str, torch.Tensor]] = {}
        index, spans = zstate.master_index(self.optimizer), zstate.block_spans(self.optimizer)
        for i in range(len(units)):
            tensors, extents = read_units([i])
            zstate.load_unit(units[i], index, rank, tensors, extents, state, spans)
        zstate.set_optimizer_state(self.optimizer, state, hyper)
        self._opt_state_tracked = False
        self._track_optimizer_state()
        self.sharded.publish()

    # ---- rollback ----
    def snapshot_bytes(self) -> int:
        if self.stage == 3:
            return 0
        tensors, _ = self.export()
        return sum(t.numel() * t.element_size() for t in tensors.values() if isinstance(t, torch.Tensor))

    def snapshot(self, tag: str, engine: Restorable) -> EngineSnapshot:
        """Stages 0-2: a CPU copy in memory. Stage 3: a copy in a private disk store,
        under ``tag`` (the state stage 3 spread over ranks is never held twice)."""
        if self.stage != 3:
            return MemorySnapshot(cpu_copy(engine.state_dict()), engine)
        if self._disk is None:
            self._disk = DiskSnapshots(self.snapshot_dir, name=f"snapshots-rank{self.comm.rank}")
        return self.snapshot_from(cpu_copy(self._disk.write(tag, engine.state_dict())), engine)

    def snapshot_from(self, handle: dict[str, Any], engine: Restorable) -> EngineSnapshot:
        if "disk_snapshot" in handle:
            assert self._disk is not None, "a disk snapshot handle of another engine"
            return DiskSnapshot(handle, self._disk, [u.name for u in self.sharded.units], engine)
        return MemorySnapshot(handle, engine)

    def close(self) -> None:
        if self._disk is not None:
            self._disk.close()
