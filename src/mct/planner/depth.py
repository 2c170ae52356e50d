"""Depth extrapolation: the dry run of a deep model from dry runs of two shallow copies.

A transformer is a stack of identical blocks (the children of one ``nn.ModuleList``:
the built-in GPT's ``blocks``, a Hugging Face decoder's ``layers``). Every byte a step
holds is either independent of the depth (embeddings, head, loss, the root unit) or
repeats with the period of the checkpointing plan: one block for none/all/selective,
``k`` blocks for every_k, one segment of ``ceil(sqrt(n))`` blocks for sqrt. So the
engine runs (on fake tensors, as ``dry_run``) on a copy with the first ``a`` blocks and
on one with the first ``a + p`` blocks, and every number of the ``n``-block model (each
window of each step's phases, by category (``Windows``); initialization; offloaded
bytes) is ``A + m (B - A)`` with ``m = (n - a) / p``. The engine's code is what runs;
only the depth is shortened. Exact where the block stack repeats (tested against full
dry runs, to the byte; docs/planner.md).

``sqrt`` plans its segments from the depth, so a shallow copy would get other
segments: its copies hold the full model's segments as modules of their own (``PlannerSegment``,
checkpointed with policy 'all'), the blocks inside them stay the ZeRO units.

A mixed stack (``checkpointing.per_block``) repeats within each run of blocks with one
choice, not as a whole: one smaller copy and one larger copy per long run, every number
``A + sum_g m_g (B_g - A)`` (``mct.planner.mixed``).

A model is extrapolated only when that is sound: its blocks are the children of one
ModuleList, identical in class, parameter and buffer names, shapes, dtypes and
requires_grad, share no parameter with each other or the rest of the model, their class
occurs nowhere else, and a no-grad forward of a 4-block copy on fake tensors runs and
calls each block equally often (a model that re-uses a block gets a full dry run).
Anything else: a full dry run.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from mct.checkpointing import block_choices, find_blocks
from mct.checkpointing.blocks import first_tensor, primary
from mct.config import EngineConfig, with_values
from mct.memory.tracker import CATEGORIES
from mct.planner.dry_run import (STEP_PHASES, DryRun, DryRunHooks, dry_run_task, fake_batch, materialize_fake,
                                 meta_model)
from mct.planner.mixed import CUT, MixedShape, mixed_shape
from mct.task.spec import Task

SEGMENT = "PlannerSegment"


@dataclass(frozen=True)
class Stack:
    """The repeated blocks of a model: the ModuleList at ``path`` (a qualified name,
    '' for the model itself) holds ``n`` identical blocks of class ``block_class``.
    ``model``: the model on the meta device, built once: shallow copies are cut from it."""

    path: str
    n: int
    block_class: str
    model: nn.Module = field(compare=False, repr=False, default_factory=nn.Module)


@dataclass(frozen=True)
class Prepared:
    """What every configuration of a plan shares about its ``task``, found once
    (``mct.planner.grid.prepare_work``): the model's repeated blocks (``stack``), its
    parameter count, and the peak of building it as its factory does
    (``construction``, see ``dry_run.construction_peak``; None: built on meta)."""

    task: Task
    stack: Stack
    n_params: int
    construction: dict[str, int] | None


@dataclass(frozen=True)
class Shape:
    """How a configuration's dry run is extrapolated: copies with ``a`` and ``a + p``
    blocks (``segments``: for sqrt, the block counts of each copy's segments), and
    ``m`` periods added to the first to reach the full depth."""

    a: int
    p: int
    m: int
    segments: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    @property
    def blocks(self) -> int:
        """Blocks the copies' dry runs step through, together."""
        return 2 * self.a + self.p


class PlannerSegment(nn.Module):
    """Consecutive blocks called one after the other, with the arguments the model
    gives the first (the chained value replaced by each block's output, as the
    model's own loop does): the unit of a sqrt checkpoint region in a shallow copy."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        for i, b in enumerate(blocks):
            self.add_module(str(i), b)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = None
        for block in self.children():
            out = block(*args, **kwargs)
            nxt = out if isinstance(out, torch.Tensor) else primary(out)
            if args:
                args = (nxt, *args[1:])
            else:
                kwargs = {**kwargs, next(iter(kwargs)): nxt}
        return out



def find_stack(work: Task, cfg: EngineConfig) -> Stack | None:
    """The model's repeated blocks when depth extrapolation is sound for it (module
    docstring), else None. Builds the model on the meta device and runs one forward of a
    4-block copy on fake tensors (nothing allocated). Raises ValueError for a factory
    that gives no module."""
    model = meta_model(work.model_fn)
    names = cfg.zero.units or cfg.checkpointing.blocks
    if cfg.zero.units and cfg.checkpointing.blocks and cfg.zero.units != cfg.checkpointing.blocks:
        return None  # units and regions from different modules: no common period
    try:
        blocks = find_blocks(model, names)
    except ValueError:
        return None
    if len(blocks) < 3:
        return None
    path = blocks[0][0].rpartition(".")[0]
    holder = model.get_submodule(path) if path else model
    if not isinstance(holder, nn.ModuleList) or [m for _, m in blocks] != list(holder):
        return None
    cls = type(blocks[0][1])
    if len({_signature(m) for _, m in blocks}) != 1 or len({id(m) for _, m in blocks}) != len(blocks):
        return None
    if sum(type(m) is cls for m in model.modules()) != len(blocks) or _shares_parameters(model, holder):
        return None
    stack = Stack(path, len(blocks), cls.__name__, model)
    # the copies' forward, once: a model that re-uses a block, or cannot run cut, is not extrapolated
    probe = shallow(stack, min(4, stack.n), None)()
    kept = list(probe.get_submodule(path) if path else probe)
    return stack if _called_equally(probe, kept, work) else None


def _signature(block: nn.Module) -> tuple:
    tensors = [*block.named_parameters(remove_duplicate=False), *block.named_buffers(remove_duplicate=False)]
    return (type(block).__name__,
            tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in tensors))


def _shares_parameters(model: nn.Module, holder: nn.ModuleList) -> bool:
    """A tensor held by two blocks, or by a block and the rest of the model."""
    owner: dict[int, int] = {}
    for i, block in enumerate(holder):
        for t in (*block.parameters(), *block.buffers()):
            if owner.setdefault(id(t), i) != i:
                return True
    inside = {id(m) for b in holder for m in b.modules()}
    return any(id(t) in owner for mod in model.modules() if id(mod) not in inside
               for t in (*mod.parameters(recurse=False), *mod.buffers(recurse=False)))


def _called_equally(model: nn.Module, blocks: list[nn.Module], work: Task) -> bool:
    """One no-grad forward of ``work``'s loss on fake tensors (``model`` is made fake in
    place): does it call every block equally often (and at least once)? False also when
    the loss cannot run on fake tensors (it reads values)."""
    calls = [0] * len(blocks)
    hooks = [b.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
             for i, b in enumerate(blocks)]
    batch = work.batch[0] if isinstance(work.batch, list) else work.batch
    mode = FakeTensorMode()
    try:
        with mode, torch.no_grad():
            materialize_fake(model)
            work.loss_fn(model, fake_batch(batch, mode))
    except Exception:  # noqa: BLE001 - a loss that needs values: no extrapolation, a full dry run
        return False
    finally:
        for h in hooks:
            h.remove()
    return calls[0] > 0 and len(set(calls)) == 1


def shape_for(stack: Stack, cfg: EngineConfig, cheaper_only: bool = True) -> Shape | MixedShape | None:
    """The shallow copies for ``cfg``'s checkpointing policy (a mixed ``per_block``: a
    ``MixedShape``; raises ValueError as ``block_choices``), or None when dry-running
    both would cost no fewer blocks than the model itself (a full dry run then costs no
    more; sqrt's copies hold about 5 sqrt(n) blocks, so it gains from about 40;
    ``cheaper_only=False`` keeps them anyway, as long as they are shallower). The smaller copy
    holds a first, a middle and a last period (blocks next to the stack's ends run
    differently: stage 3 prefetches a neighbour; the first and last segment differ),
    the larger one a middle period more; the full model has ``m`` more than the
    smaller copy."""
    n, policy = stack.n, cfg.checkpointing.policy
    if policy == "per_block":
        choices = block_choices(cfg.checkpointing, n)
        assert choices is not None
        if len(set(choices)) > 1:
            return mixed_shape(n, choices, cheaper_only)
        policy = choices[0]  # one choice for every block: the uniform policy's copies (``copy_config``)
    if policy == "sqrt":
        p = math.ceil(math.sqrt(n))
        r = n - p * ((n - 1) // p)  # the last segment (1..p blocks); the others hold p each
        m = (n - p - r) // p - 1
        cheaper = 2 * (2 * p + r) + p < n or not cheaper_only  # ~5 sqrt(n) blocks dry-run: deep models only
        return Shape(2 * p + r, p, m, ((p, p, r), (p, p, p, r))) if m >= 2 and cheaper else None
    if policy in ("none", "all", "selective"):
        p = 1
    elif policy == "every_k":
        p = cfg.checkpointing.k  # regions at blocks 0, k, 2k, ...: a copy of whole periods keeps them
    else:
        return None
    a = 3 * p + n % p
    m = (n - a) // p
    return Shape(a, p, m) if m >= 2 and (2 * a + p < n or not cheaper_only) else None


def shallow(stack: Stack, depth: int, segments: tuple[int, ...] | None) -> Callable[[], nn.Module]:
    """``build`` for ``dry_run``: a deep copy of ``stack.model`` (meta) with only its first
    ``depth`` blocks, grouped into ``PlannerSegment``s of the given sizes when
    ``segments`` is set. The built model is left as it was."""
    def build() -> nn.Module:
        model = stack.model
        full = model.get_submodule(stack.path) if stack.path else model
        assert isinstance(full, nn.ModuleList) and len(full) == stack.n, (stack, type(full))
        kept = list(full)[:depth]
        if segments is not None:
            starts = [sum(segments[:i]) for i in range(len(segments))]
            kept = [PlannerSegment(kept[s:s + size]) for s, size in zip(starts, segments)]
        cut = nn.ModuleList(kept)
        if not stack.path:
            return copy.deepcopy(cut)
        parent, _, name = stack.path.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, name, cut)  # copied with the cut stack, then the full one put back
        try:
            return copy.deepcopy(model)
        finally:
            setattr(owner, name, full)
    return build


def copy_config(cfg: EngineConfig, stack: Stack, shape: Shape | MixedShape, longer: int | None = None
                ) -> EngineConfig:
    """The config a shallow copy runs: ``cfg`` itself; for sqrt segments each
    checkpointed whole (policy 'all' over ``PlannerSegment``s) with the blocks as ZeRO units;
    for a ``per_block`` config the copy's own choices (a ``MixedShape``'s, with run
    ``longer`` one block longer), or with every block alike that uniform policy."""
    if cfg.checkpointing.policy == "per_block":
        full = block_choices(cfg.checkpointing, stack.n)
        assert full is not None
        choices = shape.choices(longer) if isinstance(shape, MixedShape) else full[:1]
        uniform = len(set(choices)) == 1
        return with_values(cfg, {"checkpointing.policy": choices[0] if uniform else "per_block",
                                 "checkpointing.per_block": [] if uniform else list(choices)})
    if not isinstance(shape, Shape) or shape.segments is None:
        return cfg
    return with_values(cfg, {"checkpointing.policy": "all", "checkpointing.blocks": [SEGMENT],
                             "zero.units": [stack.block_class]})


PHASES = STEP_PHASES
Label = tuple  # (phase, block index or 'head', occurrence)


class Windows:
    """Peaks of a dry run's steps in windows between block events: a block's forward
    starts (also when backward recomputes it), a gradient reaches a block's output or the
    first block's input.
    A phase's peak is the largest of its windows; extrapolating each window on its own
    keeps the full depth's peak where it is even when another moment of the phase grows
    faster with depth (stage 1's reduction at the end of backward against the
    activations at its start). ``steps``: per step, {(phase, block, n): bytes by
    category and 'total'}, with block 'head' for the window before a phase's first event.
    Uses the tracker's phase peaks, resetting them at every event."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.steps: list[dict[Label, dict[str, int]]] = [{}]
        self._label: Label | None = None
        self._seen: dict[tuple, int] = {}
        self.tracker: Any = None

    def attach(self, model: nn.Module, tracker: Any) -> None:
        """Hook every block of the (shallow) stack of ``model``; mutates the blocks' hooks."""
        self.tracker = tracker
        holder = model.get_submodule(self.stack.path) if self.stack.path else model
        blocks = [b for item in holder for b in (list(item.children()) if isinstance(item, PlannerSegment) else [item])]
        for k, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda _m, args, kwargs, k=k: self._enter(args, kwargs, k),
                                            with_kwargs=True)
            block.register_forward_hook(lambda _m, _a, out, k=k: self._watch_grads(out, k))

    def _enter(self, args: tuple, kwargs: dict, k: int) -> None:
        """A block's forward starts. The gradient reaching the first block's input ends
        the stack's backward: what follows (the reductions) is a window of its own. (Other
        blocks' inputs are their predecessors' outputs, already watched: a second hook
        there would start a window labelled with the wrong block.)"""
        self._event(k)
        x = first_tensor((args, kwargs)) if k == 0 else None
        if x is not None:
            self._watch_grads(x, k)

    def _watch_grads(self, out: Any, k: int) -> None:
        if torch.is_grad_enabled():
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda _g, k=k: self._event(k))

    def _next(self, key: tuple) -> int:
        self._seen[key] = self._seen.get(key, 0) + 1
        return self._seen[key]

    def _close(self, peaks: dict[str, dict[str, int]], phase: str | None) -> None:
        """Record the window ending now (and the head of ``phase`` if it began since)."""
        step = self.steps[-1]
        if self._label is not None and self._label[0] in peaks:
            step[self._label] = dict(peaks[self._label[0]])
        begun = [ph for ph in PHASES if ph in peaks and (self._label is None or ph != self._label[0])]
        if phase is not None:  # an event: only its own phase can have begun since the last one
            begun = [phase] if phase in begun else []
        for ph in begun:
            step[(ph, "head", self._next((ph, "head")))] = dict(peaks[ph])

    def _event(self, k: int) -> None:
        phase = self.tracker.current_phase
        if phase not in PHASES:
            return
        self._close(self.tracker.peaks(), phase)
        self._label = (phase, k, self._next((phase, k)))
        self.tracker.reset_peaks()

    def end_step(self, peaks: dict[str, dict[str, int]]) -> None:
        """After a step: record its last windows and start the next step's."""
        self._close(peaks, None)
        self.steps.append({})
        self._label, self._seen = None, {}


def _mapped(k: int | str, shape: Shape) -> list[int | str]:
    """The blocks of the larger copy whose windows continue block ``k``'s of the smaller:
    the first period counted from the start, the last from the end, a middle one both
    ways (the full depth's peak sits at one end of its middle blocks)."""
    if k == "head":
        return [k]
    assert isinstance(k, int)
    return ([k] if k < 2 * shape.p else []) + ([k + shape.p] if k >= shape.p else [])


@dataclass
class Copy:
    """A larger copy's dry run, its windows, how many times its difference from the
    smaller copy's is added (``m``), and which of its blocks continue a block of the smaller
    copy (``mapped(k)``)."""

    run: DryRun
    windows: Windows
    m: int
    mapped: Callable[[int | str], list[int | str]]


def _extend_step(wa: dict[Label, dict[str, int]], larger: list[tuple[dict[Label, dict[str, int]], Copy]]
                 ) -> dict[str, dict[str, int]] | None:
    """Each phase's peak at the full depth: the largest extrapolated window. A window of
    the smaller copy continues in each larger copy (in one or, in a middle block of the
    period that grows there, two windows); each combination is a candidate."""
    out: dict[str, dict[str, int]] = {}
    for (phase, k, n), a in wa.items():
        options = []
        for wb, copy_ in larger:
            deltas = []
            for kb in copy_.mapped(k):
                b = wb.get((phase, kb, n))
                if b is None:
                    return None
                deltas.append({c: copy_.m * (b.get(c, 0) - v) for c, v in a.items()})
            options.append(deltas)
        for combo in itertools.product(*options):
            full = {c: v + sum(d[c] for d in combo) for c, v in a.items()}
            if phase not in out or full["total"] > out[phase]["total"]:
                out[phase] = full
    return out


def extend(a: DryRun, b: DryRun, wa: Windows, wb: Windows, shape: Shape, n_params: int) -> DryRun | None:
    """The dry run of the full depth: each window's bytes ``A + m (B - A)`` (the steps'
    phases), initialization and offloaded bytes likewise. None when a count would fall
    below zero or the copies' windows do not match (they do not repeat: the caller
    runs the full model)."""
    return extend_copies(a, wa, [Copy(b, wb, shape.m, lambda k: _mapped(k, shape))], n_params)


def extend_copies(a: DryRun, wa: Windows, copies: list[Copy], n_params: int) -> DryRun | None:
    """``extend`` from the smaller copy and any number of larger ones: every number
    ``A + sum_i m_i (B_i - A)`` (a mixed stack: one larger copy per grown run)."""
    def ext(x: int, get: Callable[[DryRun], dict[str, int]], key: str) -> int:
        return x + sum(c.m * (get(c.run).get(key, 0) - x) for c in copies)
    first, steady = (_extend_step(wa.steps[i], [(c.windows.steps[i], c) for c in copies]) for i in range(2))
    if first is None or steady is None or set(steady) != set(PHASES) or set(first) != set(PHASES):
        return None
    init = _extend_init(a, copies, ext)
    if init is None:
        return None
    offloaded = {t: ext(v, lambda r: r.offloaded, t) for t, v in a.offloaded.items()}
    churn = {p: ext(v, lambda r: r.churn, p) for p, v in a.churn.items()}
    before, steady_snapshot = (ext(a.snapshot[i], lambda r: dict(enumerate(r.snapshot)), i) for i in (0, 1))
    counts = [*init.values(), *offloaded.values(), *churn.values(), before, steady_snapshot,
              *(v for p in (steady, first) for d in p.values() for v in d.values())]
    if min(counts, default=0) < 0:
        return None
    work = None
    if a.work is not None and all(c.run.work is not None for c in copies):
        work = a.work.extend([(c.run.work, c.m) for c in copies])  # type: ignore[misc]
    worst = max(steady, key=lambda k: steady[k]["total"])
    return DryRun(peak=steady[worst]["total"], phase=worst, phases=steady,
                  first_step_peak=max(v["total"] for v in first.values()), first_step_phases=first,
                  init_peak=init["total"], init=init, n_params=n_params, offloaded=offloaded, churn=churn,
                  snapshot=(before, steady_snapshot), work=work,
                  init_end=(None if a.init_end is None else {c: ext(v, lambda r: r.init_end, c)
                                                            for c, v in a.init_end.items()}))


def _extend_init(a: DryRun, copies: list[Copy], ext: Callable) -> dict[str, int] | None:
    """The construction's peak at the full depth. It is the larger of an earlier moment's
    (a unit being built) and what the engine keeps at the end (``DryRun.init_end``: the
    shards, each growing with the depth). Each is extrapolated from the copies where the
    copies' peaks fall at the same kind of moment; a smaller copy peaking early and a
    larger one at the end means the end has overtaken it, and does so the more at the
    full depth. None where the copies disagree the other way (the caller runs the model
    whole)."""
    runs = [a, *(c.run for c in copies)]
    peak = {c: ext(v, lambda r: r.init, c) for c, v in a.init.items()}
    if any(r.init_end is None for r in runs):
        return peak
    end = {c: ext(v, lambda r: r.init_end, c) for c, v in a.init_end.items()}
    at_end = [r.init["total"] <= r.init_end["total"] for r in runs]
    if all(at_end) or (not at_end[0] and all(at_end[1:])):
        return end
    if not any(at_end):
        return peak if peak["total"] >= end["total"] else end
    return None


def extrapolated(prepared: Prepared, cfg: EngineConfig, world: int, batch: Any, *, meta_init: bool,
                 shape: Shape | MixedShape | None = None, micro_batches: int | None = None) -> DryRun | None:
    """``cfg``'s dry run of the ``stack.n``-block model of ``prepared`` from two shallow
    copies (see the module docstring), or None when the policy gives no shallower copy
    or the copies do not repeat. The initialization peak is the larger of the whole
    model's ``construction`` and the copies' extrapolated one, which start from a model
    built on meta. ``meta_init``, ``micro_batches``: as ``DryRunHooks``. ``shape``: the copies (default
    ``shape_for``). Raises ValueError as ``dry_run``."""
    stack, construction = prepared.stack, prepared.construction
    shape = shape or shape_for(stack, cfg)
    if shape is None:
        return None

    def copy_run(depth: int, segments: tuple[int, ...] | None, run_cfg: EngineConfig) -> tuple[DryRun, Windows]:
        w = Windows(stack)
        hooks = DryRunHooks(meta_init=meta_init, build=shallow(stack, depth, segments), observer=w,
                            micro_batches=micro_batches)
        return dry_run_task(prepared.task, run_cfg, world, batch=batch, hooks=hooks), w
    if isinstance(shape, MixedShape):
        mixed = shape
        a, wa = copy_run(sum(mixed.lengths()), None, copy_config(cfg, stack, mixed))
        copies = [Copy(*copy_run(sum(mixed.lengths(g)), None, copy_config(cfg, stack, mixed, g)),
                       mixed.runs[g][1] - CUT, lambda k, g=g: mixed.mapped(k, g)) for g in mixed.grown]
        run = extend_copies(a, wa, copies, prepared.n_params)
    else:
        run_cfg = copy_config(cfg, stack, shape)
        segments = shape.segments or (None, None)
        (a, wa), (b, wb) = (copy_run(depth, seg, run_cfg)
                            for depth, seg in ((shape.a, segments[0]), (shape.a + shape.p, segments[1])))
        run = extend(a, b, wa, wb, shape, prepared.n_params)
    if run is not None and not meta_init and construction is not None and construction["total"] > run.init_peak:
        run.init_peak = construction["total"]
        run.init = {c: construction.get(c, 0) for c in (*CATEGORIES, "total")}
    return run
