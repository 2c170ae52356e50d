"""ShardedModel: the model's trainable parameters as flat units, for every ZeRO stage.

Stage 0: replicated (layout world 1); gradients all-reduced after the last micro-batch.
Stage 1: master + optimizer state sharded; full gradients reduce-scattered after the
         last micro-batch; updated slices all-gathered into the working parameters.
Stage 2: as 1, but each unit's gradient is reduce-scattered as soon as backward has
         produced all of it (post-accumulate-grad hooks), then the full gradient is freed.
Stage 3: as 2, and working parameters are freed between uses (see stage3.py).
Buffers are left as they are: replicated, never sharded. Frozen parameters are not here:
stages 1-3 shard them as frozen units (``mct.zero.frozen``), stage 0 leaves them whole.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from mct.precision.policy import PrecisionPolicy
from mct.zero import comm as collectives
from mct.zero.comm import IN_FLIGHT_BUCKETS, Comm
from mct.zero.flat import FlatParamUnit, Values, fp64_sq_norm, scale_
from mct.zero.partition import bucket_slices, build_layout


def assign_units(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> dict[int, str]:
    """param id -> unit name: the block owning it, or 'root' for parameters outside
    every block or shared by several units (a tied weight must stay gathered for
    every use, so it lives in the unit that is gathered for the whole step)."""
    owner: dict[int, set[str]] = {}
    for bname, block in blocks:
        for p in block.parameters():
            owner.setdefault(id(p), set()).add(bname)
    for name, mod in model.named_modules():
        for p in mod.parameters(recurse=False):
            in_block = any(name == b or name.startswith(b + ".") for b, _ in blocks)
            if not in_block:
                owner.setdefault(id(p), set()).add("root")
    return {pid: (next(iter(s)) if len(s) == 1 else "root") for pid, s in owner.items()}


@dataclass(frozen=True)
class ShardingPolicy:
    """How a ``ShardedModel`` shards: ZeRO ``stage`` 0-3 and, at stage 3, units of at
    most ``persistent_numel`` elements kept gathered (``zero.persistent_numel``);
    ``shard_align``: shard boundaries on multiples of it (``FlatLayout.shard_align``:
    block-quantized optimizer state; 1 for fp32 state, today's layouts)."""

    stage: int
    persistent_numel: int = 0
    shard_align: int = 1


@dataclass(frozen=True)
class UnitHooks:
    """What runs around packing each unit: ``before(params)`` (e.g. materialize its
    parameters from the meta device), ``after(unit)`` right after (e.g. free or
    offload it). ``values``: the parameters' values a chunk at a time, read into the unit
    as it is packed (``mct.zero.flat.pack_chunks``; a model built on meta), instead of
    ``before``."""

    before: Callable[[list[nn.Parameter]], None] | None = None
    after: Callable[[FlatParamUnit], None] | None = None
    values: Values | None = None


class ShardedModel:
    def __init__(self, model: nn.Module, groups: list[list[nn.Parameter]], blocks: list[tuple[str, nn.Module]],
                 *, sharding: ShardingPolicy, precision: PrecisionPolicy, comm: Comm, device: torch.device,
                 tracker: Any, hooks: UnitHooks | None = None,
                 partial_grads: Callable[[], bool] | None = None) -> None:
        """``sharding``: the stage and what stays gathered; ``precision``: the units'
        dtypes; ``hooks``: what runs around packing each unit (``UnitHooks``), so
        construction can hold one unit at a time. ``partial_grads()``: True while the
        gradients arriving are partial sums of their parameters' gradients (a tiled MLP's
        earlier tiles): they are added, and a unit is reduced only once every
        parameter's last part has arrived."""
        self.partial_grads = partial_grads or (lambda: False)
        stage, persistent_numel, shard_align = sharding.stage, sharding.persistent_numel, sharding.shard_align
        hooks = hooks or UnitHooks()
        self.stage, self.comm, self.tracker = stage, comm, tracker
        names = {id(p): n for n, p in model.named_parameters()}
        unit_of = assign_units(model, blocks)
        shard_world = 1 if stage == 0 else comm.world
        shard_rank = 0 if stage == 0 else comm.rank
        order = ["root"] + [b for b, _ in blocks]
        self.units: list[FlatParamUnit] = []
        self.group_of_unit: list[int] = []
        for uname in order:
            for gi, params in enumerate(groups):
                mine = [(names[id(p)], p) for p in params if unit_of.get(id(p), "root") == uname]
                if not mine:
                    continue
                if hooks.before is not None and hooks.values is None:
                    hooks.before([p for _, p in mine])
                layout = build_layout([n for n, _ in mine], [p.shape for _, p in mine], shard_world,
                                      shard_align=shard_align)
                persistent = stage < 3 or layout.padded_numel <= persistent_numel
                unit = FlatParamUnit(f"{uname}/group{gi}", mine, layout, shard_rank=shard_rank,
                                     precision=precision, persistent=persistent, full_grads=stage < 2, device=device,
                                     on_new_grad_shard=self._track_grad_shard, values=hooks.values)
                unit.advise = comm.advise
                if uname == "root":
                    # embedding + head (+ final norm): 1 B elements at a 128k vocabulary, 5x
                    # an 8B model's layer. The head's gradient arrives at the start of
                    # backward, the embedding's at the end: they are kept as they come (no
                    # full-size fp32 flat gradient through the whole backward) and read into
                    # buckets at the end, where nothing is left to overlap, so at most
                    # IN_FLIGHT_BUCKETS buckets' copies are alive, not all of them
                    unit.bucket_window = IN_FLIGHT_BUCKETS
                    unit.hold_grads = True
                elif stage >= 2 and layout.world > 1 and comm.pairs and unit.param_dtype == unit.reduce_dtype:
                    # two gloo ranks: its gradients are sent as they are (Comm._exchange), no
                    # flat gradient is written
                    unit.hold_grads = True
                elif stage >= 2 and layout.world > 1:
                    # its gradient accumulates bucket by bucket: the reduce-scatter copies nothing
                    unit.reduce_in_place = True
                    if not (comm.simulated and collectives.BUCKETS_AS_ONE):
                        unit.grad_buckets = bucket_slices(layout.shard_numel, layout.world,
                                                          precision.reduce_dtype.itemsize, comm.bucket_bytes)
                self.units.append(unit)
                self.group_of_unit.append(gi)
                if hooks.after is not None:
                    hooks.after(unit)
        self.units_by_block: dict[str, list[FlatParamUnit]] = {}
        for u in self.units:
            self.units_by_block.setdefault(u.name.split("/")[0], []).append(u)
        self._register_memory()
        for u in self.units:
            for i, p in enumerate(u.params):
                p.register_post_accumulate_grad_hook(self._grad_hook(u, i))

    def _register_memory(self) -> None:
        for u in self.units:
            self.tracker.register(u.working, "params")
            if not u.master_is_view:
                # fp32 at stage 3: the master shard is the only persistent copy of the weights
                cat = "params" if u.param_dtype == torch.float32 else "master"
                self.tracker.register(u.master, cat)
            if u.grad_shard is not None:
                self.tracker.register(u.grad_shard, "grads")
            if u.grad_full is not None:
                self.tracker.register(u.grad_full, "grads")

    def _track_grad_shard(self, shard: torch.Tensor) -> None:
        # created inside the backward (or optimizer) stage, whose default category is "other"
        self.tracker.register(shard, "grads")

    def _grad_hook(self, unit: FlatParamUnit, index: int):
        # Weak references: the hook lives on the parameter, which the unit holds; a strong one
        # would close a cycle through the autograd's C++ side that the garbage collector cannot
        # see, and no engine (its buffers, on a GPU its device memory) would ever be freed.
        owner, unit_ref = weakref.ref(self), weakref.ref(unit)

        def hook(p: torch.Tensor) -> None:
            this, u = owner(), unit_ref()
            if this is not None and u is not None:
                this._accumulate(u, index, p)
        return hook

    def _accumulate(self, unit: FlatParamUnit, index: int, p: torch.Tensor) -> None:
        if unit.hold_grads and not unit.full_grads:
            self.tracker.register(p.grad, "grads")  # kept until the unit is reduced
        created = unit.grad_full is None
        last = not self.partial_grads()  # a tiled MLP's earlier tiles: more of p's gradient follows
        unit.accumulate_grad(index, p.grad, last=last)
        p.grad = None
        if created and unit.grad_full is not None and not unit.full_grads:
            self.tracker.register(unit.grad_full, "grads")
        if last and self.stage >= 2 and unit.grads_seen == unit.n_trainable:
            self._unit_backward_done(unit)

    def _unit_backward_done(self, unit: FlatParamUnit) -> None:
        # A pending reduce-scatter keeps its unit's full gradient [P] alive until it is
        # waited on: wait for the earlier ones first, so at most one unit's full
        # gradient is in flight instead of every unit's until the end of backward.
        for u in self.units:
            if u is not unit:
                u.wait_reduce()
        unit.reduce(self.comm, async_op=True)
        if self.stage == 3:
            unit.release()
            self.tracker.refresh(unit.working)

    # ---- step boundaries ----
    def begin_backward(self) -> None:
        for u in self.units:
            u.new_backward()

    def end_backward(self, last_micro: bool) -> None:
        """Finish this backward's reductions. Stages 0/1 reduce only after the last
        micro-batch; units whose gradients did not all arrive (unused parameters)
        are reduced here too, their missing gradients counting as zero."""
        if self.stage >= 2:
            for u in self.units:
                if not u.reduced_this_backward:
                    self._unit_backward_done(u)
        elif last_micro:
            for u in self.units:
                u.reduce(self.comm, async_op=True)
        for u in self.units:
            u.wait_reduce()

    def grad_shards(self) -> list[torch.Tensor]:
        """Every unit's fp32 gradient shard for the optimizer step, after the last
        ``end_backward``; at stages 2/3 a unit that got no gradient this step gets
        zeros (allocated here, dropped by ``zero_grad``)."""
        return [u.grad_shard_or_zeros() for u in self.units]

    def masters(self) -> list[torch.Tensor]:
        return [u.master for u in self.units]

    def local_sq_norm(self, inv_divisor: float | None = None) -> torch.Tensor:
        """Sum of squares of this rank's gradient slices, accumulated in fp64 so that
        the global norm (and so the clipping factor) does not depend on how the
        gradient is cut into shards. At stage 0 every rank holds the whole
        (identical) gradient, so only rank 0 contributes. ``inv_divisor``: first
        average the shards in place (x it; reduced sums -> the mean gradient)."""
        shards = self.grad_shards()
        scale_(shards, inv_divisor)
        if not shards or (self.stage == 0 and self.comm.rank != 0):
            return torch.zeros((), dtype=torch.float64, device=self._device())
        return fp64_sq_norm(shards)

    def _device(self) -> torch.device:
        return self.units[0].master.device if self.units else torch.device("cpu")

    def zero_grad(self) -> None:
        for u in self.units:
            u.zero_grad()

    def publish(self) -> None:
        for u in self.units:
            u.publish_master(self.comm)

    # ---- full (unsharded) fp32 state ----
    def full_state(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter in fp32, all-gathered from the master slices.
        Collective: every rank must call it."""
        out: dict[str, torch.Tensor] = {}
        for u in self.units:
            full = self.gather_unit(u, u.master)
            for name, shape, off in zip(u.names, u.layout.shapes, u.layout.offsets):
                out[name] = full[off:off + math.prod(shape)].view(shape).clone()
        return out

    def gather_unit(self, u: FlatParamUnit, master: torch.Tensor) -> torch.Tensor:
        """Unit ``u``'s whole padded fp32 flat tensor from this rank's ``master`` shard
        (a new tensor). Collective when the unit is sharded: every rank calls it."""
        full = torch.empty(u.layout.padded_numel, dtype=torch.float32, device=master.device)
        self.comm.all_gather(master.contiguous(), full) if u.layout.world > 1 else full.copy_(master)
        return full

    def load_full_state(self, state: dict[str, torch.Tensor]) -> None:
        """Set the master slices (and working parameters) from full fp32 tensors."""
        with torch.no_grad():
            for u in self.units:
                lo, hi = u.layout.shard_range(self.comm.rank if u.layout.world > 1 else 0)
                full = torch.zeros(u.layout.padded_numel, dtype=torch.float32, device=u.master.device)
                for name, shape, off in zip(u.names, u.layout.shapes, u.layout.offsets):
                    if name not in state:
                        raise ValueError(f"state dict has no entry for parameter {name!r}")
                    if tuple(state[name].shape) != tuple(shape):
                        raise ValueError(f"parameter {name!r}: checkpoint shape {tuple(state[name].shape)} "
                                         f"!= model shape {tuple(shape)}")
                    full[off:off + math.prod(shape)].copy_(state[name].reshape(-1))
                u.master.copy_(full[lo:hi])
        self.publish()

    def bytes_by_category(self) -> dict[str, int]:
        """Model-state bytes this rank holds during a step, by category (transients not
        counted). At stages 2/3 the fp32 gradient shards exist only from a unit's
        first reduce in a step until ``zero_grad`` after the optimizer step, so
        between steps the tracker shows less; they count here, as in the ZeRO
        formula, because they are all held at the optimizer step."""
        out = {"params": 0, "master": 0, "grads": 0}
        for u in self.units:
            if u.persistent:
                out["params"] += u.working.numel() * u.working.element_size()
            if not u.master_is_view:
                key = "params" if u.param_dtype == torch.float32 else "master"
                out[key] += u.master.numel() * 4
            if u.published is not None:  # a shared cast of the master shard (mct.zero.shm)
                out["params"] += u.published.numel() * u.published.element_size()
            if not u.grad_shard_in_full:
                out["grads"] += u.layout.shard_numel * 4
            if u.full_grads:
                out["grads"] += u.grad_full.numel() * u.grad_full.element_size()
        return out
