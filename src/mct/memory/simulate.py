"""One micro-batch's forward + backward on fake tensors, with the engine's allocation
schedule for gradient buffers and stage-3 gathers, measured by the memory tracker.

The model's parameters are fake (they and the persistent state are not counted);
what the tracker sees is exactly the step's transient memory: activations saved for
backward (fewer under checkpointing), recomputation, logits and the fp32 loss copy,
activation gradients, parameter gradients before the engine's hooks consume them,
the full gradient buffers of stages 2/3 while they are reduced, the fp32 gradient
shards of stages 2/3 (created by each unit's reduce, held to the end of the step),
and the stage-3 block parameters gathered in forward (current + prefetched) and
backward.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten

from mct.checkpointing import apply_checkpointing, find_blocks
from mct.checkpointing.apply import CheckpointState
from mct.checkpointing.region import Region
from mct.config import CheckpointingConfig
from mct.memory.tracker import MemoryTracker

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _fake_model(source, mode: FakeTensorMode, dtype: torch.dtype) -> nn.Module:
    """The model with every parameter and buffer replaced by a fake CPU tensor (tied
    parameters stay one object). Trainable parameters take the working dtype."""
    with torch.device("meta"):
        model = source.build()
    memo: dict[int, torch.Tensor] = {}
    with mode:
        for mod in model.modules():
            for name, p in list(mod._parameters.items()):
                if p is not None:
                    if id(p) not in memo:
                        memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=dtype if p.is_floating_point() else
                                                               p.dtype), requires_grad=p.requires_grad)
                    mod._parameters[name] = memo[id(p)]
            for name, b in list(mod._buffers.items()):
                if b is not None:
                    mod._buffers[name] = torch.zeros(b.shape, dtype=b.dtype)
    return model


class _Schedule:
    """Allocates and frees fake buffers when the engine would (zero/sharded.py, stage3.py)."""

    def __init__(self, tracker: MemoryTracker, units_by_owner: dict, params_by_owner: dict, *, stage: int,
                 world: int, pdtype: torch.dtype, rdtype: torch.dtype, order: list[str]) -> None:
        self.tracker, self.stage, self.world = tracker, stage, world
        self.pdtype, self.rdtype, self.order = pdtype, rdtype, order
        self.units = units_by_owner          # owner -> [Unit]
        self.params = params_by_owner        # owner -> [[param, ...] per unit]
        self.gathered: dict[tuple[str, int], torch.Tensor] = {}
        self.full: dict[tuple[str, int], torch.Tensor] = {}
        self.seen: dict[tuple[str, int], int] = {}
        self.pending: dict[tuple[str, int], tuple] = {}
        self.seen_done: set[tuple[str, int]] = set()
        self.shards: dict[tuple[str, int], torch.Tensor] = {}  # stages 2/3: created by the first reduce
        self.phase = "forward"

    def _alloc(self, numel: int, dtype: torch.dtype, category: str) -> torch.Tensor:
        with self.tracker.category(category):
            return torch.empty(numel, dtype=dtype)

    # stage 3: block parameters
    def gather(self, owner: str | None) -> None:
        if owner is None or self.stage != 3:
            return
        for i, u in enumerate(self.units.get(owner, [])):
            if (owner, i) not in self.gathered:
                self.gathered[(owner, i)] = self._alloc(u.padded, self.pdtype, "params")

    def release(self, owner: str, i: int | None = None) -> None:
        for j in range(len(self.units.get(owner, []))):
            if i is None or i == j:
                self.gathered.pop((owner, j), None)

    def neighbour(self, owner: str, delta: int) -> str | None:
        if owner == "root":
            return (self.order[-1 if delta < 0 else 0]) if self.order else None
        k = self.order.index(owner) + delta
        return self.order[k] if 0 <= k < len(self.order) else None

    # gradients
    def on_grad(self, owner: str, i: int, p: torch.Tensor) -> None:
        key, u = (owner, i), self.units[owner][i]
        if self.stage >= 2 and key not in self.full:
            self.full[key] = self._alloc(u.padded, self.rdtype, "grads")
        p.grad = None
        self.seen[key] = self.seen.get(key, 0) + 1
        if self.stage >= 2 and self.seen[key] == u.n_params:
            self.unit_done(key)

    def unit_done(self, key: tuple[str, int]) -> None:
        for k in list(self.pending):
            self._settle(k, *self.pending.pop(k))  # the engine waits for earlier reductions first
        u = self.units[key[0]][key[1]]
        full = self.full.pop(key, None)
        self.seen_done.add(key)
        if full is not None:  # a unit with no gradient reduces nothing
            out = self._alloc(u.shard, self.rdtype, "grads")
            if self.world > 1:
                self.pending[key] = (full, out)  # the collective holds both until waited on
            else:
                self._settle(key, full, out)
            del out, full
        if self.stage == 3:
            self.release(key[0], key[1])

    def _settle(self, key: tuple[str, int], full: torch.Tensor, out: torch.Tensor) -> None:
        """A reduction done: its output becomes the unit's fp32 gradient shard (a copy
        when reduced in low precision), held to the end of the step."""
        if key not in self.shards:
            self.shards[key] = out if self.rdtype == torch.float32 else self._alloc(out.numel(), torch.float32,
                                                                                    "grads")

    def end_backward(self) -> None:
        if self.stage >= 2:
            for owner, units in self.units.items():
                for i in range(len(units)):
                    if (owner, i) not in self.seen_done:
                        self.unit_done((owner, i))
        elif self.stage == 1 and self.world > 1:
            outs = [self._alloc(u.shard, self.rdtype, "grads") for us in self.units.values() for u in us]
            del outs
        for k in list(self.pending):
            self._settle(k, *self.pending.pop(k))


def _install(schedule: _Schedule, model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> None:
    for owner, per_unit in schedule.params.items():
        for i, params in enumerate(per_unit):
            for p in params:
                p.register_post_accumulate_grad_hook(lambda p, o=owner, i=i: schedule.on_grad(o, i, p))
    if schedule.stage != 3:
        return
    # the model itself carries the root unit's hooks, as in zero/stage3.py
    for name, block in [*blocks, ("root", model)]:
        def pre(module, args, name=name):
            schedule.gather(name)
            if schedule.phase == "forward":
                schedule.gather(schedule.neighbour(name, +1))

        def post(module, args, output, name=name):
            if schedule.phase != "forward":
                return
            schedule.release(name)
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda g, name=name: (schedule.gather(name),
                                                          schedule.gather(schedule.neighbour(name, -1)), None)[-1])
        block.register_forward_pre_hook(pre)
        block.register_forward_hook(post)


def _params_by_owner(model: nn.Module, blocks, units) -> dict[str, list[list[torch.Tensor]]]:
    from mct.models.gpt import optimizer_groups
    from mct.zero.sharded import assign_units
    groups = [g["params"] for g in optimizer_groups(model, 0.1)]
    unit_of = assign_units(model, blocks)
    out: dict[str, list[list[torch.Tensor]]] = {}
    for owner in ["root"] + [b for b, _ in blocks]:
        for params in groups:
            mine = [p for p in params if unit_of.get(id(p), "root") == owner]
            if mine:
                out.setdefault(owner, []).append(mine)
    return out


def _truncate(model: nn.Module, blocks: list[str], keep: int | None) -> None:
    """Keep the first ``keep`` blocks of the ModuleList that holds them (None: all)."""
    if keep is None or keep >= len(blocks):
        return
    parent = blocks[0].rpartition(".")[0]
    holder = model.get_submodule(parent) if parent else model
    assert isinstance(holder, nn.ModuleList), "truncation needs blocks in one nn.ModuleList"
    del holder[keep:]


def fake_step(source, units, *, policy: str, precision: str, stage: int, world: int, batch: int, seq: int,
              reduce_dtype: str = "fp32", keep: int | None = None, region: bool = False
              ) -> dict[str, dict[str, int]]:
    """See ``planner.profile_transients``. ``keep``: run only the first ``keep`` blocks;
    ``region``: checkpoint them as one region (ignores ``policy``)."""
    from mct.models.gpt import gpt_loss
    pdtype = _DTYPES[precision]
    rdtype = torch.float32 if reduce_dtype == "fp32" else pdtype
    mode = FakeTensorMode()
    model = _fake_model(source, mode, pdtype)
    _truncate(model, [b for b, _ in find_blocks(model, list(source.blocks))], keep)
    present = {"root", *(b for b, _ in find_blocks(model, list(source.blocks)))}
    units = [u for u in units if u.owner in present]
    tracker = MemoryTracker("cpu", count_fake=True)
    blocks = find_blocks(model, list(source.blocks))
    if not region:
        apply_checkpointing(model, CheckpointingConfig(policy=policy, blocks=list(source.blocks)),
                            recompute_context=lambda: tracker.category("activations"))
    else:  # one checkpoint region over every (kept) block: a sqrt region of that size
        state = CheckpointState("sqrt", False, lambda: tracker.category("activations"))
        state.regions.append(Region(list(blocks), state, None))
        state.regions[0].install()
    by_owner: dict[str, list] = {}
    for u in units:
        by_owner.setdefault(u.owner, []).append(u)
    sched = _Schedule(tracker, by_owner, _params_by_owner(model, blocks, units), stage=stage, world=world,
                      pdtype=pdtype, rdtype=rdtype, order=[b for b, _ in blocks])
    _install(sched, model, blocks)
    autocast = torch.autocast("cpu", dtype=pdtype) if precision != "fp32" else torch.autocast("cpu", enabled=False)
    with mode:
        x = torch.zeros(batch, seq, dtype=torch.long)
        y = torch.zeros(batch, seq, dtype=torch.long)
        with tracker.stage("forward", "activations"), autocast:
            loss = gpt_loss(model, (x, y))
        sched.phase = "backward"
        with tracker.stage("backward", "other"):
            loss.float().backward()
            del loss
            sched.end_backward()
    return tracker.peaks()
