"""Frozen parameters (``requires_grad=False``) as sharded flat units, ZeRO stages 1-3.

A ``FrozenUnit`` packs one unit's frozen parameters (the same unit assignment as the
trainable ones, ``assign_units``: a block, or 'root' for parameters outside every block
and tied/shared ones) into a flat buffer laid out as a trainable unit's (padded to the
world size), keeps only this rank's shard, encoded by a ``FrozenCodec``
(``mct.zero.frozen_codec``), and frees the working buffer. The parameters stay views of
it: the stage-3 lifecycle (``mct.zero.stage3``) all-gathers the stored shards and decodes
the unit before the block's forward, again before its backward (recompute included), and
frees it after each. No gradient, no fp32 master, no optimizer state. Parameters stored
by a codec of their own (a QLoRA base's NF4 linear weights, ``FrozenModel(coded=...)``) form
units apart from the rest of their block; at stage 0 those units are whole (world 1) on
every rank and decoded per use by the same lifecycle, with no collective.

Buffers (S = shard_numel, P = world * S):
  working  [P] param dtype: the parameters' storage while gathered; empty otherwise.
  stored   {part: 1-D}: ``codec.encode`` of this rank's slice [r * S, (r + 1) * S).
A unit of world 1 stored by the identity codec (stages 1-3 on one rank) is *resident*:
its stored part is the working buffer itself, never released, so its bytes count once.
Both count under the memory tracker's 'frozen' category.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Iterator

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake

from mct.zero.comm import Comm, Pending
from mct.zero.flat import Values, fill_from, finish_gather, point_at
from mct.zero.frozen_codec import FrozenCodec, IdentityCodec
from mct.zero.partition import ALIGN_ELEMENTS, FlatLayout, build_layout


def split_frozen_ends(model: nn.Module, unit_of: dict[int, str],
                      ends: list[nn.Module | None]) -> list[tuple[str, nn.Module]]:
    """Give each of ``ends`` (the input embedding, an untied output head: modules used at
    one place of the step) a frozen unit of its own instead of 'root', so the stage-3
    lifecycle gathers it around its own call rather than for the whole step. A module
    qualifies when it sits outside every block (``unit_of`` says 'root'), all its
    parameters are frozen and none is used by another module (a tied weight stays in
    'root'). Mutates ``unit_of`` (those parameters -> the module's name); returns the
    (name, module) pairs, in ``ends``' order."""
    uses: dict[int, int] = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
    names = {id(m): n for n, m in model.named_modules()}
    out: list[tuple[str, nn.Module]] = []
    for mod in ends:
        params = list(mod.parameters()) if mod is not None else []
        if not params or id(mod) not in names or any(n == names[id(mod)] for n, _ in out):
            continue
        if all(not p.requires_grad and uses[id(p)] == 1 and unit_of.get(id(p), "root") == "root" for p in params):
            for p in params:
                unit_of[id(p)] = names[id(mod)]
            out.append((names[id(mod)], mod))
    return out


def _own_values(p: nn.Parameter) -> Iterable[tuple[int, torch.Tensor]]:
    return [(0, p.detach().reshape(-1))]


class FrozenUnit:
    """One unit's frozen parameters, sharded (see the module docstring)."""

    persistent = False  # the lifecycle frees it between uses, whatever the stage

    def __init__(self, name: str, params: list[tuple[str, nn.Parameter]], layout: FlatLayout, *,
                 shard_rank: int, dtype: torch.dtype, codec: FrozenCodec, device: torch.device,
                 values: Values | None = None) -> None:
        """Packs ``params``: each becomes a view of the working buffer (its own storage
        dropped; a parameter on meta is swapped for the view), and this rank's slice is
        encoded. ``values(p)``: (start, 1-D values) of ``p``'s flattened elements in order,
        any dtype and device, each read before the next is drawn (``InitProgram.chunks``
        for a model built on meta); default: ``p``'s own. Only the elements of this rank's
        slice are copied: no whole parameter exists unless ``values`` gives it, and the
        whole unit's working buffer is allocated (for the views) but never written unless the
        unit is resident. The unit is left released (a resident one, gathered for good)."""
        self.name, self.layout, self.codec, self.dtype = name, layout, codec, dtype
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.shard_rank = shard_rank
        # the identity codec's stored shard is the working buffer's row: gathered in place
        self.direct = isinstance(codec, IdentityCodec)
        # unsharded (world 1) and stored as it is: the stored shard *is* the working buffer,
        # one copy, gathered for good (a second copy would hold the same bytes twice)
        self.resident = self.direct and layout.world == 1
        self.pending_gather: Pending | None = None
        values = values or _own_values
        with torch.no_grad():
            if self.resident:
                self.working = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
                fill_from(values, self.params, layout, [(self.working, 0, layout.padded_numel)])
                self.stored = {"data": self.working}
            else:
                lo, hi = layout.shard_range(shard_rank)
                part = torch.zeros(hi - lo, dtype=dtype, device=device)
                fill_from(values, self.params, layout, [(part, lo, hi)])
                self.stored = {"data": part} if self.direct else codec.encode(part)
                del part
                # never written: on the host none of its pages become resident; on a GPU its block
                # goes back to the caching allocator at once
                self.working = torch.empty(layout.padded_numel, dtype=dtype, device=device)
            for p, off, n in zip(self.params, layout.offsets, layout.numels()):
                point_at(p, self.working[off:off + n].view(p.shape))
        self.numel_bytes = self.working.untyped_storage().nbytes()
        self.gathered = self.resident
        if not self.resident:
            self.working.untyped_storage().resize_(0)

    def gather(self, comm: Comm, async_op: bool = False) -> None:
        """All-gather every rank's stored shard and decode the unit into the working buffer.
        Only the identity codec's gather runs asynchronously (``async_op``; the caller must
        ``wait_gather`` before use); a decoding codec gathers and decodes at once."""
        if self.gathered or self.pending_gather is not None:
            if not async_op:
                self.wait_gather()
            return
        self.working.untyped_storage().resize_(self.numel_bytes)
        # tensors saved for backward are views of this storage: not an in-place change to autograd
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.working):
            if self.direct:
                self.pending_gather = comm.all_gather(self.stored["data"], self.working, async_op=True) or None
            else:
                self._gather_decode(comm)
        if not async_op:
            self.wait_gather()
        elif self.pending_gather is None:
            self.gathered = True

    def _gather_decode(self, comm: Comm) -> None:
        """All-gather the stored parts (none to gather for an unsharded unit: world 1) and
        decode them into the working buffer, in place where the codec can (``decode_into``)."""
        world = self.layout.world
        full = self.stored
        if world > 1:
            full = {k: torch.empty(world * v.numel(), dtype=v.dtype, device=v.device) for k, v in self.stored.items()}
            for k, v in self.stored.items():
                comm.all_gather(v, full[k])
        decode_into = getattr(self.codec, "decode_into", None)
        if decode_into is not None:
            decode_into(full, self.working)
        else:
            self.working.copy_(self.codec.decode(full, self.layout.padded_numel, self.dtype))

    def wait_gather(self) -> None:
        finish_gather(self)

    def release(self) -> None:
        """Free the working buffer's storage; the parameter views stay, with no data. A
        resident unit (world 1, identity codec) keeps it: it is the stored copy."""
        self.wait_gather()
        if self.gathered and not self.resident:
            self.working.untyped_storage().resize_(0)
            self.gathered = False

    def load_shard(self, read: Callable[[int, int, int], torch.Tensor]) -> None:
        """Replace this rank's stored shard by new values: ``read(i, a, b)`` gives elements
        [a, b) of parameter ``i`` (any float dtype; cast to the working dtype), or None to
        keep that parameter's values. The unit is left released (its next gather reads the
        new shard). Not collective. A lossy codec
        (NF4) keeps its stored parts when the values are the ones they decode to: a
        checkpoint holds the decoded base, and encoding it again would move it (NF4 is not
        idempotent), so a resumed run would not compute on the base it saved."""
        lo, hi = self.layout.shard_range(self.shard_rank)
        part = self.codec.decode(self.stored, hi - lo, self.dtype).to(self.working.device, copy=True)
        for i, a, b, at in self.layout.param_pieces(self.shard_rank):
            values = read(i, a, b)
            if values is not None:
                part[at:at + b - a].copy_(values)
        if self.resident:
            with torch.no_grad():
                self.working.copy_(part)
            return
        self.release()
        lossy = not self.direct and not is_fake(part)
        if lossy and torch.equal(self.codec.decode(self.stored, hi - lo, self.dtype), part):
            return
        self.stored = self.codec.encode(part)

    def stored_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.stored.values())

    def row_length(self) -> int:
        """Elements per row of the unit's only parameter when its shards hold whole rows
        (``FrozenModel(row_units=...)``) and it is stored as it is; 0 otherwise."""
        if len(self.params) != 1 or not self.direct or len(self.layout.shapes[0]) < 2:
            return 0
        row = math.prod(self.layout.shapes[0][1:])
        return row if self.layout.offsets[0] == 0 and self.layout.shard_numel % row == 0 else 0

    def gather_rows(self, comm: Comm, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) of every rank's shard of the unit's only parameter (rank r holds rows
        [r * R, (r + 1) * R), R = shard_numel / row length): rows r * R + lo .. r * R + hi
        of each rank in rank order, a [world * (hi - lo), row] tensor in the working dtype
        (padding rows past the parameter are zeros). Collective: one all-gather of elements
        [lo * row, hi * row) of every shard; a resident unit returns a view, with none.
        Requires ``row_length() > 0`` (assert)."""
        row = self.row_length()
        assert row > 0 and 0 <= lo <= hi <= self.layout.shard_numel // row, (self.name, row, lo, hi)
        if self.resident:
            return self.working[lo * row:hi * row].view(hi - lo, row)
        part = self.stored["data"][lo * row:hi * row]
        out = torch.empty(self.layout.world * part.numel(), dtype=self.dtype, device=part.device)
        comm.all_gather(part, out)
        return out.view(-1, row)


class FrozenModel:
    """A model's frozen parameters: ``units`` (sharded, ``shard=True``) or left whole on
    every rank (stage 0, parameter offload: ``loose``). Parameters ``coded`` names are
    always in units (unsharded, world 1, when ``shard`` is False): their codec (NF4) is
    how they are stored at every stage."""

    def __init__(self, model: nn.Module, unit_of: dict[int, str], order: list[str], *, shard: bool,
                 comm: Comm, dtype: torch.dtype, codec: FrozenCodec, device: torch.device, tracker,
                 coded: dict[str, FrozenCodec] | None = None, row_units: dict[str, int] | None = None,
                 materialize: Callable[[list[nn.Parameter]], None] | None = None,
                 values: Values | None = None) -> None:
        """``unit_of``: parameter id -> unit name (``assign_units``); ``order``: unit names
        in the order to pack. ``codec`` stores every frozen parameter but those ``coded``
        maps to a codec of their own (by name: a QLoRA base's linear weights to NF4); a
        unit's parameters of another codec form a unit of their own, ``<unit>/frozen-<name>``.
        ``materialize(params)``: a model built on meta gets each unit's values just before
        it is packed (so no rank holds the whole frozen base), loose ones up front; they are
        cast to ``dtype``. ``values``: instead, a unit's parameters are read a chunk at a
        time into its shard (``FrozenUnit``; ``InitProgram.chunks``); loose ones still
        through ``materialize``. ``row_units``: unit name -> row length; that unit's shards hold
        whole rows (a streamed head: ``FrozenUnit.gather_rows``). Registers the stored
        shards and working buffers with ``tracker``
        under 'frozen'."""
        self.comm, self.dtype = comm, dtype
        self.digest_cache: dict | None = None  # mct.persistence.base_manifest.frozen_digests
        coded = coded or {}
        frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
        self.units: list[FrozenUnit] = []
        self.loose = [] if shard else [(n, p) for n, p in frozen if n not in coded]
        codecs = [codec, *{id(c): c for c in coded.values()}.values()]
        for uname in order:
            mine = [(n, p) for n, p in frozen if unit_of.get(id(p), "root") == uname and (shard or n in coded)]
            if mine and materialize is not None and values is None:
                materialize([p for _, p in mine])
            for c in codecs:
                these = [(n, p) for n, p in mine if coded.get(n, codec) is c]
                if these:
                    suffix = "frozen" if c is codec else f"frozen-{getattr(c, 'name', 'coded')}"
                    rows = (row_units or {}).get(uname, 1) if c is codec else 1
                    self.units.append(self._unit(f"{uname}/{suffix}", these, c, shard, dtype, device, tracker,
                                                 rows, values))
        if materialize is not None and self.loose:
            materialize([p for _, p in self.loose])
            with torch.no_grad():
                for _, p in self.loose:
                    p.data = p.data.to(dtype)
        # whole on every rank: their bytes count as the frozen base too (the dry run counts them)
        tracker.register_all([p for _, p in self.loose], "frozen")
        self.units_by_block: dict[str, list[FrozenUnit]] = {}
        for u in self.units:
            self.units_by_block.setdefault(u.name.split("/")[0], []).append(u)
        self._tracker = tracker

    def _unit(self, name: str, params: list[tuple[str, nn.Parameter]], codec: FrozenCodec, shard: bool,
              dtype: torch.dtype, device: torch.device, tracker, row: int = 1,
              values: Values | None = None) -> FrozenUnit:
        """One unit packed, encoded, registered with ``tracker`` and released. Every parameter
        starts on a multiple of the codec's ``align``: each is encoded as it would be alone;
        every shard holds a multiple of ``row`` elements."""
        world, rank = (self.comm.world, self.comm.rank) if shard else (1, 0)
        layout = build_layout([n for n, _ in params], [p.shape for _, p in params], world,
                              align=math.lcm(ALIGN_ELEMENTS, codec.align), shard_align=math.lcm(codec.align, row))
        unit = FrozenUnit(name, params, layout, shard_rank=rank, dtype=dtype, codec=codec, device=device,
                          values=values)
        tracker.register_all(unit.stored.values(), "frozen")
        tracker.register(unit.working, "frozen")
        unit.release()
        tracker.refresh(unit.working)
        return unit

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor in the working dtype) of every frozen parameter, a unit gathered at
        a time: a unit's parameters as copies, a loose one as itself (copy it to keep it). Units
        gathered before are left gathered. Collective when sharded: every rank must iterate
        to the end."""
        for u in self.units:
            was = u.gathered
            u.gather(self.comm)
            for name, p in zip(u.names, u.params):
                # a copy: a consumer's .numpy() of a view would pin the working storage (torch
                # then refuses to resize it, and the unit could never be released again)
                yield name, p.detach().clone()
            if not was:
                u.release()
        for name, p in self.loose:
            yield name, p.detach()

    def load(self, read: Callable[[str, int, int], torch.Tensor]) -> None:
        """Set every frozen parameter from ``read(name, a, b)`` (elements [a, b) of the
        named parameter, or None: that parameter keeps its values): this rank's shard of
        each unit, the whole of a loose one. Drops the cached digests."""
        self.digest_cache = None
        with torch.no_grad():
            for u in self.units:
                u.load_shard(lambda i, a, b, u=u: read(u.names[i], a, b))
                self._tracker.register_all(u.stored.values(), "frozen")
                self._tracker.refresh(u.working)
            for name, p in self.loose:
                values = read(name, 0, p.numel())
                if values is not None:
                    p.copy_(values.view(p.shape))

    def stored_bytes(self) -> int:
        """Bytes of frozen parameters this rank keeps between uses (shards, or whole)."""
        return (sum(u.stored_nbytes() for u in self.units)
                + sum(p.numel() * p.element_size() for _, p in self.loose))
