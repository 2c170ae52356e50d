"""OffloadedState: the engine's fp32 master shards, optimizer state, gradient shards
(stages 2/3) and stage-3 parameter shards kept in a store between uses, and the
optimizer step streamed over them chunk by chunk.

What stays resident per flat unit (S = shard numel):
  persistent working buffer (stages 0-2, and small stage-3 units): as without offload;
    its own slice doubles as the parameter shard, so publishing needs no master.
  stage-3 parameter shard [S] in the param dtype (offload.params = 'none'): the gather
    source instead of ``master.to(param_dtype)`` (the same bits, cast once per step).
  fp32 master [S] only where it *is* the working parameter (fp32, stages 0-2).
Everything else lives in the store: master, every optimizer state tensor of the
master's shape, gradient shards (stages 2/3, written as backward reduces them), and
per-block state (the optimizer's ``block_state``: the fp32 scales of int8 moments, one
entry per block of the master), kept as it is: a low-precision optimizer's state is
stored and streamed compressed (bf16 moments; int8 / uint8 codes and their scales).

The step is the user's own optimizer, unchanged: for each chunk [a, b) of a unit, a
chunk-sized proxy parameter (the pool buffer holding the master chunk) with its
gradient chunk and state chunks is put in place of the unit's group's parameters, and
``optimizer.step()`` runs. Elementwise optimizers give every element the same update
whatever tensor it sits in, so this is bit-identical to stepping the whole shard
(tested for AdamW single-tensor, foreach and fused). Per-tensor scalars (Adam's
``step``) are restored before each chunk and must come out equal from all of them;
an optimizer whose scalars differ between chunks is not elementwise and is refused.
An optimizer that lays its state on the unit's global flat index (``placed_as``:
``mct.optim.lowbit``) is told where each chunk sits; chunks then hold whole blocks
(``chunk_align``), so the chunked step is the resident step bit for bit there too.

Global clipping and the overflow check need the global norm before any update. At
stages 2/3 each gradient shard is written out when its unit's reduce completes, and
its squared norm (of the averaged gradient, in fp64, as ``ShardedModel.local_sq_norm``
computes it) is taken then, overwritten by later micro-batches, so after backward
the local norm is known without reading anything back; the step then reads each
gradient chunk once, averages, clips and steps it.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch._subclasses.fake_tensor import is_fake

from mct.config import OffloadConfig
from mct.offload import persist
from mct.offload.torch_format import load_optimizer_state_dict, optimizer_state_dict
from mct.offload.store import Store, UnitState, make_store, put_record
from mct.offload.stream import ChunkStream, Item
from mct.zero.comm import Comm
from mct.zero.flat import FlatParamUnit, fp64_sq_norm, scale_
from mct.zero.state_io import block_spans

if TYPE_CHECKING:
    from mct.memory.tracker import MemoryTracker

ALIGN = 64
"""Chunk sizes are multiples of 64 elements, so chunk boundaries fall on vector-width
boundaries of every CPU kernel (bit-identity does not rely on it, but costs nothing)."""


class OffloadedState:
    """Moves each unit's state (``add_unit``) into the configured stores and owns it.
    ``inv_divisor()`` is the factor that turns reduced gradient sums into the mean
    (1 / (world * loss scale)). ``chunk_align``: chunks start at multiples of it in a
    shard (the optimizer's ``shard_align``: whole quantization blocks). Raises
    ValueError for a bad offload.dir."""

    def __init__(self, cfg: OffloadConfig, *, stage: int, comm: Comm, device: torch.device,
                 tracker: MemoryTracker,
                 inv_divisor: Callable[[], float], chunk_align: int = 1) -> None:
        self.units: list[FlatParamUnit] = []
        self.cfg, self.stage, self.comm = cfg, stage, comm
        self.device, self.tracker, self.inv_divisor = device, tracker, inv_divisor
        self.store: Store | None = None  # opened with the first unit (fake tensors: a NullStore)
        self.param_store: Store | None = None
        self.align = math.lcm(ALIGN, chunk_align)
        self._chunk_cap = max(self.align, int(cfg.chunk_mb * 2**20 / 4) // self.align * self.align)
        self.stream = ChunkStream(device, slots=cfg.buffers, chunk_numel=self.align,
                                  on_alloc=lambda t: tracker.register(t, "offload"))
        self.offload_grads = stage >= 2
        self.states: list[UnitState | None] = []
        self.grad_stored: list[bool] = []
        self.norm_sq: list[torch.Tensor | None] = []
        self.param_shards: list[torch.Tensor | None] = []
        self._given: dict[str, torch.Tensor] = {}  # state buffers handed to the optimizer for a chunk
        self._post_scalars: dict[int, dict[str, Any]] = {}  # per unit: scalars after its first chunk
        self.spans: dict[str, int] = {}
        """Per-block optimizer state: name -> master elements per entry (``bind``)."""

    @property
    def chunk_numel(self) -> int:
        """Elements per streamed chunk: offload.chunk_mb, or the largest shard when that is
        smaller (the pool buffers are this long; they are allocated at the first step)."""
        return self.stream.chunk_numel

    # ---- construction ----
    def add_unit(self, u: FlatParamUnit) -> None:
        """Take over a freshly built unit: its master (and stage-3 parameter shard)
        go to the store now, so construction holds one unit's state at a time."""
        i, S = len(self.units), u.layout.shard_numel
        if self.store is None:
            self._open_stores(fake=is_fake(u.master))
        self.stream.chunk_numel = max(self.chunk_numel, min(self._chunk_cap, -(-S // self.align) * self.align))
        self.units.append(u)
        self.states.append(None)
        self.grad_stored.append(False)
        self.norm_sq.append(None)
        self.param_shards.append(None)
        if not u.persistent:
            if self.param_store is None:
                shard = u.master.to(u.param_dtype, copy=True)
                self.param_shards[i] = shard
                self.tracker.register(shard, "params")
            else:
                self.param_store.allocate(f"u{i}.param", S, u.param_dtype)
                put_record(self.param_store, f"u{i}.param", u.master.to(u.param_dtype))
            u.gather_source = self._gather_source(i, u)
        if not u.master_is_view:
            self.store.allocate(f"u{i}.master", S, torch.float32)
            put_record(self.store, f"u{i}.master", u.master)
            u.master.untyped_storage().resize_(0)
            self.tracker.refresh(u.master)
        if self.offload_grads:
            self.store.allocate(f"u{i}.grad", S, torch.float32)
            u.on_new_grad_shard = self._grad_sink(i, u, u.on_new_grad_shard)
        self.report_offloaded()

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer that steps this state: its per-block state (``block_state``) is
        stored as records of one entry per block."""
        assert self.align % getattr(optimizer, "shard_align", 1) == 0, (self.align, optimizer.shard_align)
        self.spans = block_spans(optimizer)

    def state_numel(self, name: str, n: int) -> int:
        """Entries of optimizer state ``name`` that cover ``n`` master elements."""
        return -(-n // self.spans.get(name, 1))

    def _state_item(self, i: int, name: str, a: int, b: int) -> Item:
        """Chunk [a, b) of unit ``i``'s optimizer state ``name`` (a per-block state: its blocks)."""
        per = self.spans.get(name, 1)
        return Item(f"state.{name}", self.store, f"u{i}.{name}", a // per, -(-b // per), per)

    def _open_stores(self, fake: bool) -> None:
        cfg, rank = self.cfg, self.comm.rank
        self.store = make_store(cfg.optimizer, root=cfg.dir, device=self.device, name=f"rank{rank}", fake=fake)
        if cfg.params != "none":
            self.param_store = (self.store if cfg.params == cfg.optimizer else
                                make_store(cfg.params, root=cfg.dir, device=self.device, name=f"params-rank{rank}",
                                           fake=fake))

    def _gather_source(self, i: int, u: FlatParamUnit) -> Callable[[], torch.Tensor]:
        def source() -> torch.Tensor:
            if self.param_shards[i] is not None:
                return self.param_shards[i]
            out = self.comm.advise(torch.empty(u.layout.shard_numel, dtype=u.param_dtype, device=self.device))
            self.fetch(self.param_store, f"u{i}.param", out)
            return out
        return source

    def fetch(self, store: Store, key: str, out: torch.Tensor) -> None:
        """Read record ``key`` whole into ``out`` now, after every queued write."""
        self.stream.fetch(Item(key, store, key, 0, out.numel()), out)

    def report_offloaded(self) -> None:
        """Tell the tracker how many bytes each tier holds."""
        stores = {id(s): s for s in (self.store, self.param_store) if s is not None}
        for tier in ("cpu", "disk"):
            self.tracker.set_offloaded(tier, sum(s.nbytes for s in stores.values() if s.tier == tier))

    # ---- gradients (stages 2/3) ----
    def _grad_sink(self, i: int, u: FlatParamUnit, previous: Callable | None) -> Callable[[torch.Tensor], None]:
        key = f"u{i}.grad"

        def sink(shard: torch.Tensor) -> None:
            if previous is not None:
                previous(shard)
            if self.grad_stored[i]:  # a later micro-batch: add to the stored sum (a + b == b + a exactly)
                total = torch.empty_like(shard)
                self.fetch(self.store, key, total)
                total.add_(shard)
                shard = total
            scaled = torch._foreach_mul([shard], self.inv_divisor())[0]
            self.norm_sq[i] = fp64_sq_norm([scaled])
            del scaled
            self.stream.write(self.stream.slots, [(Item(key, self.store, key, 0, shard.numel()), shard)])
            self.stream.drain(limit=self.stream.slots)  # bound the gradients held until written
            self.grad_stored[i] = True
            u.grad_shard = None  # the store holds it now
        return sink

    def local_sq_norm(self) -> torch.Tensor:
        """Sum over units of the squared norms of this rank's averaged gradient shards,
        in the order and precision of ``ShardedModel.local_sq_norm`` (stages 2/3)."""
        self.stream.drain()
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        if not self.units:
            return zero
        return sum(n if n is not None else zero for n in self.norm_sq)

    def end_step(self) -> None:
        """Forget this step's gradients (after the step, a skipped step, or a failure)."""
        self.grad_stored = [False] * len(self.units)
        self.norm_sq = [None] * len(self.units)

    # ---- the step ----
    def step(self, optimizer: torch.optim.Optimizer, group_of_unit: list[int], clip_coef: float | None) -> None:
        """One optimizer step over every unit, chunk by chunk, then publish the
        updated parameters (stages 1/2: all-gather). Gradients: stages 0/1 the
        resident shards the engine has averaged; stages 2/3 the stored sums, averaged
        here. ``clip_coef``: multiply gradients by it first (None: no clipping)."""
        inv = self.inv_divisor()
        chunks = [(i, a, min(a + self.chunk_numel, u.layout.shard_numel))
                  for i, u in enumerate(self.units) for a in range(0, u.layout.shard_numel, self.chunk_numel)]

        def compute(chunk, slot):
            return self._step_chunk(chunk, slot, optimizer, group_of_unit[chunk[0]], inv, clip_coef)
        self._post_scalars = {}
        self.stream.run(chunks, self._reads, compute)
        self.publish()
        self.report_offloaded()

    def _reads(self, chunk: tuple[int, int, int]) -> list[Item]:
        i, a, b = chunk
        items = []
        if not self.units[i].master_is_view:
            items.append(Item("master", self.store, f"u{i}.master", a, b))
        if self.states[i] is not None:
            items += [self._state_item(i, k, a, b) for k in self.states[i].elementwise]
        if self.offload_grads and self.grad_stored[i]:
            items.append(Item("grad", self.store, f"u{i}.grad", a, b))
        return items

    def _step_chunk(self, chunk: tuple[int, int, int], slot: int, optimizer: torch.optim.Optimizer, gi: int,
                    inv: float, clip_coef: float | None) -> list[tuple[Item, torch.Tensor]]:
        i, a, b = chunk
        u, n, buf = self.units[i], b - a, self.stream.buffer
        master = u.master[a:b] if u.master_is_view else buf(slot, "master", torch.float32, n)
        if self.offload_grads:
            grad = buf(slot, "grad", torch.float32, n)
            if not self.grad_stored[i]:
                grad.zero_()  # no gradient reached this unit: zeros, as the reference sees
            scale_([grad], inv)
        else:
            grad = u.grad_shard_or_zeros()[a:b]
        scale_([grad], clip_coef)
        post = self._run_optimizer(optimizer, gi, master, grad, i, a, slot)
        writes = [] if u.master_is_view else [(Item("master", self.store, f"u{i}.master", a, b), master)]
        writes += self._commit_state(i, a, b, slot, post, master)
        writes += self._update_param_shard(i, u, a, b, slot, master)
        return writes

    def _run_optimizer(self, optimizer: torch.optim.Optimizer, gi: int, master: torch.Tensor,
                       grad: torch.Tensor, i: int, a: int, slot: int) -> dict[str, Any]:
        """``optimizer.step()`` on the chunk (elements [a, a + n) of unit ``i``'s shard)
        alone, placed where it sits (``placed_as``); returns the state it leaves."""
        state = self.states[i]
        if state is not None:
            self._given = {k: self.stream.buffer(slot, f"state.{k}", dt, self.state_numel(k, master.numel()),
                                                 self.spans.get(k, 1))
                           for k, dt in state.elementwise.items()}
            optimizer.state[master] = {
                **{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.scalars.items()},
                **self._given}
        group = optimizer.param_groups[gi]
        saved, group["params"] = group["params"], [master]
        master.grad = grad
        placed_as = getattr(optimizer, "placed_as", None)
        try:
            with placed_as(master, self.units[i].master, a) if placed_as else contextlib.nullcontext():
                optimizer.step()
        finally:
            group["params"] = saved
            master.grad = None
            post = optimizer.state.pop(master, {})
        return post

    def _commit_state(self, i: int, a: int, b: int, slot: int, post: dict[str, Any],
                      master: torch.Tensor) -> list[tuple[Item, torch.Tensor]]:
        state = self.states[i]
        if state is None:  # first step: the optimizer just created this chunk's state
            elementwise = {k: v.dtype for k, v in post.items() if isinstance(v, torch.Tensor) and v.dim() == 1
                           and v.numel() == self.state_numel(k, master.numel())}  # per element, or per block
            if a == 0:  # (records may exist already: a state restored from before the first step)
                for k, dt in elementwise.items():
                    self.ensure_record(f"u{i}.{k}", self.state_numel(k, self.units[i].layout.shard_numel), dt)
        else:
            elementwise = state.elementwise
        scalars = {k: v for k, v in post.items() if k not in elementwise}
        first = self._post_scalars.setdefault(i, scalars)
        if not _same_scalars(first, scalars):
            raise ValueError(f"the optimizer keeps per-tensor state that depends on the tensor's elements "
                             f"(state {sorted(scalars)} differs between chunks of one shard): it cannot be "
                             f"stepped in offloaded chunks; use offload.optimizer = 'none'")
        writes = []
        for k, dt in elementwise.items():
            item = self._state_item(i, k, a, b)
            dst = (self._given[k] if state is not None else
                   self.stream.buffer(slot, item.name, dt, item.hi - item.lo, item.per))
            if post[k] is not dst:  # first step: fresh tensors from the optimizer (or it replaced one)
                dst.copy_(post[k])
            writes.append((item, dst))
        if b == self.units[i].layout.shard_numel:
            self.states[i] = UnitState(elementwise, first)
        return writes

    def _update_param_shard(self, i: int, u: FlatParamUnit, a: int, b: int, slot: int,
                            master: torch.Tensor) -> list[tuple[Item, torch.Tensor]]:
        """The cast of the new master chunk goes where the working parameters read it."""
        with torch.no_grad():
            if u.persistent:
                if not u.master_is_view:
                    lo = u.layout.shard_range(self.comm.rank if u.layout.world > 1 else 0)[0]
                    u.working[lo + a:lo + b].copy_(master)
            elif self.param_shards[i] is not None:
                self.param_shards[i][a:b].copy_(master)
            else:
                p = self.stream.buffer(slot, "param", u.param_dtype, b - a)
                p.copy_(master)
                return [(Item("param", self.param_store, f"u{i}.param", a, b), p)]
        return []

    def publish(self) -> None:
        """Stages 1/2 (and persistent stage-3 units): every rank's updated slice of the
        working buffer to every rank, as ``FlatParamUnit.publish_master`` does."""
        for u in self.units:
            if u.persistent and u.layout.world > 1 and self.comm.world > 1:
                lo, hi = u.layout.shard_range(self.comm.rank)
                with torch.no_grad():
                    self.comm.all_gather(u.working[lo:hi].clone(), u.working)

    # ---- whole masters (export, verify, loading full weights) ----
    @contextlib.contextmanager
    def masters_resident(self, write_back: bool) -> Iterator[None]:
        """Read every offloaded master back into ``unit.master`` for the duration;
        with ``write_back`` store them (and refresh the parameter shards) afterwards."""
        self.stream.drain()
        for i, u in enumerate(self.units):
            if not u.master_is_view:
                u.master.untyped_storage().resize_(u.layout.shard_numel * 4)
                self.fetch(self.store, f"u{i}.master", u.master)
        try:
            yield
        finally:
            for i, u in enumerate(self.units):
                if u.master_is_view:
                    continue
                if write_back:
                    put_record(self.store, f"u{i}.master", u.master)
                    if self.param_shards[i] is not None:
                        self.param_shards[i].copy_(u.master)
                    elif self.param_store is not None and not u.persistent:
                        put_record(self.param_store, f"u{i}.param", u.master.to(u.param_dtype))
                u.master.untyped_storage().resize_(0)
                self.tracker.refresh(u.master)

    @contextlib.contextmanager
    def master_of(self, i: int) -> Iterator[torch.Tensor]:
        """Unit ``i``'s fp32 master shard for reading, for the duration: the resident one,
        or a copy read from the store (one unit's shard in memory, freed on exit)."""
        u = self.units[i]
        if u.master_is_view:
            yield u.master
            return
        out = self.comm.advise(torch.empty(u.layout.shard_numel, dtype=torch.float32, device=self.device))
        self.fetch(self.store, f"u{i}.master", out)
        try:
            yield out
        finally:
            del out

    # ---- checkpoints streamed piece by piece (see persist.py) ----
    def unit_pieces(self, i: int, n: int) -> list[tuple[str, torch.Tensor, Callable[[], torch.Tensor] | None]]:
        return persist.unit_pieces(self, i, n)

    def stage_unit(self, i: int, pieces: dict[str, torch.Tensor], n: int) -> None:
        persist.stage_unit(self, i, pieces, n)

    def drop_staged(self) -> None:
        persist.drop_staged(self)

    def commit_staged(self, elementwise: list[dict[str, torch.dtype]], scalars: list[dict[str, Any]],
                      on_device: list[bool]) -> None:
        persist.commit_staged(self, elementwise, scalars, on_device)

    # ---- rollback snapshots, kept in the store (never the whole state in memory) ----
    def snapshot(self, tag: str) -> dict[str, Any]:
        """Copy every unit's master and optimizer state into records ``<tag>.u<i>.*`` of
        the store, a chunk at a time through one pool buffer (a resident fp32 master
        that is the working parameter is written there too). Returns the handle that
        ``restore_snapshot`` takes: the per-tensor scalars and state names, no tensors
        of state size. Call between steps."""
        self.stream.drain()
        units = []
        for i, u in enumerate(self.units):
            st = self.states[i]
            names = ["master"] + (list(st.elementwise) if st is not None else [])
            for name in names:
                src = f"u{i}.{name}"
                if name == "master" and u.master_is_view:
                    self.ensure_record(f"{tag}.{src}", u.layout.shard_numel, torch.float32)
                    put_record(self.store, f"{tag}.{src}", u.master)
                else:
                    self._copy_record(src, f"{tag}.{src}")
            units.append(None if st is None else
                         {"elementwise": dict(st.elementwise),
                          "scalars": {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                      for k, v in st.scalars.items()}})
        self.report_offloaded()
        return {"tag": tag, "units": units}

    def restore_snapshot(self, handle: dict[str, Any]) -> None:
        """Put the state ``snapshot`` saved back (masters, optimizer state, scalars), and
        rebuild what is derived from the masters: working parameters (all-gathered at
        stages 1/2) and stage-3 parameter shards. Call between steps."""
        self.stream.drain()
        tag = handle["tag"]
        for i, (u, saved) in enumerate(zip(self.units, handle["units"])):
            if u.master_is_view:
                self.fetch(self.store, f"{tag}.u{i}.master", u.master)
            else:
                self._copy_record(f"{tag}.u{i}.master", f"u{i}.master")
            if saved is None:
                self.states[i] = None
                continue
            for name, dt in saved["elementwise"].items():
                self.ensure_record(f"u{i}.{name}", self.state_numel(name, u.layout.shard_numel), dt)
                self._copy_record(f"{tag}.u{i}.{name}", f"u{i}.{name}")
            self.states[i] = UnitState(dict(saved["elementwise"]),
                                       {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                        for k, v in saved["scalars"].items()})
        for i, u in enumerate(self.units):
            self.refresh_params(i, u)
        self.publish()
        self.end_step()

    def ensure_record(self, key: str, numel: int, dtype: torch.dtype) -> None:
        if key not in self.store.records:
            self.store.allocate(key, numel, dtype)

    def _copy_record(self, src: str, dst: str) -> None:
        """Store record ``src`` -> ``dst`` (allocated alike if new), a chunk at a time."""
        rec = self.store.records[src]
        self.ensure_record(dst, rec.numel, rec.dtype)
        for a in range(0, rec.numel, self.chunk_numel):
            b = min(a + self.chunk_numel, rec.numel)
            buf = self.stream.buffer(0, "copy", rec.dtype, b - a)
            self.stream.fetch(Item("copy", self.store, src, a, b), buf)
            self.store.write(dst, a, buf.to("cpu") if buf.device.type != "cpu" else buf)

    def refresh_params(self, i: int, u: FlatParamUnit) -> None:
        """The low-precision copies of unit ``i``'s master (working slice or stage-3
        parameter shard), from the stored master, a chunk at a time."""
        if u.master_is_view:
            return
        S = u.layout.shard_numel
        for a in range(0, S, self.chunk_numel):
            b = min(a + self.chunk_numel, S)
            master = self.stream.buffer(0, "master", torch.float32, b - a)
            self.stream.fetch(Item("master", self.store, f"u{i}.master", a, b), master)
            for item, t in self._update_param_shard(i, u, a, b, 0, master):
                self.stream.write(0, [(item, t)])
                self.stream.drain()

    # ---- optimizer state in torch's format (checkpoints: see torch_format.py) ----
    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer_state_dict(self, optimizer)

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
        load_optimizer_state_dict(self, optimizer, sd)

    @contextlib.contextmanager
    def resident_state(self, optimizer: torch.optim.Optimizer, write_back: bool) -> Iterator[None]:
        """For the duration, the engine looks as it would without offload: masters in
        ``unit.master``, full-size state in ``optimizer.state`` (code that reads or sets
        state, e.g. persistence, runs unchanged). With ``write_back`` what is there at
        the end is stored (and parameter shards refreshed). Holds the whole local state
        in memory meanwhile."""
        with self.masters_resident(write_back):
            sd = self.optimizer_state_dict(optimizer)
            masters = [p for g in optimizer.param_groups for p in g["params"]]
            for n, entry in sd["state"].items():
                optimizer.state[masters[n]] = entry
            try:
                yield
                if write_back:
                    self.load_optimizer_state_dict(optimizer, optimizer.state_dict())
            finally:
                optimizer.state.clear()

    def resident_adjustment(self, by_category: dict[str, int]) -> dict[str, int]:
        """``ShardedModel.bytes_by_category`` counts masters and stage-2/3 gradient
        shards as resident: move them out, count parameter shards and the pool."""
        out = dict(by_category)
        for i, u in enumerate(self.units):
            if not u.master_is_view:
                out["master" if u.param_dtype != torch.float32 else "params"] -= u.layout.shard_numel * 4
            if self.offload_grads:
                out["grads"] -= u.layout.shard_numel * 4
            if self.param_shards[i] is not None:
                out["params"] += self.param_shards[i].numel() * self.param_shards[i].element_size()
        out["offload"] = self.stream.pool_bytes()
        return out

    def close(self) -> None:
        self.stream.close()
        for s in {id(s): s for s in (self.store, self.param_store) if s is not None}.values():
            s.close()


def _same_scalars(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor) and not (is_fake(x) or torch.equal(x, y)):  # a dry run has no values
            return False
        if not isinstance(x, torch.Tensor) and x != y:
            return False
    return True
