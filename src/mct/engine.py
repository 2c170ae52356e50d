"""Engine: applies checkpointing -> precision -> ZeRO to a model, in that order, keeps
the state where its ``Residency`` says (``mct.offload.residency``) and runs one optimizer
step at a time; its state API is a facade over ``mct.persistence.engine_state``.

    engine = Engine(model, optimizer=lambda groups: torch.optim.AdamW(groups, lr=1e-3),
                    config=EngineConfig.from_dict({"zero": {"stage": 3}}))
    out = engine.train_step(batch_or_list_of_micro_batches, loss_fn)

Gradients are the mean over micro-batches and ranks (as DDP's), over the default
process group when one is initialized (else a single process)."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_map

from mct import optim
from mct.adapters import check_adapted
from mct.adapters.qlora import nf4_codecs
from mct.checkpointing import apply_checkpointing, disable_kv_cache, find_blocks
from mct.checkpointing.blocks import find_input_embedding, find_output_head
from mct.config import EngineConfig
from mct.context import context_parallel
from mct.dist import DistContext, agree
from mct.memory.budget import apply_cuda_budget, cuda_oom_as_budget_error, default_suggestion, step_reserve
from mct.memory import host
from mct.memory.tracker import MemoryBudgetExceeded, MemoryTracker, Phase
from mct.memory.watch import ResidentWatch
from mct.task.init_program import InitProgram, place_model
from mct.offload.residency import Residency, residency_for
from mct.offload.snapshot import EngineSnapshot
from mct.persistence import engine_state
from mct.persistence.checkpoint import load_engine, save_engine
from mct.precision import LossScaleFloorError, LossScaler, PrecisionPolicy
from mct.task.groups import agreement_items, discover_groups
from mct.task.spec import LossFn, OptimizerFactory
from mct.task.chunked import attach_head_rows
from mct.task.vocab_slices import head_rows
from mct.zero.comm import Comm, first_mismatch
from mct.zero.frozen import FrozenModel, split_frozen_ends
from mct.zero.frozen_codec import IdentityCodec
from mct.zero.shm import SETUP_FAILED, share_masters
from mct.zero.sharded import ShardedModel, ShardingPolicy, UnitHooks, assign_units
from mct.zero.state_io import shard_start
from mct.zero.stage3 import Stage3Lifecycle

log = logging.getLogger(__name__)


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
        and again over the flat fp32 master shards. ``init_program``: ``model`` was built
        on meta by ``mct.offload.record_init``; each unit is materialized (the values of
        a normal construction) only when packed, so no rank holds the whole model.
        Raises ValueError for configs it cannot honour and when ranks hold different models."""
        self.config = cfg = config or EngineConfig()
        cfg.check_resolved()
        check_adapted(model, cfg.adapter)
        self.ctx = ctx or DistContext.current()
        self.device = self.ctx.device
        # the host allocator first: construction frees parameter-sized temporaries
        self._host_malloc = host.mode_of(cfg, self.device.type)
        self._trim = self.ctx.backend != "simulated" and host.for_building(self._host_malloc)  # then for_training
        self._trim_steps = self._trim and host.trims_steps(self._host_malloc)
        enforce = cfg.memory.budget if cfg.memory.enforce else None
        # a budget counting the process is watched on the resident set (CUDA: reserved + context) too
        watch = ResidentWatch(enforce, self.device) if enforce and cfg.memory.counts_process else None
        self.tracker = tracker or MemoryTracker(self.device, enabled=cfg.memory.track, budget_bytes=enforce,
                                                suggestion=default_suggestion(cfg) if enforce else None, watch=watch)
        if enforce and self.device.type == "cuda":
            apply_cuda_budget(self.device, enforce, context=watch.cuda_context if watch else 0)
        self.precision = PrecisionPolicy.from_config(cfg.precision)
        self.scaler = LossScaler.from_config(cfg.precision)
        self.comm = Comm(self.ctx, bucket_bytes=int(cfg.zero.bucket_mb * 2**20),
                         advise=host.HugePages(cfg.memory.huge_pages and self.ctx.backend != "simulated", self.device),
                         simulated_gloo=cfg.distributed.backend != "nccl")
        self.model = place_model(model, self.device, init_program)
        optimizer = optimizer or optim.make_adamw(cfg.optimizer, lr=cfg.train.lr, seed=cfg.seed)

        # 0. context parallelism: this rank's group and the model's attention routed through it
        disable_kv_cache(model)
        self.context = context_parallel(cfg.parallel, model, rank=self.ctx.rank, world=self.ctx.world_size,
                                        simulated=self.ctx.backend == "simulated")
        # 1. checkpointing (a model transformation; parameter names do not change)
        self.recompute = apply_checkpointing(
            model, cfg.checkpointing, recompute_context=lambda: self.tracker.category("activations"),
            device=self.device, offload_dir=cfg.offload.dir, name=f"rank{self.ctx.rank}",
            report=lambda tier, n: self.tracker.set_offloaded(tier, n, source="activations"), advise=self.comm.advise,
            planned_for="cuda" if self.comm.simulated and not self.comm.simulated_gloo else None)  # a dry run of NCCL ranks
        # 2. precision: frozen parameters are cast here (on meta: once materialized, by their
        # units); trainable ones live in flat units
        groups, hyper = discover_groups(model, optimizer, param_groups)
        agree(first_mismatch(self.comm, "model parameters (name, shape, dtype) and engine config",
                             agreement_items(model, cfg)), self.comm)
        with torch.no_grad():  # built on meta (init_program): the frozen units cast each as they materialize it
            for p in (p for p in model.parameters() if not p.requires_grad and not p.is_meta and init_program is None):
                p.data = p.data.to(self.precision.param_dtype)
        # 3. ZeRO: flat units (zero.units, by default the checkpointing blocks), shards, hooks
        units = find_blocks(model, cfg.zero.units or cfg.checkpointing.blocks,
                            key="zero.units" if cfg.zero.units else "checkpointing.blocks")
        self.stage = int(cfg.zero.stage)
        # where the state lives, chosen once (offload takes each unit's state as it is built)
        align = optim.shard_align(cfg.optimizer.state_dtype)  # whole quantization blocks per shard and chunk
        self.residency: Residency = residency_for(cfg, stage=self.stage, comm=self.comm, device=self.device,
                                                  tracker=self.tracker, inv_divisor=lambda: 1.0 / self._grad_divisor(),
                                                  chunk_align=align)
        self.offload = self.residency.offloaded  # the offload runtime, or None
        sharding = ShardingPolicy(self.stage, cfg.zero.persistent_numel, shard_align=align)
        self.sharded = ShardedModel(model, groups, units, sharding=sharding, precision=self.precision,
                                    comm=self.comm, device=self.device, tracker=self.tracker,
                                    hooks=UnitHooks(None, self._unit_built,
                                                    None if init_program is None else init_program.chunks),
                                    partial_grads=lambda: self.recompute.more_tiles)
        # frozen parameters: sharded at stages 1-3 (on the device: parameter offload streams
        # trainable units only), gathered per unit by the same lifecycle as stage 3's;
        # QLoRA's linear weights stored as NF4 at every stage (whole units at stage 0)
        # sharded, a frozen input embedding and untied head get units of their own, gathered
        # around their call (the head's again for its backward), not held for the whole step
        unit_of = assign_units(model, units)
        sharded = self.stage >= 1
        first = split_frozen_ends(model, unit_of, [find_input_embedding(model)]) if sharded else []
        last = split_frozen_ends(model, unit_of, [find_output_head(model)]) if sharded else []
        gathered = [*first, *units, *last]  # in the order the step uses them
        slices = cfg.train.loss_vocab_slice  # a frozen head streamed in vocabulary slices: rows per shard
        self.frozen = FrozenModel(model, unit_of, ["root", *(b for b, _ in gathered)],
                                  shard=self.stage >= 1, comm=self.comm,
                                  row_units={n: m.weight[0].numel() for n, m in last
                                             if slices and getattr(m, "weight", None) is not None},
                                  dtype=self.precision.param_dtype, codec=IdentityCodec(self.precision.param_dtype),
                                  device=self.device, tracker=self.tracker, coded=nf4_codecs(model, cfg.adapter),
                                  materialize=None if init_program is None else
                                  lambda params: init_program.materialize(params, self.device),
                                  values=None if init_program is None else init_program.chunks)
        lifecycle = {b: [*(self.sharded.units_by_block.get(b, []) if self.stage == 3 else []),
                         *self.frozen.units_by_block.get(b, [])] for b in ["root", *(b for b, _ in gathered)]}
        lifecycle = {b: us for b, us in lifecycle.items() if us}
        head = find_output_head(model)
        head_unit = self.frozen.units_by_block[last[0][0]][0] if last else None
        rows = head_rows(head, head_unit, self.comm, slices)
        if rows is not None:
            attach_head_rows(head, rows)
        self.stage3 = (Stage3Lifecycle(gathered, lifecycle, self.comm, self.tracker, cfg.zero.prefetch, root=model,
                                       reshard_root=cfg.zero.reshard_root_after_forward,
                                       streams={last[0][0]: rows} if rows is not None and head_unit is not None else None)
                       if lifecycle or self.stage == 3 else None)
        # one host, stage 3: a step's gathers read the peers' masters (or their casts) from shared memory
        self.shared, why = share_masters(self.sharded.units, self.comm, enabled=cfg.distributed.shared_memory,
                                         resident=self.offload is None)
        for u in self.sharded.units:  # bf16/fp16: each shard's published cast, a parameter copy
            if u.published is not None:
                self.tracker.register(u.published, "params")
        # tried and failed (no room in /dev/shm, ranks on other hosts): a notice for the user
        self.shared_note = why if why.startswith(SETUP_FAILED) else ""
        if self.shared is None and self.stage == 3 and self.comm.world > 1 and not self.comm.simulated:
            log.info("stage-3 gathers send messages (no shared memory: %s)", why)
        owned = list(zip(self.sharded.units, self.sharded.group_of_unit))
        self.optimizer = optimizer([{**hyper[gi], "params": [u.master for u, g in owned if g == gi]}
                                    for gi in range(len(groups))])
        optim.place(self.optimizer, [(u.master, shard_start(u, self.comm.rank)) for u in self.sharded.units],
                    cfg.optimizer.state_dtype)  # low-precision state on the units' global flat index
        self.residency.bind(self.sharded, self.optimizer)
        # buffers: whole on every rank, counted as the planner does (frozen parameters, an adapter
        # run's base, are counted under 'frozen' by their units, or loose at stage 0: mct.zero.frozen)
        self.tracker.register_all(model.buffers(), "params")
        self.steps_done, self._phase_name = 0, "idle"
        self.reserve = (step_reserve(optimizer, hyper, self.sharded.group_of_unit, self.residency.step_masters(),
                                     self.sharded.units, self.precision.param_dtype) if enforce else None)
        if self._trim:
            host.for_training(self._host_malloc)

    def _unit_built(self, unit) -> None:
        self.residency.add_unit(unit)
        if self.stage == 3:  # free its parameters now, not after every unit is built
            unit.release()
            self.tracker.refresh(unit.working)

    # ---- the step ----
    def train_step(self, batch: Any, loss_fn: LossFn, *, track_memory: bool = True) -> StepResult:
        """One optimizer step over this rank's micro-batch (or list of micro-batches).
        MemoryBudgetExceeded (memory.enforce) comes before any state is modified.
        ``track_memory=False``: the CPU tracker counts nothing this step (metrics: ``peak_bytes``
        None, no ``peaks``); ignored under a budget, with ``memory.track`` off and on CUDA."""
        micro = batch if isinstance(batch, list) else [batch]
        if not micro:
            raise ValueError("train_step got an empty list of micro-batches")
        try:
            with (cuda_oom_as_budget_error(self.tracker, lambda: self._phase_name),
                  contextlib.nullcontext() if track_memory else self.tracker.uncounted()):
                out = self._train_step(micro, loss_fn)
            if self._trim_steps:
                host.trim()
            return out
        except MemoryBudgetExceeded:
            self.residency.end_step()
            if self.stage3 is not None:
                self.stage3.end_step()
            raise

    def _train_step(self, micro: list, loss_fn: LossFn) -> StepResult:
        self.tracker.reset_peaks()
        self.tracker.reset_churn()
        self.comm.reset_stats()
        self.recompute.reset_step()
        times = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        faults = host.minor_faults()
        self.model.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        kernels = self.precision.kernels(self.device.type)  # one mode object, re-entered per phase
        window = self.shared.window() if self.shared is not None else contextlib.nullcontext()
        with window:  # peers' shared masters are read only here: no rank writes them until it closes
            loss_sum = self._forward_backward(micro, loss_fn, loss_sum, times, kernels)
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
        result.metrics["page_faults"] = None if faults is None else host.minor_faults() - faults
        return result

    def _forward_backward(self, micro: list, loss_fn: LossFn, loss_sum: torch.Tensor, times: dict[str, float],
                          kernels) -> torch.Tensor:
        """Every micro-batch's forward and backward (gradients reduced after the last);
        returns ``loss_sum`` plus their losses."""
        for i, mb in enumerate(micro):
            mb = self._to_device(mb)
            t0 = time.perf_counter()
            self._phase_name = "forward"
            with self.tracker.phase(Phase.FORWARD, "activations"), self._phase(Phase.FORWARD), kernels:
                with self.precision.autocast(self.device.type):
                    loss = self.context.loss(loss_fn, self.model, mb)
            if loss.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar tensor, got shape {tuple(loss.shape)}")
            loss_sum += loss.detach().double()
            t1 = time.perf_counter()
            self._phase_name = "backward"
            with self.tracker.phase(Phase.BACKWARD, "other"), self._phase(Phase.BACKWARD), kernels:
                self.sharded.begin_backward()
                self.scaler.scale_loss(loss.float() / len(micro)).backward()
                if self.stage3 is not None:
                    self.stage3.after_backward()
                self.sharded.end_backward(last_micro=i == len(micro) - 1)
            times["forward"] += t1 - t0
            times["backward"] += time.perf_counter() - t1
        return loss_sum

    @contextlib.contextmanager
    def _phase(self, phase: Phase):
        if self.stage3 is not None and self.stage3.phase != phase:
            self.stage3.begin(phase)
        yield

    def _optimizer_step(self, local_loss: torch.Tensor) -> StepResult:
        """Unscale + average, check for overflow and clip on the shards, then step the
        master shards and publish them to the working parameters. Nothing is
        modified when any rank saw a non-finite gradient (or when the scaler raises)."""
        local_sq = self.residency.local_sq_norm(1.0 / self._grad_divisor())
        sums = torch.stack([local_sq.double(), local_loss])
        self.comm.all_reduce_(sums)  # one collective for the norm and the loss
        grad_norm, loss, found_inf = _host_values(sums, self.comm.world)
        loss_scale = self.scaler.scale if self.scaler.enabled else None  # before the update below
        if self.reserve is not None and not found_inf:  # fail here, before anything is modified
            self.tracker.require_headroom(self.reserve.need(first_step=not self.optimizer.state))
        try:
            self.scaler.update(found_inf)  # may raise at the scale floor: nothing was modified yet
        except LossScaleFloorError:
            self.residency.end_step()  # else the non-finite gradient poisons every later step
            raise
        if not found_inf:
            clip = self.config.train.grad_clip
            self.residency.update(min(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else None)
            self.steps_done += 1
        self.residency.end_step()
        return StepResult(loss=loss, skipped=found_inf, grad_norm=grad_norm, loss_scale=loss_scale)

    def _grad_divisor(self) -> float:  # reduced gradients: sums over ranks of scaled gradients
        return self.comm.world * self.scaler.scale

    def _step_metrics(self, times: dict[str, float]) -> dict[str, Any]:
        stats = self.comm.stats
        counted = self.tracker.counting or not self.tracker.enabled  # disabled: zeros, as always
        m: dict[str, Any] = {**{f"time_{k}_s": v for k, v in times.items()}, "time_comm_s": stats.time_s,
                             "comm_bytes": stats.bytes, "comm_calls": stats.calls,
                             "peak_bytes": self.tracker.peak_total() if counted else None,
                             "peaks": self.tracker.peaks() if counted else {},
                             "live": self.tracker.live(), **self.scaler.metrics(), **self.recompute.metrics()}
        zero3 = {"zero3_gathers": self.stage3.gathers} if self.stage == 3 else {}
        return {**m, **zero3, **self.residency.step_metrics()}

    def _to_device(self, batch: Any) -> Any:
        return tree_map(lambda t: t.to(self.device, non_blocking=True) if isinstance(t, torch.Tensor) else t, batch)

    @torch.no_grad()
    def eval_loss(self, batch: Any, loss_fn: LossFn) -> float:
        """Mean loss over ranks of ``batch`` in eval mode: no grad, no state change,
        no scaler update, and the RNG streams are left exactly as they were."""
        was_training = self.model.training
        self.model.eval()
        try:
            devices = [self.device] if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices), self.tracker.phase(Phase.EVAL, "activations"):
                with (self._phase(Phase.EVAL), self.precision.kernels(self.device.type),
                      self.precision.autocast(self.device.type)):
                    loss = self.context.loss(loss_fn, self.model, self._to_device(batch)).detach().double().reshape(1)
                if self.stage3 is not None:
                    self.stage3.end_step()
        finally:
            self.model.train(was_training)
        self.comm.all_reduce_(loss)
        return float(loss) / self.comm.world

    # ---- the state API: a facade over ``mct.persistence.engine_state`` (contracts there) ----
    STATE_FORMAT = engine_state.STATE_FORMAT

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (header + world-size-independent pieces). Not collective."""
        return engine_state.state_dict(self)

    def streamed_state_dict(self) -> tuple[dict[str, Any], dict[str, Callable[[], torch.Tensor]]]:
        """(``state_dict()`` with placeholders, their readers): one piece at a time."""
        return engine_state.streamed_state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()``, all validated first (ValueError: untouched)."""
        engine_state.load_state_dict(self, state)

    def load_state_streamed(self, header: dict[str, Any], read_units: Callable[[list[int]], tuple[dict, dict]]) -> None:
        """``load_state_dict`` read a unit at a time by ``read_units(indices)``. Collective."""
        engine_state.load_state_streamed(self, header, read_units)

    def set_counters(self, scaler: dict[str, Any], steps_done: int) -> None:
        """Set the loss scaler and ``steps_done`` (a restore's counters); drops gradients."""
        self.scaler.load_state_dict(scaler)
        self.steps_done = steps_done
        self.sharded.zero_grad()

    def snapshot(self, tag: str = "snapshot") -> EngineSnapshot:
        """A rollback target that restores itself, kept where the residency keeps it."""
        return self.residency.snapshot(tag, self)

    def snapshot_state(self, tag: str = "snapshot") -> dict[str, Any]:
        """``snapshot(tag)`` as a plain dict, what ``load_snapshot_state`` takes."""
        return self.snapshot(tag).handle

    def load_snapshot_state(self, sd: dict[str, Any]) -> None:
        """Restore what ``snapshot_state`` returned (stages 1/2: collective)."""
        self.residency.snapshot_from(sd, self).restore()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 copy of every parameter, by ``model.named_parameters()`` name. Collective."""
        return engine_state.full_state_dict(self)

    def full_state_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``full_state_dict`` a flat unit at a time (views: copy to keep). Collective."""
        return engine_state.full_state_items(self)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Set every trainable parameter (master and working copies) from fp32 tensors."""
        with self.residency.masters_resident(write_back=True):
            self.sharded.load_full_state(state)

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every parameter ``full_state_items`` yields, without reading state."""
        return engine_state.parameter_shapes(self)

    def layout(self) -> dict[str, Any]:
        """This rank's ``units``, ``extents``, ``local_numel``, no state read (``state_io.layout``)."""
        return engine_state.state_layout(self)

    def model_state_bytes(self) -> dict[str, int]:
        """Per-rank bytes of model state held during a step, by category."""
        return engine_state.held_state_bytes(self)

    def save(self, path: str) -> None:
        """Write a sharded checkpoint to the directory ``path`` (``mct.persistence``). Collective."""
        save_engine(self, path)

    def load(self, path: str) -> None:
        """Load a ``save`` checkpoint (any world size, stage); ValueError: untouched."""
        load_engine(self, path)

    def close(self) -> None:
        """Release offload files, the I/O threads and the peers' shared shards (also on
        garbage collection); final."""
        self.recompute.close()
        self.residency.close()
        if getattr(self, "shared", None) is not None:
            self.shared.close()
            self.shared = None  # any later gather sends messages


def _host_values(sums: torch.Tensor, world: int) -> tuple[float, float, bool]:
    """(global grad norm, mean loss, found_inf) from the all-reduced [sq_norm, loss_sum].
    Fake tensors (the planner's runs) hold no values: they take a clean step's path."""
    if is_fake(sums):
        return 0.0, 0.0, False
    return float(sums[0].sqrt()), float(sums[1]) / world, not torch.isfinite(sums[0]).item()
