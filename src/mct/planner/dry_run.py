"""A dry run: the engine's own code on fake tensors, as rank 0 of an N-rank group.

The user's model is built inside ``FakeTensorMode`` (its constructor runs as usual, on
``FakeTensor``s: shapes and dtypes, no storage), or, when its constructor needs values,
on the ``meta`` device with its parameters and buffers then made fake (tied ones stay one
object). ``mct.Engine`` is constructed and steps twice on it under ``FakeTensorMode`` with a
simulated communicator (``DistContext.simulated``: collectives are shape-checked
no-ops, so every buffer, shard, temporary and in-flight gradient of the N-rank run is
allocated by the same code, on paper). The engine's memory tracker counts the fake
storages (``MemoryTracker(count_fake=True)``), so the prediction comes in the same
categories and phases a real run reports.

Nothing here knows how ZeRO, checkpointing or precision spend memory: that is the
engine's business. What a dry run cannot see is what the tracker cannot see in a real
run either (allocator caching, kernel workspaces), plus values: a fake step takes the
path of a clean step (no overflow skip).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch.utils._pytree import tree_map

from mct.config import EngineConfig, with_values
from mct.dist import DistContext
from mct.engine import Engine
from mct.memory.tracker import CATEGORIES, MemoryTracker
from mct.planner.work import OpCounter, StepWork, mode_counts
from mct.task import init_chunks
from mct.task.init_chunks import chunk_bounds
from mct.task.meta import build_on_meta
from mct.task.spec import LossFn, ModelFn, OptimizerFactory, ParamGroupsFn, Task


STEP_PHASES = ("forward", "backward", "optimizer")
"""The phases of a training step a dry run reports (``DryRun.phases``, ``DryRun.churn``)."""


@dataclass
class DryRun:
    """Per-rank bytes of one configuration, as the engine's tracker counts them.

    ``peak``: the steady-state step (the second; optimizer state exists from its start).
    ``phases``: that step's peak per phase (forward/backward/optimizer), each a dict
    ``{category: bytes, 'total': bytes}`` at the phase's peak. ``first_step_peak`` /
    ``first_step_phases``: the same for the first step (it creates the optimizer state
    inside its optimizer phase). ``init_peak`` / ``init``: building the model in its own
    dtype and the engine's flat buffers from it (the user's model lives until the engine
    has copied it). ``n_params``: the model's parameters, tied ones counted once.
    """

    peak: int
    phase: str
    phases: dict[str, dict[str, int]]
    first_step_peak: int
    first_step_phases: dict[str, dict[str, int]]
    init_peak: int
    init: dict[str, int]
    n_params: int
    offloaded: dict[str, int]
    """Bytes offload keeps off the device, per tier ({'cpu': n, 'disk': n}); not in any peak."""
    init_end: dict[str, int] | None = dataclasses.field(default=None, compare=False)
    """Live bytes by category (and 'total') once the engine is built: what it keeps. Its
    last allocations (stage-3 shared-memory casts, ``mct.zero.shm``) may make it the
    construction's peak (``init``); it grows with the model's depth where the peak of an
    earlier moment may not, so ``mct.planner.depth`` extrapolates the two apart."""
    churn: dict[str, int] = dataclasses.field(default_factory=dict, compare=False)
    """The steady step's new ``TRANSIENT`` bytes per phase, the most within one entry
    (``MemoryTracker.churn``): what the allocator serves and takes back there, live at a
    peak or not. The same forward churn with or without recompute (the ops are the same).
    Not compared: it is traffic, not live bytes (a collective's buckets allocated as one
    tensor or one by one make the same peaks, not the same traffic)."""
    snapshot: tuple[int, int] = (0, 0)
    """Host-memory bytes one rollback snapshot copies (``Residency.snapshot_bytes``; 0 on disk
    or in the offload store): taken before the first step (torch's optimizers have no state
    yet) and after the steady step."""
    work: StepWork | None = dataclasses.field(default=None, compare=False)
    """The steady-state step's ops, collectives and offload traffic (``mct.planner.work``):
    what the time model (``mct.planner.steptime``) turns into seconds. Not compared: two
    dry runs are equal when their bytes are (an extrapolated count has other keys than a
    full one, with the same sums)."""


def meta_model(model_fn: ModelFn) -> nn.Module:
    """``model_fn()`` built under ``torch.device('meta')`` (no storage; its random
    initializers skipped: ``mct.task.meta``). Raises ValueError if ``model_fn`` gives no
    nn.Module."""
    model = build_on_meta(model_fn)
    if not isinstance(model, nn.Module):
        raise ValueError(f"the model factory returned {type(model).__name__}, not an nn.Module: "
                         f"return the model (e.g. `def factory(): return MyModel(...)`)")
    return model


def fake_built_model(model_fn: ModelFn) -> nn.Module | None:
    """``model_fn()`` called inside the caller's ``FakeTensorMode``: the model built as
    the user builds it, so the constructor's own temporaries (a weight replaced by a tied
    one, initializers) happen as in a real run. None when that fails (a constructor that
    needs values, which fake tensors do not hold) or leaves real or meta tensors."""
    try:
        model = model_fn()
    except Exception:  # noqa: BLE001 - the caller falls back to the meta device
        return None
    if not isinstance(model, nn.Module) or any(not is_fake(t) for t in (*model.parameters(), *model.buffers())):
        return None
    return model


def materialize_fake(model: nn.Module) -> nn.Module:
    """Replace every parameter and buffer of ``model`` (in place) by a fake CPU tensor
    of the same shape, dtype and requires_grad; shared ones stay shared. Call inside a
    ``FakeTensorMode`` (and a tracker category, to count them as the real model's
    storages). Returns ``model``."""
    fakes: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                if id(p) not in fakes:
                    fakes[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
                mod._parameters[name] = fakes[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is not None:
                if id(b) not in fakes:
                    fakes[id(b)] = torch.empty(b.shape, dtype=b.dtype)
                mod._buffers[name] = fakes[id(b)]
    return model


def fake_batch(batch: Any, mode: FakeTensorMode) -> Any:
    """``batch`` with every tensor (real, meta or fake) replaced by a fake CPU tensor of
    the same shape and dtype. Values are not kept: a dry run needs none."""
    def convert(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if is_fake(t) and t.fake_mode is mode:
            return t
        with mode:
            return torch.empty(t.shape, dtype=t.dtype)
    return tree_map(convert, batch)


class FakeInit:
    """The planner's side of ``InitProgram`` (``mct.task.init_program``): a model built on
    the meta device, its parameters made fake before the engine sees it but counted only
    from the moment the engine materializes them (``materialize``: buffers and frozen
    parameters first, then one unit at a time), as ``mct train`` builds stage 3 and
    offload. Values are not replayed: a dry run needs none."""

    def __init__(self, tracker: MemoryTracker) -> None:
        self.tracker = tracker

    def materialize(self, params: list[torch.Tensor], device: torch.device | str = "cpu") -> None:
        """Count ``params`` (fake tensors) as live 'params' from now on. Mutates the tracker only."""
        for p in params:
            self.tracker.register(p, "params")

    def chunks(self, p: torch.Tensor, chunk: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        """``InitProgram.chunks`` on fake tensors: one buffer of ``p``'s dtype holding the
        largest chunk, allocated (and counted) as a real run allocates it, its views yielded
        in the chunks a run draws. ``p`` itself is never counted."""
        bounds = chunk_bounds(p.numel(), chunk or init_chunks.INIT_CHUNK)
        if not bounds:
            return
        buf = torch.empty(max(b - a for a, b in bounds), dtype=p.dtype)
        for a, b in bounds:
            yield a, buf[:b - a]


class Observer(Protocol):
    """Watches a dry run (the depth extrapolation's ``Windows``)."""

    def attach(self, model: nn.Module, tracker: MemoryTracker) -> None: ...
    def end_step(self, peaks: dict[str, dict[str, int]]) -> None: ...


@dataclass(frozen=True)
class DryRunHooks:
    """How a dry run builds and watches its model; the default: as ``mct.Engine(model_fn())``.

    ``meta_init``: the model is built on meta and the engine materializes it unit by
    unit (what ``mct train`` does at stage 3 and with offload). ``build()``: a model on
    the meta device to train instead of the factory's (the depth extrapolation's shallow
    copies). ``observer``: ``attach(model, tracker)`` is called once the engine is
    built, ``end_step(peaks)`` after each step (the depth extrapolation's ``Windows``,
    which reset the tracker's peaks at every block event: the returned phases then hold
    only each phase's last window; the observer has all). ``micro_batches``: how many
    micro-batches the real step runs when the batch list stands in for them (``mct.plan``
    steps at most 3 of ``data.grad_accum``): the step's work (``DryRun.work``) counts each
    one not stepped as the list's middle one (the first when it has two); None: the list
    is the step."""

    meta_init: bool = False
    build: Callable[[], nn.Module] | None = None
    observer: Observer | None = None
    micro_batches: int | None = None

    def __post_init__(self) -> None:
        m = self.micro_batches
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"DryRunHooks.micro_batches = {m!r}: a whole number of micro-batches >= 1 "
                             f"(data.grad_accum), or None when the batch list is the step")


def dry_run_task(task: Task, config: EngineConfig, world_size: int, *, batch: Any = None,
                 hooks: DryRunHooks | None = None) -> DryRun:
    """``dry_run`` of ``task`` (its model, loss, optimizer and parameter groups; its
    example batch unless ``batch`` is given)."""
    return dry_run(task.model_fn, task.loss_fn, task.batch if batch is None else batch, config, world_size,
                   optimizer=task.optimizer, param_groups=task.param_groups, hooks=hooks)


def dry_run(model_fn: ModelFn, loss_fn: LossFn, batch: Any, config: EngineConfig, world_size: int, *,
            optimizer: OptimizerFactory | None = None, param_groups: ParamGroupsFn | None = None,
            hooks: DryRunHooks | None = None, meta_init: bool = False) -> DryRun:
    """Build the engine for ``config`` on rank 0 of ``world_size`` simulated ranks and
    run two training steps of ``batch`` (one micro-batch, or a list: gradient
    accumulation) with ``loss_fn``, all on fake tensors. ``optimizer`` and
    ``param_groups(model)`` are what ``mct.Engine`` would be given (None: its defaults).
    ``hooks``: how the model is built and who watches (``DryRunHooks``; None: built
    whole first, as ``mct.Engine(model_fn())``). ``meta_init=True``: the earlier spelling
    of ``hooks=DryRunHooks(meta_init=True)``, still accepted. Returns the tracked bytes (``DryRun``).
    Raises ValueError for configs the engine rejects (the same messages) and for a bad
    factory."""
    cfg = _planning_config(config)
    ctx = DistContext.simulated(world_size)
    mode = FakeTensorMode()
    tracker = MemoryTracker("cpu", count_fake=True)
    hooks = hooks or DryRunHooks()
    if meta_init:
        hooks = dataclasses.replace(hooks, meta_init=True)
    observer = hooks.observer
    copied = hooks.build() if hooks.build is not None else None  # a deep copy of meta tensors: outside the fake mode
    with mode:
        model, program = _build(model_fn, tracker, hooks.meta_init, copied)
        with tracker.phase("init", "params"):  # the same stage again: its peak is kept
            n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
            groups = param_groups(model) if param_groups is not None else None
            engine = Engine(model, optimizer, cfg, param_groups=groups, tracker=tracker, ctx=ctx,
                            init_program=program)  # type: ignore[arg-type] - FakeInit has its protocol
            del groups
        init, kept = tracker.peaks()["init"], tracker.live()
        data = fake_batch(batch, mode)
        snapshot_before = engine.residency.snapshot_bytes()
        if observer is not None:
            observer.attach(model, tracker)
        first = engine.train_step(data, loss_fn).metrics["peaks"]
        if observer is not None:
            observer.end_step(first)
        collectives = _Calls(engine.comm.ops, getattr(getattr(engine, "context", None), "comm", None))
        collectives.clear()  # the steady step's only
        modes = mode_counts()
        stepped = len(batch) if isinstance(batch, list) else 1
        missing = max(0, (hooks.micro_batches or stepped) - stepped)  # micro-batches the real step has beyond these
        marks: list[StepWork] = []  # the work counted so far as each micro-batch's forward begins

        def marked_loss(model: nn.Module, mb: Any) -> Any:
            marks.append(_counted(counter, collectives, modes))
            return loss_fn(model, mb)
        with OpCounter() as counter:
            steady_metrics = engine.train_step(data, marked_loss if missing else loss_fn).metrics
        steady = steady_metrics["peaks"]
        if observer is not None:
            observer.end_step(steady)
        offloaded = engine.tracker.offloaded()
        churn = {k: v for k, v in engine.tracker.churn().items() if k in STEP_PHASES}
        snapshot = (snapshot_before, engine.residency.snapshot_bytes())
        counted = _counted(counter, collectives, modes)
        work = dataclasses.replace(counted, offload=_traffic(engine.tracker, steady_metrics))
        if missing:
            work = work.plus(_middle_micro_batch([*marks, counted], steady_metrics), missing)
        engine.close()
    phases = {k: v for k, v in steady.items() if k in STEP_PHASES}
    worst = max(phases, key=lambda k: phases[k]["total"])
    first_phases = {k: v for k, v in first.items() if k in STEP_PHASES}
    return DryRun(peak=phases[worst]["total"], phase=worst, phases=phases,
                  first_step_peak=max(v["total"] for v in first_phases.values()), first_step_phases=first_phases,
                  init_peak=init["total"], init={c: init.get(c, 0) for c in (*CATEGORIES, "total")},
                  n_params=n_params, offloaded=offloaded, churn=churn, snapshot=snapshot, work=work,
                  init_end={c: kept.get(c, 0) for c in (*CATEGORIES, "total")})


class _Calls:
    """The collectives a dry run counts: the engine's (``SimulatedCollectives``) and its
    context group's (``SimulatedContextComm``), each where simulated; ``calls`` their sum."""

    def __init__(self, *sources: Any) -> None:
        self.sources = [s for s in sources if isinstance(getattr(s, "calls", None), Counter)]

    @property
    def calls(self) -> Counter:
        return sum((s.calls for s in self.sources), Counter())

    def clear(self) -> None:
        """Mutates every source: its counts start again from zero."""
        for s in self.sources:
            s.calls.clear()


def _counted(counter: OpCounter, collectives: Any, modes_before: dict[str, int]) -> StepWork:
    """What ``counter`` and the simulated ``collectives`` counted so far, and the ops that
    passed through mct's dispatch modes since ``modes_before`` (no offload traffic)."""
    modes = {k: n - modes_before.get(k, 0) for k, n in mode_counts().items() if n - modes_before.get(k, 0)}
    return StepWork(dict(counter.ops), dict(getattr(collectives, "calls", {})), {}, dict(counter.random),
                    dict(counter.attention), modes)


def _middle_micro_batch(marks: list[StepWork], metrics: dict[str, Any]) -> StepWork:
    """One micro-batch's work from the counts at each micro-batch's start and at the step's
    end (``marks``): the second's of three or more (neither first nor last: it accumulates
    into the gradients and, at stages 0-1, reduces nothing); else the first's (of one, with
    the optimizer's work too); with its share of the activations parked (written and read
    back)."""
    n = len(marks) - 1
    i = 1 if n >= 3 else 0
    mid = marks[i + 1].plus(marks[i], -1)
    if metrics.get("act_offload_bytes"):
        mid = dataclasses.replace(mid, offload={metrics["act_offload"]: 2 * int(metrics["act_offload_bytes"]) // n})
    return mid


def _traffic(tracker: MemoryTracker, metrics: dict[str, Any]) -> dict[str, int]:
    """Bytes a step moves to and from each offload tier: the offloaded state (held across
    steps) and every activation the step parked (``act_offload_bytes``: none is held when
    the step ends), each written and read back once per step."""
    moved = list(tracker.offloaded("state").items())
    if metrics.get("act_offload_bytes"):
        moved.append((metrics["act_offload"], int(metrics["act_offload_bytes"])))
    out: dict[str, int] = {}
    for tier, n in moved:
        if n:
            out[tier] = out.get(tier, 0) + 2 * n
    return out


def _build(model_fn: ModelFn, tracker: MemoryTracker, meta_init: bool,
           copied: nn.Module | None) -> tuple[nn.Module, FakeInit | None]:
    """The model of a dry run (call inside its fake mode) and the init program the engine
    gets. Built as the user builds it (its constructor's temporaries counted) unless
    ``meta_init`` or a ``copied`` meta model need the meta device or the constructor
    needs values."""
    if not meta_init and copied is None:
        with tracker.phase("init", "params"):
            model = fake_built_model(model_fn)
        if model is not None:
            return model, None
    # outside any tracker stage: meta storages are not counted
    model = copied if copied is not None else meta_model(model_fn)
    tracker.reset_peaks()
    if meta_init:
        materialize_fake(model)  # not counted: the engine materializes (registers) unit by unit
        return model, FakeInit(tracker)
    with tracker.phase("init", "params"):
        materialize_fake(model)
    return model, None


def _planning_config(config: EngineConfig) -> EngineConfig:
    """``config`` with tracking on and no budget enforcement (a dry run measures, it
    must not fail at the budget). Raises ValueError for an unresolved 'auto'."""
    for key, value in (("zero.stage", config.zero.stage), ("checkpointing.policy", config.checkpointing.policy)):
        if value == "auto":
            raise ValueError(f"{key} = 'auto' cannot be predicted: it is the planner's choice. Use mct.plan(...) "
                             f"(or `mct plan`) to compare every value, or set {key} to one of them")
    return with_values(config, {"memory.track": True, "memory.enforce": False})


def construction_peak(model_fn: ModelFn) -> dict[str, int] | None:
    """Bytes by category (and 'total') at the peak of building ``model_fn()`` as the
    user builds it, on fake tensors (its constructor's temporaries included); None when
    the constructor needs values (a dry run then builds on meta, which has none)."""
    tracker = MemoryTracker("cpu", count_fake=True)
    with FakeTensorMode(), tracker.phase("init", "params"):
        model = fake_built_model(model_fn)
    built = model is not None
    del model
    peak = tracker.peaks()["init"]
    return {c: peak.get(c, 0) for c in (*CATEGORIES, "total")} if built else None
