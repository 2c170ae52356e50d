"""Engine: applies checkpointing -> precision -> ZeRO to a model, in that order, and
runs one optimizer step at a time.

    engine = Engine(model, optimizer=lambda groups: torch.optim.AdamW(groups, lr=1e-3),
                    config=EngineConfig.from_dict({"zero": {"stage": 3}}))
    out = engine.train_step(batch_or_list_of_micro_batches, loss_fn)

Gradients are the mean over micro-batches and ranks (as DDP's). The engine uses the
default process group when one is initialized and runs as a single process otherwise.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_map

from mct import optim
from mct.checkpointing import apply_checkpointing, find_blocks
from mct.config import EngineConfig
from mct.dist import DistContext, error_of
from mct.memory.budget import (StepReserve, apply_cuda_budget, cuda_oom_as_budget_error, default_suggestion,
                               optimizer_step_bytes)
from mct.memory import host
from mct.memory.tracker import MemoryBudgetExceeded, MemoryTracker, Phase
from mct.offload import OffloadedState
from mct.offload.meta_init import InitProgram, probe_stand_ins
from mct.precision import LossScaleFloorError, LossScaler, PrecisionPolicy
from mct.zero.comm import Comm, check_ranks_agree
from mct.zero.sharded import ShardedModel
from mct.zero.stage3 import Stage3Lifecycle

OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
LossFn = Callable[[nn.Module, Any], torch.Tensor]

# Optimizers whose update of an element depends on other elements of the same
# tensor: on flat shards they would compute something else than on the parameters.
NON_ELEMENTWISE = ("LBFGS", "SparseAdam", "Adafactor", "Muon", "Shampoo", "Lamb", "LAMB", "LARS", "Lion8bit")


@dataclass
class StepResult:
    loss: float
    """Mean loss over micro-batches and ranks (unscaled)."""
    skipped: bool
    """Non-finite gradients somewhere: no update was applied; do not advance the schedule."""
    grad_norm: float
    """Global L2 norm of the averaged, unscaled gradient, before clipping."""
    loss_scale: float | None
    """fp16: the loss scale used for this step; None otherwise."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """Per-step timings (s), communication, memory peaks (bytes) by phase and category."""


class Engine:
    def __init__(self, model: nn.Module, optimizer: OptimizerFactory | None = None,
                 config: EngineConfig | None = None, *, param_groups: list[dict[str, Any]] | None = None,
                 tracker: MemoryTracker | None = None, ctx: DistContext | None = None,
                 init_program: InitProgram | None = None) -> None:
        """``optimizer`` is called with param groups (``param_groups`` if given, else one
        group of all trainable parameters), once to learn the groups' hyperparameters
        and again over the flat fp32 master shards. ``init_program``: ``model`` was
        built on the meta device by ``mct.offload.record_init``; each unit's parameters
        are materialized (with the values of a normal construction) only when the unit
        is packed, so no rank holds the whole model. Raises ValueError for configs the
        engine cannot honour and when ranks hold different models."""
        self.config = cfg = config or EngineConfig()
        for key, value in (("zero.stage", cfg.zero.stage), ("checkpointing.policy", cfg.checkpointing.policy)):
            if value == "auto":
                raise ValueError(f"{key} = 'auto' must be resolved before the engine is built: `mct train` does "
                                 f"it; from Python call mct.planner.resolve_auto(config, world_size, workload), "
                                 f"which returns the config with the planner's choice (it needs memory.budget)")
        self.ctx = ctx or DistContext.current()
        self.device = self.ctx.device
        # the host allocator first: construction frees parameter-sized temporaries
        self._host_malloc = host.mode_of(cfg, self.device.type)
        self._trim = self.ctx.backend != "simulated" and host.for_building(self._host_malloc)
        enforce = cfg.memory.budget_bytes if cfg.memory.enforce else None
        self.tracker = tracker or MemoryTracker(self.device, enabled=cfg.memory.track, budget_bytes=enforce,
                                                suggestion=default_suggestion(cfg) if enforce else None)
        if enforce and self.device.type == "cuda":
            apply_cuda_budget(self.device, enforce)
        self.precision = PrecisionPolicy.from_config(cfg.precision)
        self.scaler = LossScaler.from_config(cfg.precision)
        self.comm = Comm(self.ctx, bucket_bytes=int(cfg.zero.bucket_mb * 2**20))
        self.model = self._place(model, init_program)
        optimizer = optimizer or optim.make_adamw(cfg.optimizer, lr=cfg.train.lr, seed=cfg.seed)

        # 1. checkpointing (a model transformation; parameter names do not change)
        self.recompute = apply_checkpointing(model, cfg.checkpointing,
                                             recompute_context=lambda: self.tracker.category("activations"))
        # 2. precision: frozen parameters are cast here; trainable ones live in flat units
        groups, hyper = self._discover_groups(optimizer, param_groups)
        self._check_ranks_agree()
        with torch.no_grad():
            for p in model.parameters():
                if not p.requires_grad:
                    p.data = p.data.to(self.precision.param_dtype)
        # 3. ZeRO: flat units (zero.units, by default the checkpointing blocks), shards, hooks
        units = find_blocks(model, cfg.zero.units or cfg.checkpointing.blocks,
                            key="zero.units" if cfg.zero.units else "checkpointing.blocks")
        self.stage = int(cfg.zero.stage)
        self._snapshots: Any = None  # stage 3 without offload: rollback snapshots on disk
        # (offload takes each unit's masters, state and shards as it is built)
        self.offload = (OffloadedState(cfg.offload, stage=self.stage, comm=self.comm, device=self.device,
                                       tracker=self.tracker, inv_divisor=lambda: 1.0 / self._grad_divisor())
                        if cfg.offload.enabled else None)
        self.sharded = ShardedModel(model, groups, units, stage=self.stage, comm=self.comm,
                                    param_dtype=self.precision.param_dtype, reduce_dtype=self.precision.reduce_dtype,
                                    device=self.device, persistent_numel=cfg.zero.persistent_numel,
                                    tracker=self.tracker,
                                    before_unit=(None if init_program is None else
                                                 lambda params: init_program.materialize(params, self.device)),
                                    after_unit=self._unit_built,
                                    shard_align=optim.shard_align(cfg.optimizer.state_dtype))
        self.stage3 = (Stage3Lifecycle(units, self.sharded.units_by_block, self.comm, self.tracker,
                                       cfg.zero.prefetch, root=model) if self.stage == 3 else None)
        self.optimizer = optimizer([
            {**hyper[gi], "params": [u.master for u, g in zip(self.sharded.units, self.sharded.group_of_unit)
                                     if g == gi]}
            for gi in range(len(groups))])
        from mct.zero.state import extent
        optim.place(self.optimizer, [(u.master, extent(u, self.comm.rank)[0]) for u in self.sharded.units],
                    cfg.optimizer.state_dtype)
        self._register_buffers()
        self.steps_done = 0
        self._opt_state_tracked = False
        self._phase_name = "idle"
        self.reserve = self._step_reserve(optimizer, hyper) if enforce else None
        if self._trim:
            host.for_training(self._host_malloc)

    # ---- construction helpers ----
    def _place(self, model: nn.Module, init_program: InitProgram | None) -> nn.Module:
        if init_program is None:
            # Move only what is elsewhere: ``Module.to`` re-wraps every tensor, which fake
            # tensors (the planner's dry runs) refuse once something holds a weakref to them.
            if any(t.device != self.device for t in (*model.parameters(), *model.buffers())):
                model.to(self.device)
            return model
        # built on meta: what no unit packs (buffers, frozen parameters) is materialized now
        init_program.materialize([*model.buffers(), *(p for p in model.parameters() if not p.requires_grad)],
                                 self.device)
        return model

    def _unit_built(self, unit) -> None:
        if self.offload is not None:
            self.offload.add_unit(unit)
        if self.stage == 3:  # free its parameters now, not after every unit is built
            unit.release()
            self.tracker.refresh(unit.working)

    def _discover_groups(self, optimizer: OptimizerFactory, param_groups: list[dict[str, Any]] | None):
        user_groups = param_groups or [{"params": [p for p in self.model.parameters() if p.requires_grad]}]
        user_groups, real_of = probe_stand_ins(user_groups)
        probe = optimizer(user_groups)
        name = type(probe).__name__
        if name in NON_ELEMENTWISE:
            raise ValueError(f"optimizer {name} is not elementwise: its update of one element depends on others, "
                             f"so it cannot run on flat ZeRO shards. Use SGD, Adam, AdamW, Adagrad, RMSprop, ...")
        groups = [[real_of.get(id(p), p) for p in g["params"]] for g in probe.param_groups]
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in probe.param_groups]
        seen = {id(p) for g in groups for p in g}
        names = {id(p): n for n, p in self.model.named_parameters()}
        for p in seen:
            if p not in names:
                raise ValueError("the optimizer factory returned an optimizer over tensors that are not "
                                 "parameters of the model: build it from the `groups` argument it is given")
        for n, p in self.model.named_parameters():
            if p.requires_grad and id(p) not in seen:
                raise ValueError(f"parameter {n!r} requires grad but is in no optimizer param group: "
                                 f"add it to a group or set requires_grad=False")
        del probe
        return groups, hyper

    def _check_ranks_agree(self) -> None:
        items = [(n, f"{tuple(p.shape)} {p.dtype} requires_grad={p.requires_grad}")
                 for n, p in self.model.named_parameters()]
        items.append(("config", repr(sorted((k, repr(v)) for k, v in self.config.to_dict().items()
                                            if k not in ("train", "data")))))
        check_ranks_agree(self.comm, "model parameters (name, shape, dtype) and engine config", items)

    def _step_reserve(self, optimizer: OptimizerFactory, hyper: list[dict[str, Any]]) -> StepReserve:
        masters = self.sharded.masters()
        if self.offload is not None:  # the step runs on one chunk at a time, in the pool's buffers
            masters = [torch.empty(min(m.numel(), self.offload.chunk_numel)) for m in masters]
        first, later = optimizer_step_bytes(optimizer, hyper, self.sharded.group_of_unit, masters)
        publish = max((u.master.numel() * self.precision.param_dtype.itemsize for u in self.sharded.units
                       if u.persistent and u.layout.world > 1), default=0)
        return StepReserve(first, later, publish)

    def _register_buffers(self) -> None:
        for b in self.model.buffers():
            self.tracker.register(b, "params")

    # ---- the step ----
    def train_step(self, batch: Any, loss_fn: LossFn) -> StepResult:
        """One optimizer step over this rank's micro-batch (or list of micro-batches).
        Raises MemoryBudgetExceeded (memory.enforce) before the optimizer modifies any
        master or optimizer state; gradients of the failed step are dropped."""
        micro = batch if isinstance(batch, list) else [batch]
        if not micro:
            raise ValueError("train_step got an empty list of micro-batches")
        try:
            with cuda_oom_as_budget_error(self.tracker, lambda: self._phase_name):
                out = self._train_step(micro, loss_fn)
            if self._trim:
                host.trim()
            return out
        except MemoryBudgetExceeded:
            self.sharded.zero_grad()
            if self.offload is not None:
                self.offload.end_step()
            if self.stage3 is not None:
                self.stage3.end_step()
            raise

    def _train_step(self, micro: list, loss_fn: LossFn) -> StepResult:
        self.tracker.reset_peaks()
        self.comm.reset_stats()
        self.recompute.reset_step()
        times = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self.model.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        kernels = self.precision.kernels(self.device.type)  # one mode object, re-entered per phase
        for i, mb in enumerate(micro):
            mb = self._to_device(mb)
            t0 = time.perf_counter()
            self._phase_name = "forward"
            with self.tracker.phase(Phase.FORWARD, "activations"), self._phase(Phase.FORWARD), kernels:
                with self.precision.autocast(self.device.type):
                    loss = loss_fn(self.model, mb)
            if loss.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar tensor, got shape {tuple(loss.shape)}")
            loss_sum += loss.detach().double()
            t1 = time.perf_counter()
            self._phase_name = "backward"
            with self.tracker.phase(Phase.BACKWARD, "other"), self._phase(Phase.BACKWARD), kernels:
                self.sharded.begin_backward()
                self.scaler.scale_loss(loss.float() / len(micro)).backward()
                self.sharded.end_backward(last_micro=i == len(micro) - 1)
            times["forward"] += t1 - t0
            times["backward"] += time.perf_counter() - t1
        t2 = time.perf_counter()
        self._phase_name = "optimizer"
        start, had_state = self.tracker.live()["total"], bool(self.optimizer.state)
        try:
            with self.tracker.phase(Phase.OPTIMIZER, "other"):
                result = self._optimizer_step(loss_sum / len(micro))
        finally:  # also after LossScaleFloorError: the engine must stay usable
            self._phase_name = "idle"
            if self.stage3 is not None:
                self.stage3.end_step()
        if self.reserve is not None and had_state:  # a first step's growth is mostly the new state
            self.reserve.observe(self.tracker.peaks().get("optimizer", {}).get("total", 0), start)
        times["step"] = time.perf_counter() - t2
        result.metrics = self._step_metrics(times)
        result.metrics["loss_scale"] = result.loss_scale  # the scale used, not the scaler's next one
        return result

    @contextlib.contextmanager
    def _phase(self, phase: Phase):
        if self.stage3 is not None and self.stage3.phase != phase:
            self.stage3.begin(phase)
        yield

    def _optimizer_step(self, local_loss: torch.Tensor) -> StepResult:
        """Unscale + average, check for overflow and clip on the shards, then step the
        master shards and publish them to the working parameters. Nothing is
        modified when any rank saw a non-finite gradient (or when the scaler raises)."""
        offloaded_grads = self.offload is not None and self.offload.offload_grads
        shards = [] if offloaded_grads else self.sharded.grad_shards()
        scale = self.scaler.scale
        if shards:
            torch._foreach_mul_(shards, 1.0 / self._grad_divisor())
        local_sq = self.offload.local_sq_norm() if offloaded_grads else self.sharded.local_sq_norm()
        sums = torch.stack([local_sq.double(), local_loss])
        self.comm.all_reduce_(sums)  # one collective for the norm and the loss
        grad_norm, loss, found_inf = _host_values(sums, self.comm.world)
        loss_scale = scale if self.scaler.enabled else None
        if self.reserve is not None and not found_inf:  # fail here, before anything is modified
            self.tracker.require_headroom(self.reserve.need(first_step=not self.optimizer.state))
        try:
            self.scaler.update(found_inf)  # may raise at the scale floor: nothing was modified yet
        except LossScaleFloorError:
            self.sharded.zero_grad()  # else the non-finite gradient poisons every later step
            if self.offload is not None:
                self.offload.end_step()
            raise
        if not found_inf and self.offload is not None:
            clip = self.config.train.grad_clip
            self.offload.step(self.optimizer, self.sharded.group_of_unit,
                              min(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else None)
            self.steps_done += 1
        elif not found_inf:
            clip = self.config.train.grad_clip
            if clip > 0 and shards:
                torch._foreach_mul_(shards, min(1.0, clip / (grad_norm + 1e-6)))
            for m, g in zip(self.sharded.masters(), shards):
                m.grad = g
            self.optimizer.step()
            for m in self.sharded.masters():
                m.grad = None
            self.sharded.publish()
            self.steps_done += 1
            self._register_optimizer_state()
        self.sharded.zero_grad()
        if self.offload is not None:
            self.offload.end_step()
        return StepResult(loss=loss, skipped=found_inf, grad_norm=grad_norm, loss_scale=loss_scale)

    def _grad_divisor(self) -> float:
        """Reduced gradients are sums over ranks of scaled gradients: divide by both."""
        return self.comm.world * self.scaler.scale

    def _register_optimizer_state(self) -> None:
        """Count the optimizer's state tensors as "optimizer" once they exist (after the
        first step, or after ``load`` replaced them)."""
        if self._opt_state_tracked:
            return
        for state in self.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    self.tracker.register(v, "optimizer")
        self._opt_state_tracked = bool(self.optimizer.state)

    def _step_metrics(self, times: dict[str, float]) -> dict[str, Any]:
        m: dict[str, Any] = {f"time_{k}_s": v for k, v in times.items()}
        m["time_comm_s"] = self.comm.stats.time_s
        m["comm_bytes"] = self.comm.stats.bytes
        m["comm_calls"] = self.comm.stats.calls
        m["peak_bytes"] = self.tracker.peak_total()
        m["peaks"] = self.tracker.peaks()
        m["live"] = self.tracker.live()
        m.update(self.scaler.metrics())
        m.update(self.recompute.metrics())
        if self.stage3 is not None:
            m["zero3_gathers"] = self.stage3.gathers
        if self.offload is not None:
            m["offloaded_bytes"] = self.tracker.offloaded()
            stream = self.offload.stream
            m["time_offload_wait_s"], m["time_offload_io_s"] = stream.io_wait_s, stream.io_busy_s
            stream.io_wait_s = stream.io_busy_s = 0.0
        return m

    def _to_device(self, batch: Any) -> Any:
        return tree_map(lambda t: t.to(self.device, non_blocking=True) if isinstance(t, torch.Tensor) else t, batch)

    # ---- evaluation and state ----
    @torch.no_grad()
    def eval_loss(self, batch: Any, loss_fn: LossFn) -> float:
        """Mean loss over ranks of ``batch`` in eval mode: no grad, no state change,
        no scaler update, and the RNG streams are left exactly as they were."""
        was_training = self.model.training
        self.model.eval()
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), self.tracker.phase(Phase.EVAL, "activations"):
                with (self._phase(Phase.EVAL), self.precision.kernels(self.device.type),
                      self.precision.autocast(self.device.type)):
                    loss = loss_fn(self.model, self._to_device(batch)).detach().double().reshape(1)
                if self.stage3 is not None:
                    self.stage3.end_step()
        finally:
            self.model.train(was_training)
        self.comm.all_reduce_(loss)
        return float(loss) / self.comm.world

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 copy of every parameter, names as ``model.named_parameters()``.
        Collective under ZeRO: every rank must call it."""
        with self._masters_resident(write_back=False):
            trainable = self.sharded.full_state()
        return {n: (trainable[n] if n in trainable else p.detach().float().clone())
                for n, p in self.model.named_parameters()}

    def full_state_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, fp32 tensor) of every parameter, as ``full_state_dict`` but one flat
        unit gathered at a time (its masters read from the offload store if there):
        a tensor is a view valid until the next unit's first item (copy it to keep
        it). Trainable parameters in unit order, then the others. Collective under
        ZeRO: every rank must iterate to the end; mutates nothing."""
        seen = set()
        for i, u in enumerate(self.sharded.units):
            master = self.offload.master_of(i) if self.offload is not None else contextlib.nullcontext(u.master)
            with master as m:
                full = self.sharded.gather_unit(u, m)
            for name, shape, off in zip(u.names, u.layout.shapes, u.layout.offsets):
                seen.add(name)
                yield name, full[off:off + math.prod(shape)].view(shape)
            del full
        for n, p in self.model.named_parameters():
            if n not in seen:
                yield n, p.detach().float()

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every parameter ``full_state_items`` yields, without reading state."""
        shapes = {n: tuple(s) for u in self.sharded.units for n, s in zip(u.names, u.layout.shapes)}
        return {**shapes, **{n: tuple(p.shape) for n, p in self.model.named_parameters() if n not in shapes}}

    def layout(self) -> dict[str, Any]:
        """This rank's state layout without reading any state (cheap under offload):
        ``units`` (as in ``state_dict()``), ``extents`` ({``<unit>/master``: [offset,
        global numel]}: every per-element tensor of a unit has its master's extent) and
        ``local_numel`` ({``<unit>/master``: elements this rank holds}). Not collective."""
        from mct.zero import state as zstate
        return zstate.layout(self.sharded.units, self.sharded.group_of_unit, self.comm.rank,
                             zstate.block_spans(self.optimizer))

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Set every trainable parameter (master and working copies) from fp32 tensors."""
        with self._masters_resident(write_back=True):
            self.sharded.load_full_state(state)

    def close(self) -> None:
        """Release what outlives a step: offload files and the I/O thread (also done
        when the engine is garbage collected). The engine is unusable afterwards."""
        if self.offload is not None:
            self.offload.close()
        if self._snapshots is not None:
            self._snapshots.close()

    def _masters_resident(self, write_back: bool):
        """Offloaded masters read back for the duration (a no-op without offload)."""
        return self.offload.masters_resident(write_back) if self.offload is not None else contextlib.nullcontext()

    STATE_FORMAT = "mct.engine/1"

    def state_dict(self) -> dict[str, Any]:
        """Everything the engine owns that a continuation needs, for this rank:

        ``format``, ``steps_done``, ``scaler`` (plain numbers), ``param_groups`` (each
        optimizer group's hyperparameters, JSON-ready), ``units`` (each flat unit's
        layout, independent of the world size), ``tensors`` ({key: 1-D fp32 piece or
        scalar}: ``<unit>/master`` and ``<unit>/optim/<name>``) and ``extents`` ({key:
        [offset, global numel]} of each 1-D piece in its unit's global flat tensor; see
        ``mct.zero.state``). Tensors are views of live state, not copies: clone them to
        keep a snapshot. Under offload they are copies read back from the store (the
        whole local state is in memory while the result is held): the format is the
        same with and without offload, so state moves freely between them. Not
        collective; mutates nothing."""
        if self.offload is None:
            return self._state_dict()
        with self.offload.resident_state(self.optimizer, write_back=False):
            sd = self._state_dict()
            # masters are views of storage freed on exit; optimizer state was read into fresh tensors
            sd["tensors"] = {k: v.clone() if k.endswith("/master") else v for k, v in sd["tensors"].items()}
        return sd

    def streamed_state_dict(self) -> tuple[dict[str, Any], dict[str, Callable[[], torch.Tensor]]]:
        """``state_dict()`` for writing out piece by piece: (state, readers). The same
        entries and keys; under offload each stored piece is a meta-device placeholder
        (shape, dtype) and ``readers[key]()`` reads it from the store into a new CPU
        tensor when it is written, so a save holds one piece, not the local state.
        Without offload: (``state_dict()``, {}). Not collective; mutates nothing."""
        if self.offload is None:
            return self.state_dict(), {}
        from mct.offload.persist import streamed_pieces
        tensors, extents, readers = streamed_pieces(self.offload, self.comm.rank)
        return {**self._state_header(), "tensors": tensors, "extents": extents}, readers

    def _state_header(self) -> dict[str, Any]:
        from mct.zero import state as zstate
        return {"format": self.STATE_FORMAT, "steps_done": self.steps_done, "scaler": self.scaler.state_dict(),
                "param_groups": zstate.group_hyper(self.optimizer),
                "units": [zstate.unit_record(u, g) for u, g in zip(self.sharded.units, self.sharded.group_of_unit)]}

    def _state_dict(self) -> dict[str, Any]:
        from mct.zero import state as zstate
        tensors, extents = zstate.export_units(self.sharded.units, self.optimizer, self.comm.rank)
        return {**self._state_header(), "tensors": tensors, "extents": extents}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict()`` of an engine with the same model, optimizer set-up
        and this rank's sharding returned (tensors may be on any device; with or without
        offload on either side). Validates all of it first and raises ValueError naming
        the fault with the engine untouched; then sets the master shards (and working
        parameters), optimizer state and hyperparameters, loss scaler and
        ``steps_done``. Not collective at stage 0/3; at stages 1/2 publishing the
        masters all-gathers, so every rank must call it."""
        from mct.zero import state as zstate
        mine = [zstate.unit_record(u, g) for u, g in zip(self.sharded.units, self.sharded.group_of_unit)]
        steps = zstate.check_header(state, self.STATE_FORMAT, mine)
        hyper = zstate.check_hyper(self.optimizer, state["param_groups"])
        zstate.check_units(self.sharded.units, self.optimizer, self.comm.rank, state["tensors"], state["extents"])
        LossScaler.from_config(self.config.precision).load_state_dict(state["scaler"])  # validates only
        # Everything checked: from here on only mutation.
        if self.offload is not None:
            with self.offload.masters_resident(write_back=True):  # the old optimizer state is not read
                zstate.load_units(self.sharded.units, self.optimizer, self.comm.rank, state["tensors"],
                                  state["extents"], hyper)
                self.sharded.publish()  # while the masters are resident
            self.offload.load_optimizer_state_dict(self.optimizer, self.optimizer.state_dict())  # -> the store
            self.offload.end_step()
        else:
            for v in (v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)):
                self.tracker.unregister(v)
            zstate.load_units(self.sharded.units, self.optimizer, self.comm.rank, state["tensors"],
                              state["extents"], hyper)
            self._opt_state_tracked = False
            self._register_optimizer_state()
            self.sharded.publish()
        self._set_counters(state["scaler"], steps)

    def load_state_streamed(self, header: dict[str, Any], read_units: Callable[[list[int]], tuple[dict, dict]]) -> None:
        """``load_state_dict`` for state read a unit at a time, never a second copy of
        this rank's state. ``header``: what ``state_dict()`` holds but
        ``tensors``/``extents``, plus ``keys`` (every tensor key); ``read_units(indices)``
        returns (tensors, extents) of those units (collective). Under offload each unit
        is read, checked and staged in the store, and replaces the live state only once
        all passed. Resident: every unit is read and checked, then (all valid) read again
        straight into the masters and the optimizer state, whose old state is freed
        first (twice the reads, one unit beside the state). Every rank learns of a fault
        found on any rank after each unit (no rank is left in a collective). A failure
        raises ValueError, the engine untouched. Collective."""
        from mct.zero import state as zstate
        units, rank = self.sharded.units, self.comm.rank
        mine = [zstate.unit_record(u, g) for u, g in zip(units, self.sharded.group_of_unit)]
        steps = zstate.check_header({**header, "tensors": {}, "extents": {}}, self.STATE_FORMAT, mine)
        hyper = zstate.check_hyper(self.optimizer, header["param_groups"])
        LossScaler.from_config(self.config.precision).load_state_dict(header["scaler"])  # validates only
        zstate.check_keys(units, header["keys"])
        if self.offload is not None:
            from mct.offload.persist import stage_units
            elementwise, scalars, on_device = stage_units(self.offload, self.sharded.group_of_unit, self.optimizer,
                                                          rank, read_units, self._agree_error)
            # Everything checked and staged: from here on only mutation.
            zstate.set_optimizer_state(self.optimizer, {}, hyper)  # hyperparameters; the state is in the store
            self.optimizer.state.clear()
            self.offload.commit_staged(elementwise, scalars, on_device)
        else:
            for i, u in enumerate(units):  # pass 1: check every unit, keep none
                tensors, extents = read_units([i])
                self._agree_error(error_of(zstate.check_units, [u], self.optimizer, rank, tensors, extents))
                del tensors
            # Everything checked: from here on only mutation (pass 2 reads the same verified bytes).
            for v in (v for st in self.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)):
                self.tracker.unregister(v)
            self.optimizer.state.clear()
            state: dict[int, dict[str, torch.Tensor]] = {}
            index = zstate.master_index(self.optimizer)
            for i in range(len(units)):
                tensors, extents = read_units([i])
                zstate.load_unit(units[i], index, rank, tensors, extents, state, zstate.block_spans(self.optimizer))
            zstate.set_optimizer_state(self.optimizer, state, hyper)
            self._opt_state_tracked = False
            self._register_optimizer_state()
            self.sharded.publish()
        self._set_counters(header["scaler"], steps)

    def _agree_error(self, error: str | None) -> None:
        """Raise the first rank's fault (ValueError) on every rank, or nothing."""
        errors = [e for e in self.comm.all_gather_object(error) if e is not None]
        if errors:
            raise ValueError(errors[0])

    def _set_counters(self, scaler: dict[str, Any], steps_done: int) -> None:
        self.scaler.load_state_dict(scaler)
        self.steps_done = steps_done
        self.sharded.zero_grad()

    def snapshot_state(self, tag: str = "snapshot") -> dict[str, Any]:
        """State for an in-memory rollback target: ``state_dict()`` (references: the
        caller copies); under offload a small handle to a copy kept in the offload store
        under ``tag``; at stage 3 a handle to a copy in a private disk store (the state
        that stage 3 spread over ranks is never held twice in memory). A new snapshot
        with the same tag replaces it. Not collective; call between steps."""
        if self.offload is not None:
            return {"offload_snapshot": self.offload.snapshot(tag), "steps_done": self.steps_done,
                    "scaler": self.scaler.state_dict()}
        if self.stage == 3:
            if self._snapshots is None:
                from mct.offload.snapshot import DiskSnapshots
                self._snapshots = DiskSnapshots(self.config.offload.dir, name=f"snapshots-rank{self.comm.rank}")
            return self._snapshots.write(tag, self.state_dict())
        return self.state_dict()

    def load_snapshot_state(self, sd: dict[str, Any]) -> None:
        """Restore what ``snapshot_state`` returned (stages 1/2: collective, as
        ``load_state_dict``)."""
        if "offload_snapshot" in sd:
            self.offload.restore_snapshot(sd["offload_snapshot"])
            self._set_counters(sd["scaler"], sd["steps_done"])
        elif "disk_snapshot" in sd:
            names = [u.name for u in self.sharded.units]
            self.load_state_streamed({**sd, "keys": list(sd["specs"])},
                                     self._snapshots.reader(sd, names, self.device))
        else:
            self.load_state_dict(sd)

    def save(self, path: str) -> None:
        """Write this engine's state to the directory ``path`` (a sharded checkpoint,
        see ``mct.persistence``). Collective: every rank must call it."""
        from mct.persistence.checkpoint import save_engine
        save_engine(self, path)

    def load(self, path: str) -> None:
        """Load a checkpoint written by ``save`` (any world size and ZeRO stage).
        Raises ValueError naming the file and the fault, with the engine untouched.
        Collective: every rank must call it."""
        from mct.persistence.checkpoint import load_engine
        load_engine(self, path)

    def model_state_bytes(self) -> dict[str, int]:
        """Per-rank bytes of model state held during a step, by category (optimizer
        included). At stages 2/3 this counts the fp32 gradient shards, which exist
        only from backward to the end of the optimizer step (``tracker.live()``
        between steps shows no gradients there); see ``ShardedModel.bytes_by_category``."""
        out = self.sharded.bytes_by_category()
        out["optimizer"] = sum(v.numel() * v.element_size() for s in self.optimizer.state.values()
                               for v in s.values() if isinstance(v, torch.Tensor))
        return self.offload.resident_adjustment(out) if self.offload is not None else out


def _host_values(sums: torch.Tensor, world: int) -> tuple[float, float, bool]:
    """(global grad norm, mean loss, found_inf) from the all-reduced [sq_norm, loss_sum].
    Fake tensors (the planner's runs) hold no values: they take a clean step's path."""
    if is_fake(sums):
        return 0.0, 0.0, False
    return float(sums[0].sqrt()), float(sums[1]) / world, not torch.isfinite(sums[0]).item()
