"""FlatParamUnit: one unit's parameters of one optimizer group, packed flat.

Buffers (S = shard_numel, P = padded_numel = world * S):
  working      [P] param dtype. The module's parameters are views into it, so names
               and shapes seen by the user never change. Stage 3 frees its storage
               between uses (``release``) and all-gathers it back (``gather``).
  master       [S] fp32, this rank's slice: what the optimizer updates. When the
               working dtype is fp32 and the buffer is persistent (stages 0-2), the
               master is a view of the working buffer's own slice (no second copy).
  grad_full    [P] reduce dtype: parameter gradients are added into it by
               post-accumulate-grad hooks (stages 0/1: persistent; 2/3: per backward).
               Not built by a unit that keeps its gradients (``hold_grads``: the root,
               and at stages 2/3 every unit of a 2-rank gloo run in the reduce dtype,
               whose gradients are sent as they are: ``Comm._exchange``).
  grad_shard   [S] fp32: the reduced, accumulated gradient of this rank's slice (fp32
               stage 0: grad_full itself; fp32 stage 1: a view of grad_full's slice).
               Stages 2/3 hold none between steps: the unit's first reduce of a step
               creates it (the fp32 reduce-scatter output itself, no copy), later
               micro-batches add into it, ``zero_grad`` after the step drops it.
At stage 0 the layout has world = 1, so the "slice" is the whole buffer.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake

from mct.memory.host import Advise, as_is
from mct.precision.policy import PrecisionPolicy
from mct.zero.comm import Comm, Pending
from mct.zero.partition import FlatLayout
from mct.zero.shm import read_into


Values = Callable[[nn.Parameter], Iterable[tuple[int, torch.Tensor]]]
"""A parameter -> (start, 1-D values) of its flattened elements in order, each read before the
next is drawn (``InitProgram.chunks`` for a model built on meta)."""


def point_at(p: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``p`` a view of a flat buffer: ``.data =`` for a real or fake parameter; a
    parameter on meta (which ``.data =`` refuses to move) keeps its object, its contents
    swapped."""
    if p.is_meta:
        torch.utils.swap_tensors(p, nn.Parameter(view, requires_grad=p.requires_grad))
    else:
        p.data = view


def fill_from(values: Values, params: list[nn.Parameter], layout: FlatLayout,
              targets: list[tuple[torch.Tensor, int, int]]) -> None:
    """Copy the parameters' values, a chunk at a time, into every target ``(out, lo, hi)``:
    ``out`` holds elements [lo, hi) of the layout's flat buffer (cast to its dtype). Each
    parameter's chunks are drawn once, and only up to the last element a target needs."""
    for p, off, n in zip(params, layout.offsets, layout.numels()):
        spans = [(out, max(off, lo) - off, min(off + n, hi) - off, lo) for out, lo, hi in targets]
        spans = [s for s in spans if s[1] < s[2]]  # [a, b) of p in each target
        if not spans:
            continue
        need = max(b for _, _, b, _ in spans)
        for start, chunk in values(p):
            stop = start + chunk.numel()
            for out, a, b, lo in spans:
                x, y = max(start, a), min(stop, b)
                if x < y:
                    out[off + x - lo:off + y - lo].copy_(chunk[x - start:y - start])
            if stop >= need:
                break


def pack_chunks(params: list[nn.Parameter], layout: FlatLayout, shard_rank: int, param_dtype: torch.dtype,
                master_is_view: bool, device: torch.device, values: Values,
                persistent: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack`` from ``values``, a chunk at a time: the master slice is copied from the values
    in fp32, bit for bit; the working buffer gets their cast when the unit is ``persistent``,
    and only its allocation otherwise (stage 3 frees it once built and gathers from the
    masters): no whole parameter, and no chunk past this rank's slice of a freed unit, is read."""
    lo, hi = layout.shard_range(shard_rank)
    working = (torch.zeros if persistent else torch.empty)(layout.padded_numel, dtype=param_dtype, device=device)
    master = working[lo:hi] if master_is_view else torch.zeros(hi - lo, dtype=torch.float32, device=device)
    with torch.no_grad():
        fill_from(values, params, layout, [*([(working, 0, layout.padded_numel)] if persistent else []),
                                           *([] if master_is_view else [(master, lo, hi)])])
        for p, off, n in zip(params, layout.offsets, layout.numels()):
            point_at(p, working[off:off + n].view(p.shape))
    return working, master


def pack(params: list[nn.Parameter], layout: FlatLayout, shard_rank: int, param_dtype: torch.dtype,
         master_is_view: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The unit's (working [P], master [S]) buffers; the parameters become views of
    the working one. The master holds this rank's slice of the parameters' own values
    in fp32, bit for bit (never a copy of the low-precision working buffer, which would
    start the optimizer from rounded weights); the working buffer is their cast to the
    param dtype, so on this rank's slice it equals ``master.to(param_dtype)``.
    Parameters are packed (and their own storage dropped) outside the slice first, then
    those across its edges (their part of the slice kept aside), then the master is
    allocated for those inside: the construction peak stays that of casting the master
    from the working buffer (working + this rank's slice twice in fp32)."""
    lo, hi = layout.shard_range(shard_rank)
    working = torch.zeros(layout.padded_numel, dtype=param_dtype, device=device)
    spans = list(zip(params, layout.offsets, layout.numels()))
    overlap = [(max(off, lo), min(off + n, hi)) for _, off, n in spans]
    kind = [2 if (lo <= off and off + n <= hi) else int(a < b) for (_, off, n), (a, b) in zip(spans, overlap)]
    parts: list[tuple[int, torch.Tensor]] = []  # (offset in the slice, fp32 values)
    master = None
    with torch.no_grad():
        for i in [*sorted(range(len(spans)), key=kind.__getitem__), None]:
            if master is None and not master_is_view and (i is None or kind[i] == 2):
                master = torch.zeros(hi - lo, dtype=torch.float32, device=device)
                while parts:  # popped: each kept part is freed once copied
                    at, kept = parts.pop()
                    master[at:at + kept.numel()].copy_(kept)
                    del kept
            if i is None:
                break
            (p, off, n), (a, b) = spans[i], overlap[i]
            flat = p.detach().reshape(-1)
            if not master_is_view and a < b:
                if master is not None:
                    master[a - lo:b - lo].copy_(flat[a - off:b - off])
                else:
                    parts.append((a - lo, flat[a - off:b - off].clone()))
            working[off:off + n].copy_(flat)
            p.data = working[off:off + n].view(p.shape)
            del flat  # the parameter's own storage goes now, not one parameter later
    return working, (working[lo:hi] if master_is_view else master)


class HeldGrads:
    """A unit's parameter gradients as they arrived, read as its flat ``[world * S]``
    gradient in the reduce dtype, one bucket of columns at a time (``fill``), so no
    full-size flat buffer exists: the bytes are the gradients' own (in the compute
    dtype). Each element is zero plus the arriving gradients in arrival order, in the
    reduce dtype: the same sums, bit for bit, as adding them into a zeroed flat buffer.
    A parameter's first gradient is written as ``0 + g`` in one pass (``put_columns``),
    later ones added; only the elements no gradient covers are zeroed."""

    def __init__(self, layout: FlatLayout, grads: list[tuple[int, torch.Tensor]], dtype: torch.dtype,
                 device: torch.device, sendable: bool = False) -> None:
        """``sendable``: every gradient is in ``dtype`` and at most one per parameter, so
        a 2-rank exchange may send them as they are (``Comm.reduce_scatter``, ``row``);
        the same on every rank (the units' dtypes), never read from the tensors."""
        self.layout, self.grads, self.dtype, self.device = layout, grads, dtype, device
        self.sendable = sendable
        # one zero for every bucket's first writes, alive as long as the held gradients (a
        # bucket-by-bucket reduce and the dry run's one-bucket shortcut hold the same bytes)
        self.zero = torch.zeros(1, dtype=dtype, device=device)
        # a parameter's first held gradient is written, its later ones (tiles) added
        firsts = {i: n for n, (i, _) in reversed(list(enumerate(grads)))}
        self.first = [firsts[i] == n for n, (i, _) in enumerate(grads)]
        self.gaps = uncovered(layout, firsts)
        self._by_index: dict[int, torch.Tensor] | None = None

    def numel(self) -> int:
        return self.layout.padded_numel

    def element_size(self) -> int:
        return self.dtype.itemsize

    def fill(self, dst: torch.Tensor, a: int, b: int) -> None:
        """``dst`` [world, b - a] <- columns [a, b) of the flat gradient viewed as [world, S]."""
        S = self.layout.shard_numel
        for x, y in self.gaps:
            zero_columns(dst, x, y - x, S, a, b)
        for (index, grad), first in zip(self.grads, self.first):  # in arrival order: each element sums as before
            flat, off = grad.reshape(-1), self.layout.offsets[index]
            if first:
                put_columns(dst, flat, off, S, a, b, self.zero)
            else:
                add_columns(dst, flat, off, S, a, b)

    def row(self, r: int, a: int, b: int) -> list[tuple[int, int, torch.Tensor | None]]:
        """Row ``r``'s columns [a, b) of the flat gradient viewed as [world, S], as the
        pieces parameters cover, in column order: (c0, c1, g), columns [a + c0, a + c1)
        holding ``g`` (a view of the parameter's own gradient; None where it got none on
        this rank). Alignment gaps and padding are in no piece. Decided by the layout
        alone, so two ranks cut the same pieces whatever gradients each holds. Needs
        ``sendable`` (one gradient per parameter)."""
        S = self.layout.shard_numel
        if self._by_index is None:
            self._by_index = {i: g.reshape(-1) for i, g in self.grads}
        out = []
        for i, x, y, at in self.layout.pieces(r * S + a, r * S + b):
            g = self._by_index.get(i)
            out.append((at, at + y - x, None if g is None else g[x:y]))
        return out


def uncovered(layout: FlatLayout, indices) -> list[tuple[int, int]]:
    """The [x, y) ranges of a flat [padded_numel] buffer that no parameter of ``indices``
    covers: alignment gaps, tail padding, parameters left out."""
    out, at = [], 0
    for off, n in sorted((layout.offsets[i], layout.numels()[i]) for i in indices):
        if off > at:
            out.append((at, off))
        at = max(at, off + n)
    if at < layout.padded_numel:
        out.append((at, layout.padded_numel))
    return out


def column_pieces(world: int, S: int, off: int, n: int, a: int, b: int) -> list[tuple[int, int, int, int, int]]:
    """Where elements [off, off + n) of a flat [world * S] tensor fall in its columns
    [a, b) viewed as [world, b - a]: pieces (r0, r1, c0, c1, at), rows [r0, r1) x columns
    [c0, c1) of the view holding the range's elements at + (r - r0) * S + (c - c0). One
    piece for the rows the range covers whole, one per partly covered row: O(1), not
    O(world)."""
    width = b - a
    # rows r whose columns [r*S + a, r*S + b) meet [off, off + n), and those it covers whole
    first, last = max(0, (off - b) // S + 1), min(world - 1, -(-(off + n - a) // S) - 1)
    if first > last or width <= 0 or n <= 0:
        return []
    whole_lo, whole_hi = max(first, -(-(off - a) // S)), min(last, (off + n - b) // S)
    pieces = []
    if whole_lo <= whole_hi:
        pieces.append((whole_lo, whole_hi + 1, 0, width, whole_lo * S + a - off))
    for r in sorted({first, last}):
        if whole_lo <= r <= whole_hi:
            continue
        lo = r * S + a
        x, y = max(lo, off), min(lo + width, off + n)
        if x < y:
            pieces.append((r, r + 1, x - lo, y - lo, x - off))
    return pieces


def _rows(flat: torch.Tensor, S: int, r0: int, r1: int, c0: int, c1: int, at: int) -> torch.Tensor:
    return flat.as_strided((r1 - r0, c1 - c0), (S, 1), flat.storage_offset() + at)


def add_columns(dst: torch.Tensor, flat: torch.Tensor, off: int, S: int, a: int, b: int) -> None:
    """``dst`` [world, b - a] += columns [a, b) of a parameter's gradient ``flat`` (its
    elements at [off, off + numel) of a flat [world * S] gradient viewed as [world, S])."""
    for r0, r1, c0, c1, at in column_pieces(dst.shape[0], S, off, flat.numel(), a, b):
        dst[r0:r1, c0:c1].add_(_rows(flat, S, r0, r1, c0, c1, at))


def put_columns(dst: torch.Tensor, flat: torch.Tensor, off: int, S: int, a: int, b: int,
                zero: torch.Tensor) -> None:
    """As ``add_columns`` into zeros, in one pass: ``dst`` <- ``zero + flat`` on the
    columns it covers. ``zero``: a one-element zero of ``dst``'s dtype (not a scalar, so
    the sum is computed in ``dst``'s dtype exactly as ``zeros.add_(flat)`` computes it:
    the same bits, -0.0 and NaNs included)."""
    for r0, r1, c0, c1, at in column_pieces(dst.shape[0], S, off, flat.numel(), a, b):
        put_zero_plus(dst[r0:r1, c0:c1], _rows(flat, S, r0, r1, c0, c1, at), zero)


def scale_(tensors: list[torch.Tensor], factor: float | None) -> None:
    """``tensors`` x ``factor`` in place (a gradient average, a clip coefficient); nothing for
    ``None`` or exactly 1.0: x 1.0 changes no bit (-0.0 and NaN included), so no pass over them."""
    if factor is not None and factor != 1.0 and tensors:
        torch._foreach_mul_(tensors, factor)


NORM_CHUNK = 2**18
"""Elements per chunk of ``fp64_sq_norm`` on a CPU (2 MiB of fp64: a chunk's widened copy stays
in cache between its cast, its squaring and its sum)."""


def fp64_sq_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum over ``tensors`` of the squared L2 norm of each, in fp64: the global gradient
    norm's local part (clipping, the overflow check), so that it does not depend on how the
    gradient is cut into shards beyond fp64's rounding.

    On a CPU each tensor is read in chunks of ``NORM_CHUNK`` elements, each widened into one
    reused fp64 buffer and squared there (exact: an fp32, bf16 or fp16 value's square fits
    fp64's 53-bit mantissa), and the chunk's ``sum`` (torch's cascade) is added to the
    tensor's total; the totals are added in order. Defined by that order: ``s(t) = ((0 +
    sum(c1^2)) + sum(c2^2)) + ...``, the result ``s(t1) + s(t2) + ...``, the same bits for
    the same tensors and threads wherever it is taken (the offloaded gradients' norm takes
    it shard by shard as each is written). One pass over the gradients and a 2 MiB buffer:
    a 78 M-element shard in 26-31 ms here, where ``vector_norm(t, dtype=float64)`` widens
    the whole tensor into a fresh fp64 copy (8 bytes an element, faulted in every step) and
    took 200-280 ms; and within 4e-16 of the exact sum where that form was 7e-13 off (a
    32.8 M-element normal shard against ``math.fsum``). Non-finite values stay non-finite.
    On fake tensors (a dry run): the same buffer, and each tensor read by one op (its bytes
    once, as the real pass reads them from memory; the chunks' traffic stays in cache). On CUDA
    the kernel widens as it reads (no copy): each norm is taken as it is there."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    device = tensors[0].device
    if device.type != "cpu":
        return sum(torch.linalg.vector_norm(t, dtype=torch.float64).square() for t in tensors)
    longest = max(t.numel() for t in tensors)
    buf = torch.empty(min(NORM_CHUNK, longest), dtype=torch.float64, device=device)
    fake = is_fake(buf)
    total = None
    for t in tensors:
        flat, n = t.reshape(-1), t.numel()
        if fake:  # the pass over the tensor as one read (what the time model prices), the buffer held
            s = flat.sum(dtype=torch.float64)
        else:
            s = torch.zeros((), dtype=torch.float64, device=device)
            for a in range(0, n, NORM_CHUNK):
                chunk = buf[:min(NORM_CHUNK, n - a)].copy_(flat[a:a + NORM_CHUNK])
                s += chunk.mul_(chunk).sum()
        total = s if total is None else total + s
    return total


def put_zero_plus(out: torch.Tensor, src: torch.Tensor, zero: torch.Tensor) -> None:
    """``out`` <- ``torch.add(zero, src)`` (``zero``: a one-element zero of ``out``'s dtype).
    A 16-bit ``src`` into an fp32 ``out`` (a bf16 gradient into an fp32 buffer): cast
    straight into ``out``, then ``+ zero`` in place, where ``torch.add`` would cast ``src``
    into a temporary of its size first (an allocation, fresh pages, one more pass). The
    same bits: the widening cast is exact, so both compute ``0 + src`` in fp32, and IEEE
    addition is commutative (-0.0 and NaN included). A narrowing cast would round before
    the add (a tiny negative to -0.0, then +0.0): those keep ``torch.add``."""
    if out.dtype == torch.float32 and src.dtype in (torch.bfloat16, torch.float16):
        out.copy_(src)
        out.add_(zero)
    else:
        torch.add(zero, src, out=out)


def zero_columns(dst: torch.Tensor, off: int, n: int, S: int, a: int, b: int) -> None:
    """Zero the elements [off, off + n) of the flat gradient in ``dst``'s columns [a, b)."""
    for r0, r1, c0, c1, _ in column_pieces(dst.shape[0], S, off, n, a, b):
        dst[r0:r1, c0:c1].zero_()


def finish_gather(unit) -> None:
    """Wait for ``unit``'s in-flight all-gather into its working buffer (if any), then mark
    it gathered when the buffer holds its storage: a ``FlatParamUnit`` or a frozen unit
    (``mct.zero.frozen``). Mutates ``unit.pending_gather`` and ``unit.gathered``."""
    if unit.pending_gather is not None:
        with torch.autograd._unsafe_preserve_version_counter(unit.working):
            unit.pending_gather.wait()
        unit.pending_gather = None
    if unit.working.untyped_storage().nbytes() == unit.numel_bytes:
        unit.gathered = True


class FlatParamUnit:
    def __init__(self, name: str, params: list[tuple[str, nn.Parameter]], layout: FlatLayout, *,
                 shard_rank: int, precision: PrecisionPolicy, persistent: bool, full_grads: bool,
                 device: torch.device, on_new_grad_shard: Callable[[torch.Tensor], None] | None = None,
                 values: Values | None = None) -> None:
        """``precision``: the working (``param_dtype``) and reduction (``reduce_dtype``)
        dtypes. ``values``: the parameters' values a chunk at a time (``pack_chunks``; a
        model built on meta) instead of their own. ``on_new_grad_shard`` is called with each gradient shard created during
        a step (stages 2/3), and each buffer summing a held parameter's parts, e.g. to
        count it in a memory tracker."""
        param_dtype, reduce_dtype = precision.param_dtype, precision.reduce_dtype
        self.name = name
        self.on_new_grad_shard = on_new_grad_shard
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.layout = layout
        self._numels = layout.numels()  # read once per gradient in backward: computed once here
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.persistent = persistent
        self.master_is_view = persistent and param_dtype == torch.float32
        self.working, self.master = (
            pack(self.params, layout, shard_rank, param_dtype, self.master_is_view, device) if values is None else
            pack_chunks(self.params, layout, shard_rank, param_dtype, self.master_is_view, device, values, persistent))
        working = self.working
        lo, hi = layout.shard_range(shard_rank)
        # Stages 0/1 keep a full gradient buffer across micro-batches (reduced once,
        # after the last); stages 2/3 allocate it per backward and free it once reduced.
        self.full_grads = full_grads
        self.grad_full: torch.Tensor | None = (
            torch.zeros(layout.padded_numel, dtype=reduce_dtype, device=device) if full_grads else None)
        # fp32 full gradients (stages 0/1) hold the reduced slice in place: no second copy.
        self.grad_shard_in_full = full_grads and reduce_dtype == torch.float32
        if self.grad_shard_in_full and layout.world == 1:
            self.grad_shard = self.grad_full  # stage 0: the all-reduced buffer is the shard
        elif self.grad_shard_in_full:
            self.grad_shard = self.grad_full[lo:hi]  # stage 1: this rank's slice of it
        elif full_grads:
            self.grad_shard = torch.zeros(layout.shard_numel, dtype=torch.float32, device=device)
        else:
            # Stages 2/3: no gradient until backward reduces one, so forward (where the
            # activation peak is) does not carry last step's gradient memory.
            self.grad_shard = None
        self.device = device
        # Stage 3: what ``gather`` all-gathers; None = this rank's master cast to the
        # param dtype. Offload points it at a parameter shard kept apart from the master.
        self.gather_source: Callable[[], torch.Tensor] | None = None
        # Stage 3 on one host: (the window, [(rank, a descriptor of its master shard; None in a
        # dry run)]) from ``mct.zero.shm.share_masters``; a gather inside the window copies them
        self.shared: tuple[Any, list[tuple[int, int | None]]] | None = None
        # bf16/fp16 parameters shared so: this rank's master shard cast to the param dtype, in
        # shared memory (peers read it), refreshed as each window opens (mct.zero.shm)
        self.published: torch.Tensor | None = None
        self.shard_rank = shard_rank
        self.gathered = True
        # Buckets of this unit's collectives in flight at once (None: all); ShardedModel
        # gives the root unit a window (mct.zero.comm.IN_FLIGHT_BUCKETS).
        self.bucket_window: int | None = None
        # Stages 2/3: keep the parameters' gradients as they arrive and read them into the
        # reduce-scatter's buckets (HeldGrads) instead of a full-size flat gradient from
        # the first one on; ShardedModel sets it for the root unit (embedding and head:
        # their gradients arrive at the two ends of backward).
        self.hold_grads = False
        self.held: list[tuple[int, torch.Tensor]] = []
        self._held_at: dict[int, int] = {}  # parameter index -> its entry in ``held``
        self._summed: set[int] = set()  # entries that are sums of parts (buffers of our own)
        # Stages 2/3: parameters with no gradient yet in this backward's grad_full (their
        # first one is written, not added: ``_new_grad_full``). Stages 0/1 keep a zeroed
        # buffer across micro-batches and steps and add every gradient into it.
        self.unwritten: set[int] = set()
        self._zero: torch.Tensor | None = None
        # Stages 2/3 (ShardedModel sets both for a block's unit): ``reduce_in_place``: its
        # reduce-scatter reads each bucket of grad_full in place (``bucket_major``), no copy
        # of its columns; ``grad_buckets``: those buckets (the ones Comm.reduce_scatter
        # cuts), grad_full laid out bucket by bucket, bucket [a, b) of the [world, S]
        # gradient at [world * a, world * b). None in a dry run whose collectives allocate
        # as one (``BUCKETS_AS_ONE``): the same bytes, in one add per gradient.
        self.reduce_in_place = False
        self.grad_buckets: list[tuple[int, int]] | None = None
        # called on each fresh buffer before its first write (ShardedModel sets the Comm's
        # ``advise``: huge pages on the host, ``mct.memory.host.HugePages``)
        self.advise: Advise = as_is
        self.pending_gather: Pending | None = None
        self.pending_reduce: Pending | None = None
        self.grads_seen = 0
        self.reduced_this_backward = False
        self.numel_bytes = working.untyped_storage().nbytes()

    # ---- parameter storage (stage 3) ----
    def release(self) -> None:
        """Free the working buffer's storage; parameter views stay, with no data."""
        self.wait_gather()
        if self.gathered and not self.persistent:
            self.working.untyped_storage().resize_(0)
            self.gathered = False

    def gather(self, comm: Comm, async_op: bool = False) -> None:
        """All-gather every rank's master slice (cast to the working dtype) into the
        working buffer. With ``async_op`` the caller must ``wait_gather`` before use."""
        if self.gathered or self.pending_gather is not None:
            if not async_op:
                self.wait_gather()
            return
        self.working.untyped_storage().resize_(self.numel_bytes)
        self.advise(self.working)
        if self.shared is not None and self.shared[0].open and self.shared[1]:
            self._gather_shared(comm)
            return
        if self.gather_source is not None:
            src = self.gather_source()
        else:  # an fp32 master is sent as it is (``.to``'s no-copy case)
            src = self.master if self.master.dtype == self.param_dtype else self._cast_master()
        # Writing into the buffer must not look like an in-place change of the
        # parameters to autograd: tensors saved in forward are views of this storage.
        with torch.autograd._unsafe_preserve_version_counter(self.working):
            self.pending_gather = comm.all_gather(src, self.working, async_op=True, window=self.bucket_window) or None
        if not async_op:
            self.wait_gather()
        elif self.pending_gather is None:
            self.gathered = True

    def _gather_shared(self, comm: Comm) -> None:
        """Every rank's master shard (bf16/fp16 parameters: its published cast) copied into
        its row of the working buffer: this rank's own, the peers' from their shared
        mappings (``mct.zero.shm``). The bytes an all-gather moves, without a message;
        done when it returns."""
        t0 = time.perf_counter()
        rows = self.working.view(-1, self.master.numel())
        src = self.master if self.published is None else self.published
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.working):
            r = self.shard_rank
            rows[r].copy_(src)
            if comm.simulated:
                # a dry run (mct.zero.shm: no files): the peers' rows written with stand-in bytes, the rows
                # before this rank's and those after it each in one copy (any world, at most two ops)
                n = rows.shape[0]
                for a, b in ((0, r), (r + 1, n)):
                    if b > a:
                        rows[a:b].copy_(src.expand(b - a, -1))
            else:
                for q, fd in self.shared[1]:
                    read_into(fd, rows[q])
        comm.stats.add(self.numel_bytes, time.perf_counter() - t0)
        self.gathered = True

    def _cast_master(self) -> torch.Tensor:
        """This rank's master in the param dtype, in a fresh (advised) buffer: what an
        all-gather sends. Never the master itself, even in fp32: a stage-1/2 all-gather
        writes into the working buffer the fp32 master is a view of. ``copy_`` casts as
        ``.to`` does (the same rounding)."""
        return self.advise(torch.empty(self.master.shape, dtype=self.param_dtype,
                                       device=self.master.device)).copy_(self.master)

    def wait_gather(self) -> None:
        finish_gather(self)

    def publish_master(self, comm: Comm) -> None:
        """After the optimizer step: make the working parameters equal the master
        (stage 0: local cast; stages 1/2: all-gather of every rank's slice)."""
        if not self.persistent:
            return  # stage 3 gathers on demand from the master shards
        with torch.no_grad():
            if comm.world == 1 or self.layout.world == 1:
                if not self.master_is_view:
                    self.working.copy_(self.master)
            else:
                src = self._cast_master()
                comm.all_gather(src, self.working, window=self.bucket_window)

    # ---- gradients ----
    def accumulate_grad(self, index: int, grad: torch.Tensor, last: bool = True) -> None:
        """Add one parameter's gradient into the flat gradient buffer (``hold_grads``:
        keep it until the unit is reduced). ``last=False``: a partial sum, more of this
        parameter's gradient follows in this backward (a tiled MLP's earlier tiles); only
        a last part counts in ``grads_seen``."""
        if self.hold_grads and not self.full_grads:
            self._hold(index, grad)
        else:
            if self.grad_full is None:
                self._new_grad_full(grad.device)
            flat = grad.reshape(-1)
            first = index in self.unwritten  # its range holds no value yet: written, not added to
            if first:
                self.unwritten.discard(index)
            off = self.layout.offsets[index]
            if self.grad_buckets is not None and self.reduce_in_place:
                world, S = self.layout.world, self.layout.shard_numel
                for a, b in self.grad_buckets:  # bucket [a, b): [world, b - a] at [world * a, world * b)
                    view = self.grad_full[world * a:world * b].view(world, b - a)
                    if first:
                        put_columns(view, flat, off, S, a, b, self._zero)
                    else:
                        add_columns(view, flat, off, S, a, b)
            elif first:
                put_zero_plus(self.grad_full[off:off + self._numels[index]], flat, self._zero)
            else:
                self.grad_full[off:off + self._numels[index]].add_(flat)
        self.grads_seen += int(last)

    def _hold(self, index: int, grad: torch.Tensor) -> None:
        """Keep ``grad`` until the unit is reduced. A parameter's later parts (a tiled
        MLP's tiles) are summed into one buffer of the reduce dtype as they come, as the
        flat buffer would sum them: ``(0 + g1) + g2 + ...`` in arrival order, never -0.0
        (so ``HeldGrads`` writes it as it is), one buffer alive, not one per tile."""
        at = self._held_at.get(index)
        if at is None:
            self._held_at[index] = len(self.held)
            self.held.append((index, grad))
            return
        _, kept = self.held[at]
        if at not in self._summed:
            if self._zero is None:
                self._zero = torch.zeros(1, dtype=self.reduce_dtype, device=grad.device)
            total = self.advise(torch.empty(kept.numel(), dtype=self.reduce_dtype, device=grad.device))
            put_zero_plus(total, kept.reshape(-1), self._zero)
            self.held[at], kept = (index, total), total
            self._summed.add(at)
            if self.on_new_grad_shard is not None:
                self.on_new_grad_shard(total)  # a gradient buffer made in backward: counted as one
        kept.add_(grad.reshape(-1))

    def _new_grad_full(self, device: torch.device) -> None:
        """Stages 2/3: this backward's flat gradient, allocated without a zero-fill. Each
        parameter's first gradient is written into it as ``0 + g`` (``put_columns``: the
        same bits as adding it into zeros, in one pass instead of a fill and an add); the
        elements no parameter covers (alignment gaps, tail padding) are zeroed now, those
        of parameters that get no gradient when the unit is reduced (``zero_unwritten``)."""
        self.grad_full = self.advise(torch.empty(self.layout.padded_numel, dtype=self.reduce_dtype, device=device))
        self._zero = torch.zeros(1, dtype=self.reduce_dtype, device=device)
        self.unwritten = set(range(len(self.params)))
        self._zero_ranges(uncovered(self.layout, self.unwritten))

    def _zero_ranges(self, ranges: list[tuple[int, int]]) -> None:
        """Zero the flat gradient's elements [x, y) for each range (in grad_full's layout)."""
        if self.grad_buckets is not None and self.reduce_in_place:
            world, S = self.layout.world, self.layout.shard_numel
            for a, b in self.grad_buckets:
                view = self.grad_full[world * a:world * b].view(world, b - a)
                for x, y in ranges:
                    zero_columns(view, x, y - x, S, a, b)
        else:
            for x, y in ranges:
                self.grad_full[x:y].zero_()

    def zero_unwritten(self) -> None:
        """Zero the flat gradient's elements of parameters that got no gradient in this
        backward (stages 2/3; called by ``reduce``)."""
        if self.unwritten and self.grad_full is not None:
            self._zero_ranges([(self.layout.offsets[i], self.layout.offsets[i] + self._numels[i])
                               for i in sorted(self.unwritten)])
        self.unwritten = set()

    def reduce(self, comm: Comm, async_op: bool) -> None:
        """Sum grad_full over ranks into grad_shard (added to what is there), then
        zero (stages 0/1) or free (stages 2/3) grad_full. Stage 0 (layout world 1)
        all-reduces the whole buffer instead."""
        self.reduced_this_backward = True
        self.zero_unwritten()
        full = self.grad_full
        if self.held:
            full = HeldGrads(self.layout, self.held, self.reduce_dtype, self.device,
                             sendable=self.param_dtype == self.reduce_dtype)
            self.held, self._held_at, self._summed, self._zero = [], {}, set(), None
        if full is None:
            return
        if self.layout.world == 1 and self.full_grads:
            comm.all_reduce_(full)
            if self.grad_shard is not full:
                self.grad_shard.add_(full)
                full.zero_()
            return
        out = self.advise(torch.empty(self.layout.shard_numel, dtype=full.dtype, device=full.device))

        def accumulate() -> None:
            # self.grad_full, not ``full``: at stages 2/3 this closure must not keep the
            # full gradient alive (a bucketed reduce-scatter is done with it on return)
            if self.grad_shard_in_full:
                # Stage 1 reduces once per step, so the slice holds no earlier reduced sum.
                self.grad_full.zero_()
                self.grad_shard.copy_(out)
                return
            if self.grad_shard is None:
                self._new_grad_shard(out if out.dtype == torch.float32 else out.float())
            else:
                self.grad_shard.add_(out)
            if self.full_grads:
                self.grad_full.zero_()
        if not self.full_grads:
            self.grad_full = self._zero = None  # freed once the collective is done with it
        self.pending_reduce = comm.reduce_scatter(full, out, async_op=async_op, then=accumulate,
                                                  window=self.bucket_window,
                                                  bucket_major=self.reduce_in_place and isinstance(full, torch.Tensor))

    def wait_reduce(self) -> None:
        # Cleared first: the completion callback may raise (a budget check on the new
        # gradient shard), and a reduce must never be waited on, or accumulated, twice.
        pending, self.pending_reduce = self.pending_reduce, None
        if pending is not None:
            pending.wait()

    def _new_grad_shard(self, shard: torch.Tensor) -> None:
        self.grad_shard = shard
        if self.on_new_grad_shard is not None:
            self.on_new_grad_shard(shard)

    def grad_shard_or_zeros(self) -> torch.Tensor:
        """The gradient shard; a unit that received no gradient this step (every
        parameter unused) gets zeros, as the reference's optimizer would see."""
        if self.grad_shard is None:
            self._new_grad_shard(torch.zeros(self.layout.shard_numel, dtype=torch.float32, device=self.device))
        return self.grad_shard

    def zero_grad(self) -> None:
        """After a step: zero the persistent buffers (stages 0/1), drop the gradient
        shard (stages 2/3; its memory is freed once nothing else refers to it)."""
        if self.full_grads:
            self.grad_shard.zero_()
        else:
            self.grad_shard = None
        if self.grad_full is not None:
            self.grad_full.zero_()

    def new_backward(self) -> None:
        self.held, self._held_at, self._summed = [], {}, set()  # none left by a backward that raised before its reduce
        self.grads_seen = 0
        self.reduced_this_backward = False

    @property
    def n_trainable(self) -> int:
        return len(self.params)
