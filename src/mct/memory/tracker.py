"""Live tensor bytes by category, and the peak of each phase of a training step.

On CPU the tracker is a small ``TorchDispatchMode``: it sees the outputs of every
ATen op run inside ``phase()``/``category()``, counts each new untyped storage once
by ``nbytes()``, and subtracts it when the storage object is freed (a weakref
callback). Views share their base's storage and in-place ops return an input, so
neither adds bytes. Counts are exact and deterministic: the same program yields the
same bytes on every run.

Why not torch's ``MemTracker`` (``torch.distributed._tools``)? It is built around
module and optimizer hooks (per-module fw/bw snapshots), monkey-patches
``UntypedStorage.resize_`` globally, rounds to the CUDA allocator's block size and
lives in a private namespace whose API changes between releases. The engine needs
less and needs it stable: a handful of categories it assigns itself (params, grads,
optimizer state), a peak per named phase, a budget that fails at the allocation that
crosses it, and a disabled mode that costs nothing. ~150 lines of dispatch-level
bookkeeping give exactly that with no private torch internals beyond an op's schema.

Known limitation: only storages that reach Python as op outputs are seen. Kernel
workspaces and temporaries freed inside one op, allocator caching, rounding and
fragmentation are invisible, so CPU numbers are a lower bound on what the process
really holds. That is why CUDA uses ``torch.cuda`` statistics instead: there
"activations" is everything allocated that was not registered under a category.
Byte updates are not locked: frees that happen concurrently on another thread while
this one allocates could race (CPU autograd runs backward on the calling thread).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from mct.config import Name
from mct.memory.process_peak import TRANSIENT
from mct.memory.watch import STRIDE as _WATCH_MARGIN, ResidentWatch

class Phase(Name):
    """Where a step is: what ``MemoryTracker.phase`` records peaks under (metric keys
    ``peak_<phase>_<category>``) and what the stage-3 lifecycle gathers for."""

    INIT = "init"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    EVAL = "eval"
    IDLE = "idle"


CATEGORIES = ("params", "master", "grads", "optimizer", "frozen", "activations", "offload", "other")
"""``frozen``: frozen parameters' stored shards and their gathered units (``mct.zero.frozen``).
``offload``: the reusable buffers through which offloaded state streams (resident).
Bytes parked in host memory or on disk are not live here: see ``offloaded()``."""

# What an op's return does to memory, from its schema's alias annotation.
_VIEW, _MUTATE, _ALLOC = 0, 1, 2
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def format_bytes(n: float) -> str:
    """Bytes -> '512 B', '1.50 KiB', '2.00 MiB', '3.25 GiB', '1.20 TiB' (the one byte
    formatter of mct: tables, warnings, errors and reports alike)."""
    n = int(n) if float(n).is_integer() else n
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


class MemoryBudgetExceeded(RuntimeError):
    """Live bytes passed the budget.

    Attributes: ``phase`` (innermost active phase, or '(no phase)'), ``live`` (bytes by
    category plus 'total' at the moment of the crossing), ``budget`` (bytes) and
    ``suggestion`` (what to change; '' when none was given).
    """

    def __init__(self, phase: str, live: dict[str, int], budget: int, suggestion: str = "",
                 resident: int | None = None, figure: str = "") -> None:
        self.phase, self.live, self.budget, self.suggestion = phase, dict(live), budget, suggestion
        self.resident, self.figure = resident, figure
        parts = ", ".join(f"{c} {format_bytes(live.get(c, 0))}" for c in CATEGORIES)
        if resident is None:
            msg = (f"memory budget exceeded in phase '{phase}': live {format_bytes(live['total'])} "
                   f"> budget {format_bytes(budget)} ({budget} bytes); by category: {parts}")
        else:  # the process's figure (mct.memory.watch): the budget counts the process
            msg = (f"memory budget exceeded in phase '{phase}': {figure or 'the process'} {format_bytes(resident)} "
                   f"is within {format_bytes(_WATCH_MARGIN)} of budget {format_bytes(budget)} ({budget} bytes; "
                   f"memory.budget counts the process, memory.budget_counts = 'process'); live tensors "
                   f"{format_bytes(live['total'])}, by category: {parts}")
        super().__init__(msg + (f". Suggestion: {suggestion}" if suggestion else ""))

    def __reduce__(self):  # multi-rank tests send exceptions between processes
        return (type(self), (self.phase, self.live, self.budget, self.suggestion, self.resident, self.figure))


class _Record:
    """One tracked storage: its counted bytes, category and the weakref that frees it."""

    __slots__ = ("nbytes", "category", "ref")

    def __init__(self, nbytes: int, category: str, ref: weakref.ref) -> None:
        self.nbytes, self.category, self.ref = nbytes, category, ref


def _on_storage_freed(tracker_ref: weakref.ref, key: int, ref: weakref.ref,
                      _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
    # Runs inside the storage's deallocation, possibly at interpreter shutdown when
    # module globals are gone: touch nothing but the arguments.
    if _finalizing():
        return
    tracker = tracker_ref()
    if tracker is not None:
        tracker._forget(key, ref)


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """Untyped storages behind ``t`` (inner tensors of wrapper subclasses included).

    Tensors without a storage (sparse, some functional wrappers) give none.
    """
    if type(t) not in _PLAIN_TENSOR_TYPES and is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        inner = (getattr(t, a) for a in attrs)
        return [s for x in inner if isinstance(x, torch.Tensor) for s in _storages(x)]
    try:
        return [t.untyped_storage()]
    except Exception:  # sparse/nested layouts raise a variety of types: no storage to count
        return []


_PRIM_DEVICE = torch.ops.prim.device.default


class _CountingMode(TorchDispatchMode):
    """Forwards every op, then hands its outputs to the tracker. Not wrapped for dynamo:
    see ``_DynamoSafeCountingMode``."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode.__init_subclass__ wraps a subclass's __torch_dispatch__ in
        # torch._disable_dynamo when this says True (its default), and that wrapper imports
        # torch._dynamo (about 70 MiB resident) on the first op, in a run that never
        # compiles. False leaves the method as written; the wrapped twin below is used when
        # torch._dynamo is already loaded (``_counting_mode``), so a user who compiles gets
        # today's behaviour: dynamo skips the tracker's frames instead of tracing them.
        return False

    def __init__(self, tracker: MemoryTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _PRIM_DEVICE:  # asked ~10 times per autograd node; allocates nothing
            fake_mode = getattr(args[0], "fake_mode", None)  # a FakeTensor: its device, as FakeTensor answers
            if fake_mode is not None and not fake_mode.in_kernel_invocation:
                return args[0].fake_device
            return func(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        self.tracker._on_op(func, out, (args, kwargs))
        return out


class _DynamoSafeCountingMode(_CountingMode):
    """``_CountingMode`` with ``__torch_dispatch__`` wrapped in ``torch._disable_dynamo``,
    as torch wraps every dispatch mode's (the wrapper imports torch._dynamo on first use)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return True

    __torch_dispatch__ = _CountingMode.__torch_dispatch__


def _counting_mode(tracker: MemoryTracker) -> _CountingMode:
    """The counting mode for ``tracker``: dynamo-safe where ``torch._dynamo`` is loaded
    (something in this process may compile), the plain one otherwise (nothing can)."""
    return (_DynamoSafeCountingMode if "torch._dynamo" in sys.modules else _CountingMode)(tracker)


class MemoryTracker:
    """Counts live tensor bytes by category (``CATEGORIES``) and the peak per phase.

    ``device``: 'cpu' (exact, dispatch-level) or 'cuda[:i]' (``torch.cuda`` stats).
    ``enabled=False`` gives a no-op with the same API: no dispatch mode, all counts 0.
    ``budget_bytes``: raise ``MemoryBudgetExceeded`` as soon as total live bytes pass it
    (CPU: at the allocation; CUDA: at register/refresh, and by its peak at phase exit).
    ``suggestion``: called when the budget is exceeded; its text joins the message.
    ``count_fake``: also count meta storages (FakeTensors of ``FakeTensorMode``): the
    planner measures a step on fake tensors this way, allocating nothing.
    ``watch``: the process's figure against the budget too (``mct.memory.watch``: read every
    stride of new storage, at each phase's start and with ``require_headroom``).
    Raises ValueError on an unsupported device or a non-positive budget.
    """

    def __init__(self, device: torch.device | str = "cpu", *, enabled: bool = True,
                 budget_bytes: int | None = None, suggestion: Callable[[], str] | None = None,
                 count_fake: bool = False, watch: ResidentWatch | None = None) -> None:
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"MemoryTracker device must be 'cpu' or 'cuda', got {str(self.device)!r}; "
                             "track another device with enabled=False")
        if budget_bytes is not None and budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive or None, got {budget_bytes!r}")
        self.enabled = enabled
        self.budget_bytes = budget_bytes
        self.suggestion = suggestion
        self.count_fake = count_fake
        self.watch = watch if enabled else None
        self._cuda = self.device.type == "cuda"
        self._records: dict[int, _Record] = {}   # id(storage) -> record; ids stay valid while alive
        self._bytes = dict.fromkeys(CATEGORIES, 0)
        self._total = 0
        self._peak = 0                          # max total since reset_peaks()
        self._peaks: dict[str, dict[str, int]] = {}
        self._phase_stack: list[str] = []
        self._category_stack: list[str] = []
        self._watermark = 0                     # lowest peak among global + active phases
        self._depth = 0                         # nesting of phase()/category(): the mode's owner
        self._paused = False                    # inside uncounted(): no per-op counting, no phase peaks
        self._mode: _CountingMode | None = None
        self._op_kinds: dict = {}               # OpOverload -> tuple of _VIEW/_MUTATE/_ALLOC
        self._self_ref = weakref.ref(self)
        self._offloaded: dict[str, dict[str, int]] = {}
        self._churn: dict[str, int] = {}        # phase -> most TRANSIENT bytes made in one entry
        self._churn_now: dict[str, int] = {}    # entered phase -> TRANSIENT bytes made in this entry
        if self._cuda and enabled:
            torch.cuda.init()   # the allocator's statistics exist from CUDA's (lazy) start: a fresh
            self.reset_peaks()  # process may build its engine first; the device's peak predates this tracker

    # -- public API ---------------------------------------------------------------

    def register_all(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        """``register`` each of ``tensors`` under ``category``."""
        for t in tensors:
            self.register(t, category)

    def register(self, tensor: torch.Tensor, category: str) -> None:
        """Count ``tensor``'s storage under ``category`` from now on.

        Adds the storage if untracked, moves it if tracked under another category.
        Storages on another device type, or with symbolic size, are skipped.
        Raises ValueError on an unknown category, MemoryBudgetExceeded if adding it
        crosses the budget (it stays registered).
        """
        _check_category(category)
        if not self.enabled:
            return
        for st in _storages(tensor):
            rec = self._records.get(id(st))
            if rec is None:
                self._add_storage(st, category)
            elif rec.category != category:
                self._bytes[rec.category] -= rec.nbytes
                self._bytes[category] += rec.nbytes
                rec.category = category

    def unregister(self, tensor: torch.Tensor) -> None:
        """Stop counting ``tensor``'s storage (no-op if untracked). Never raises."""
        if not self.enabled:
            return
        for st in _storages(tensor):
            rec = self._records.pop(id(st), None)
            if rec is not None:
                self._bytes[rec.category] -= rec.nbytes
                self._total -= rec.nbytes

    def refresh(self, tensor: torch.Tensor) -> None:
        """Re-read the size of ``tensor``'s tracked storage after ``untyped_storage().resize_``.

        Untracked storages are ignored. Raises MemoryBudgetExceeded if growth crosses
        the budget.
        """
        if not self.enabled:
            return
        for st in _storages(tensor):
            rec = self._records.get(id(st))
            if rec is not None:
                self._set_nbytes(rec, st.nbytes())

    def set_offloaded(self, tier: str, nbytes: int, source: str = "state") -> None:
        """Record the bytes of training state parked outside this device's live memory:
        tier 'cpu' (host memory of a CUDA run, or a host tier on CPU) or 'disk'. They
        count in no category and not in 'total'. ``source`` keeps owners apart (the
        offloaded optimizer state, checkpointing's parked 'activations'): each sets its
        own bytes, ``offloaded()`` sums them. Raises ValueError on another tier."""
        if tier not in ("cpu", "disk"):
            raise ValueError(f"offload tier must be 'cpu' or 'disk', got {tier!r}")
        self._offloaded.setdefault(source, {"cpu": 0, "disk": 0})[tier] = int(nbytes)

    def offloaded(self, source: str | None = None) -> dict[str, int]:
        """Bytes held in each offload tier ({'cpu': n, 'disk': n}, a new dict): of every
        source, or of ``source`` alone."""
        sources = self._offloaded.values() if source is None else [self._offloaded.get(source, {})]
        return {tier: sum(s.get(tier, 0) for s in sources) for tier in ("cpu", "disk")}

    def require_headroom(self, nbytes: int) -> None:
        """Raise MemoryBudgetExceeded now if live bytes plus ``nbytes`` would pass the
        budget: a step about to allocate that much checks before it modifies anything.
        The exception's 'total' is the projected bytes. No-op without a budget."""
        if not self.enabled or self.budget_bytes is None:
            return
        snap = self._snapshot()
        if snap["total"] + nbytes > self.budget_bytes:
            self._check_budget({**snap, "total": snap["total"] + nbytes})
        self._check_resident(extra=nbytes, force=True)

    @property
    def counting(self) -> bool:
        """Are phases counting allocations now (enabled, and not inside ``uncounted()``)?"""
        return self.enabled and not self._paused

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Within: ``phase()`` and ``category()`` count nothing (no dispatch mode, so ops
        run at full speed) and record no peaks, so ``peaks()`` has no entry for them.
        What is registered (``register``/``unregister``/``refresh``) stays counted, and
        storages counted before are still subtracted when freed, so ``live()`` stays
        exact for all but what is allocated inside and kept past it: use it around work
        whose allocations are transient (a training step whose peaks nobody reads).
        A no-op with a budget (checked at every allocation) and on CUDA (its counters
        cost no per-op work). Enter it outside every phase."""
        if self._paused or self.budget_bytes is not None or self._cuda or not self.enabled:
            yield
            return
        assert self._depth == 0, "uncounted() is entered outside every phase and category"
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    @contextmanager
    def phase(self, name: str, category: str = "activations") -> Iterator[None]:
        """Record the peak of total live bytes while inside, under ``name``.

        New storages default to ``category``. Re-entering a name keeps the max until
        ``reset_peaks()``; nested phases' peaks count toward every enclosing phase.
        Raises ValueError on an unknown category.
        """
        _check_category(category)
        if not self.enabled:
            self._peaks.setdefault(name, dict.fromkeys(CATEGORIES + ("total",), 0))
            yield
            return
        if self._paused:
            yield
            return
        if self._cuda:
            self._fold_cuda_peak()  # reset below would lose the enclosing phases' peak
            torch.cuda.reset_peak_memory_stats(self.device)
        outermost = name not in self._phase_stack
        if outermost:
            self._churn_now[name] = 0
        self._phase_stack.append(name)
        self._check_resident(force=True)
        self._raise_peak(name, self._snapshot())
        # The new phase's peak starts at today's live bytes, likely below the global
        # peak: lower the watermark, or growth inside this phase would go unrecorded.
        self._watermark = self._lowest_peak()
        try:
            with self.category(category):
                yield
            if self._cuda:  # no per-allocation hook on CUDA: judge the phase by its peak
                self._check_budget(self._fold_cuda_peak())
                self._check_resident(force=True)
        finally:
            if self._cuda:
                self._fold_cuda_peak()
            self._phase_stack.pop()
            if outermost:
                self._churn[name] = max(self._churn.get(name, 0), self._churn_now.pop(name, 0))
            self._watermark = self._lowest_peak()

    @contextmanager
    def category(self, name: str) -> Iterator[None]:
        """New storages made inside count under ``name`` (nestable; innermost wins).

        On CPU this also turns counting on, so it can be used outside any phase
        (e.g. around ``optimizer.step()``). On CUDA it changes nothing: unregistered
        bytes are all "activations". Raises ValueError on an unknown category.
        """
        _check_category(name)
        if not self.enabled or self._paused:
            yield
            return
        self._category_stack.append(name)
        self._enter_mode()
        try:
            yield
        finally:
            self._exit_mode()
            self._category_stack.pop()

    def live(self) -> dict[str, int]:
        """Current bytes per category plus 'total' (a new dict)."""
        if not self.enabled:
            return dict.fromkeys(CATEGORIES + ("total",), 0)
        return self._snapshot()

    def peaks(self) -> dict[str, dict[str, int]]:
        """{phase: {'total': bytes, <category>: bytes at that peak}} since reset_peaks()."""
        if self._cuda and self.enabled and self._phase_stack:
            self._fold_cuda_peak()
        return {name: dict(snap) for name, snap in self._peaks.items()}

    def churn(self) -> dict[str, int]:
        """{phase: bytes}: the most bytes of new ``TRANSIENT`` storages made within one entry
        of that phase since ``reset_churn()``, live at its peak or not: what the allocator
        serves and takes back there (a recomputing forward makes the activations a forward
        without recompute keeps, and frees them). CPU only (on CUDA no op is seen: {})."""
        return dict(self._churn)

    def reset_churn(self) -> None:
        """Start a new step's ``churn()`` (an entry in progress counts from now). Kept apart
        from ``reset_peaks()``, which the depth extrapolation calls between blocks."""
        self._churn = {}
        self._churn_now = dict.fromkeys(self._churn_now, 0)

    @property
    def current_phase(self) -> str | None:
        """The innermost phase now entered (None outside every phase)."""
        return self._phase_stack[-1] if self._phase_stack else None

    def peak_total(self) -> int:
        """Max total live bytes since reset_peaks() (0 when disabled)."""
        if self._cuda and self.enabled:
            self._fold_cuda_peak()
        return self._peak

    def reset_peaks(self) -> None:
        """Start a new step: forget phase peaks; all peaks restart from current live bytes."""
        self._peaks = {}
        if not self.enabled:
            return
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        snap = self._snapshot()
        self._peak = snap["total"]
        for name in self._phase_stack:
            self._peaks[name] = snap
        self._watermark = self._lowest_peak()

    # -- dispatch-mode side (CPU) -------------------------------------------------

    def _enter_mode(self) -> None:
        self._depth += 1
        if self._depth == 1 and not self._cuda:
            self._mode = _counting_mode(self)
            self._mode.__enter__()

    def _exit_mode(self) -> None:
        self._depth -= 1
        if self._depth == 0 and self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    def _on_op(self, func, out, inputs: tuple) -> None:
        kinds = self._op_kinds.get(func)
        if kinds is None:
            kinds = self._op_kinds[func] = _return_kinds(func)
        if len(kinds) == 1:
            if kinds[0] != _VIEW:
                self._visit(out, kinds[0], inputs)
        elif isinstance(out, (tuple, list)) and len(out) == len(kinds):
            for o, kind in zip(out, kinds):
                if kind != _VIEW:
                    self._visit(o, kind, inputs)

    def _visit(self, out, kind: int, inputs: tuple) -> None:
        if isinstance(out, torch.Tensor):
            sts = _storages(out)
            if type(out) not in _PLAIN_TENSOR_TYPES and kind == _ALLOC:
                # A wrapper subclass (e.g. a jagged nested tensor) may reuse an input's
                # inner tensor, such as its offsets: that is not a new allocation.
                seen = {id(s) for x in tree_leaves(inputs) if isinstance(x, torch.Tensor)
                        for s in _storages(x)}
                sts = [s for s in sts if id(s) not in seen]
            for st in sts:
                rec = self._records.get(id(st))
                if rec is None:
                    if kind == _ALLOC:
                        self._add_storage(st, self._category_stack[-1])
                elif kind == _MUTATE:  # aten.resize_ / out= may grow a tracked storage
                    self._set_nbytes(rec, st.nbytes())
        elif isinstance(out, (tuple, list)):
            for o in out:
                self._visit(o, kind, inputs)

    # -- bookkeeping --------------------------------------------------------------

    def _add_storage(self, st: torch.UntypedStorage, category: str) -> None:
        # Meta and fake tensors have meta storages: nothing is allocated.
        if st.device.type != self.device.type and not (self.count_fake and st.device.type == "meta"):
            return
        n = st.nbytes()
        if type(n) is not int:  # symbolic sizes (tracing) are not bytes
            return
        key = id(st)
        self._records[key] = _Record(n, category, weakref.ref(st, partial(_on_storage_freed, self._self_ref, key)))
        self._bytes[category] += n
        self._total += n
        if category in TRANSIENT:
            for name in self._churn_now:
                self._churn_now[name] += n
        self._after_growth()
        if self.watch is not None:
            self._check_resident(n)

    def _set_nbytes(self, rec: _Record, n: int) -> None:
        delta = n - rec.nbytes
        if delta:
            rec.nbytes = n
            self._bytes[rec.category] += delta
            self._total += delta
            if delta > 0:
                self._after_growth()

    def _forget(self, key: int, ref: weakref.ref) -> None:
        rec = self._records.get(key)
        if rec is not None and rec.ref is ref:
            del self._records[key]
            self._bytes[rec.category] -= rec.nbytes
            self._total -= rec.nbytes

    def _after_growth(self) -> None:
        if self._cuda:
            self._check_budget(self._snapshot())
            return
        if self._total > self._watermark:
            snap = self._snapshot()
            self._peak = max(self._peak, snap["total"])
            for name in self._phase_stack:
                self._raise_peak(name, snap)
            self._watermark = self._lowest_peak()
        if self.budget_bytes is not None and self._total > self.budget_bytes:
            self._check_budget(self._snapshot())

    def _raise_peak(self, name: str, snap: dict[str, int]) -> None:
        old = self._peaks.get(name)
        if old is None or snap["total"] > old["total"]:
            self._peaks[name] = snap  # snapshots are never mutated, so sharing is safe
        self._peak = max(self._peak, snap["total"])

    def _lowest_peak(self) -> int:
        return min([self._peak] + [self._peaks[n]["total"] for n in self._phase_stack])

    def _check_budget(self, snap: dict[str, int]) -> None:
        if self.budget_bytes is None or snap["total"] <= self.budget_bytes:
            return
        phase = self._phase_stack[-1] if self._phase_stack else "(no phase)"
        hint = self.suggestion() if self.suggestion is not None else ""
        raise MemoryBudgetExceeded(phase, snap, self.budget_bytes, hint)

    def _check_resident(self, nbytes: int = 0, extra: int = 0, *, force: bool = False) -> None:
        """Raise MemoryBudgetExceeded when the watch finds the process's figure (plus ``extra``)
        within its margin of the budget (``mct.memory.watch``); no-op without a watch."""
        if self.watch is None:
            return
        figure = self.watch.check(nbytes, extra, force=force)
        if figure is not None:
            phase = self._phase_stack[-1] if self._phase_stack else "(no phase)"
            hint = self.suggestion() if self.suggestion is not None else ""
            raise MemoryBudgetExceeded(phase, self._snapshot(), self.watch.budget, hint, figure,
                                       self.watch.figure_name)

    def _snapshot(self, allocated: int | None = None) -> dict[str, int]:
        """Bytes by category plus 'total'. CUDA: unregistered allocated bytes are activations."""
        snap = dict(self._bytes)
        if self._cuda:
            if allocated is None:
                allocated = torch.cuda.memory_allocated(self.device)
            snap["activations"] += max(0, allocated - self._total)
        snap["total"] = sum(snap[c] for c in CATEGORIES)
        return snap

    def _fold_cuda_peak(self) -> dict[str, int]:
        # max_memory_allocated covers the time since the last reset, which is at most
        # the start of the innermost phase: credit it to every active phase.
        snap = self._snapshot(torch.cuda.max_memory_allocated(self.device))
        for name in self._phase_stack:
            self._raise_peak(name, snap)
        self._peak = max(self._peak, snap["total"])
        return snap


def _check_category(category: str) -> None:
    if category not in CATEGORIES:
        raise ValueError(f"unknown memory category {category!r}; use one of {CATEGORIES}")


def _return_kinds(func) -> tuple[int, ...]:
    """Per return of ``func``: a view of an input, a mutated input, or fresh memory."""
    schema = getattr(func, "_schema", None)
    if schema is None:  # not an ATen overload: assume its outputs are new
        return (_ALLOC,)
    if schema.name in ("aten::lift_fresh",):
        # torch.tensor(...) allocates outside dispatch, then lifts the fresh tensor
        # through this aliasing op: it is the first time the storage is seen.
        return (_ALLOC,)
    kinds = []
    for ret in schema.returns:
        info = ret.alias_info
        kinds.append(_ALLOC if info is None else _MUTATE if info.is_write else _VIEW)
    return tuple(kinds) or (_VIEW,)
