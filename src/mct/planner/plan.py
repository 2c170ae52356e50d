"""The plan: every ZeRO stage x checkpointing policy x precision, dry-run, costed, and
the cheapest configuration that fits a per-rank budget (``mct plan``, ``auto``).

Relative step cost (1.0 = stage 0, no recomputation, one rank) is a documented model,
not a measurement (docs/planner.md):
  compute  1 + recomputed_fraction / 3   (forward ~ 1/3 of forward + backward; 'all'
           and 'sqrt' recompute every block's forward once, 'selective' about half;
           'per_block' the mean over its blocks: ``recomputed_fraction``)
  comm     COMM_SHARE x volume / (2 psi), volume per rank per step in parameters:
           2 psi at stages 0-2 (all-reduce = reduce-scatter + all-gather), 3 psi at
           stage 3 (parameters gathered in forward and again in backward); 0 on one rank.
  offload  + OFFLOAD_COST[what]: the step time offload added in benchmarks/offload.py
           (bf16 200M GPT, 2 ranks: optimizer 1.20x, optimizer+params 1.27x of none),
           rounded up.
  act      + ACT_OFFLOAD_COST[tier] for checkpointing.offload (benchmarks/act_offload.py).
  loss     + LOSS_CHUNK_COST with train.loss_chunk_tokens > 0: the head's matmul runs
           again in backward (benchmarks/loss_chunk.py). Chunking changes no numerics
           beyond the order of the loss's reductions.

Offload choices are labels: 'none', 'optimizer=<tier>' or 'optimizer+params=<tier>'
(tier 'cpu' or 'disk'; ``mct.planner.choice.OffloadChoice``). A plan's grid takes the config's own
offload setting unless ``Grid.offloads`` is given; ``auto`` tries offload only when nothing
fits without it. Activation offload (``checkpointing.offload``: 'none', 'cpu', 'disk') is
its own axis (``Grid.act_offloads``, default the config's own; rows with policy 'none' only
plan 'none', since nothing is checkpointed). ``auto`` (``mct.planner.auto``) searches with
``mct.planner.solver``, which builds its candidates with ``with_choice``, ``predict`` and ``row``. Loss chunking is a grid axis too
(``Grid.loss_chunks``: chunk sizes, 0 = off; default the config's own); ``auto`` plans it
when the config leaves it off, nothing fits without it, and the loss is a model source's
default (``Task.loss_for_chunk``). MLP tiling (``checkpointing.mlp_tile_tokens``) is one
too (``Grid.mlp_tiles``, default the config's own); ``auto`` plans ``AUTO_MLP_TILE`` when
nothing fits otherwise and the model's blocks have an MLP. Its cost (one more forward of
each tiled MLP in backward) is not in ``step_cost``: at equal cost the untiled row is
recommended. It changes no numerics beyond the summation order of the MLP's weight gradients.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mct.checkpointing import block_choices, find_blocks, find_mlps
from mct.config import OFFLOAD_TIERS, EngineConfig, PrecisionMode
from mct.machine import default_device
from mct.memory.tracker import CATEGORIES, format_bytes
from mct.planner.depth import Prepared, extrapolated, shape_for
from mct.planner.dry_run import DryRun, DryRunHooks, dry_run_task, meta_model
from mct.planner.grid import (PLANNED_POLICIES, PRECISIONS, STAGES, Grid, batch_size, micro_batches, prepare_work,  # noqa: F401
                              map_task, smaller_batch, task_of)
from mct.planner.choice import NO_OFFLOAD, Choice, OffloadChoice, PlanRow, apply, figure_of, seconds_of
from mct.planner.pool import run_jobs
from mct.planner.overhead import device_rates
from mct.planner.resident import ProcessModel, process_model
from mct.planner.steptime import Rates, step_time, tokens_per_step
from mct.task.build import builds_on_meta
from mct.task.spec import Task, with_loss_chunk

PlanInput = Task | Prepared
"""What a plan's dry runs take: a Task, or the Task with what its plan shares (``prepare_work``)."""

COMM_SHARE = 0.25
"""Assumed share of a data-parallel step spent communicating 2 psi (a mid-size cluster)."""
RECOMPUTED = {"none": 0.0, "all": 1.0, "sqrt": 1.0, "every_k": 0.5, "selective": 0.5}
OFFLOAD_COST = {"none": 0.0, "optimizer": 0.2, "optimizer+params": 0.3}
ACT_OFFLOAD_COST = {"none": 0.0, "cpu": 0.05, "disk": 0.1}
LOSS_CHUNK_COST = 0.02
AUTO_LOSS_CHUNK = 1024
"""The chunk ``auto`` plans (tokens): at a 128k vocabulary, 0.5 GiB of fp32 logits per chunk."""
AUTO_MLP_TILE = 1024
"""The MLP tile ``auto`` plans (tokens): an 8B Llama's [tile, 14336] bf16 intermediates are 28 MiB."""


def step_cost(stage: int, policy: str, world: int, offload: OffloadChoice = NO_OFFLOAD, act_offload: str = "none",
              loss_chunk: int = 0, recomputed: float | None = None) -> float:
    """Relative step cost of a configuration (see the module docstring). ``recomputed``:
    the recomputed fraction when it is not the policy's own (per_block: ``recomputed_fraction``)."""
    compute = 1.0 + (RECOMPUTED.get(policy, 1.0) if recomputed is None else recomputed) / 3
    volume = 0.0 if world == 1 else (3.0 if stage == 3 else 2.0)
    return round(compute + COMM_SHARE * volume / 2 + OFFLOAD_COST[offload.kind]
                 + ACT_OFFLOAD_COST[act_offload] + (LOSS_CHUNK_COST if loss_chunk > 0 else 0.0), 4)


def recomputed_fraction(choices: list[str]) -> float:
    """The recomputed share of the blocks' forward under per-block ``choices``: 'all' a
    whole block, 'selective' half of one (as ``RECOMPUTED``)."""
    return sum(RECOMPUTED[c] for c in choices) / max(len(choices), 1)


def per_block_setting(spec: list[str] | dict[str, int]) -> str:
    """``checkpointing.per_block`` as a --set argument: 'checkpointing.per_block=all=8,selective=8'."""
    text = ",".join(f"{k}={v}" for k, v in spec.items()) if isinstance(spec, dict) else ",".join(spec)
    return f"checkpointing.per_block={text}"


def with_choice(cfg: EngineConfig, stage: int, policy: str, precision: str | None = None,
                offload: OffloadChoice | None = None, act_offload: str | None = None,
                loss_chunk: int | None = None, mlp_tile: int | None = None) -> EngineConfig:
    """``apply(cfg, Choice(...))``: ``cfg`` with zero.stage, checkpointing.policy (and
    precision.mode, the offload tiers, checkpointing.offload, train.loss_chunk_tokens,
    checkpointing.mlp_tile_tokens) replaced. Policy 'per_block' keeps ``cfg``'s
    checkpointing.per_block (ValueError when it has none); a uniform policy drops it."""
    return apply(cfg, Choice(stage, policy, precision, offload, act_offload, loss_chunk, mlp_tile))


def predict(work: PlanInput, cfg: EngineConfig, world: int) -> DryRun:
    """The dry run of ``work`` under ``cfg`` on ``world`` ranks, with the model built as
    ``mct train`` builds it (on meta at stage 3 and with offload: ``builds_on_meta``).
    Extrapolated from two shallow copies when ``work`` is ``Prepared`` (its model has
    repeated blocks: ``mct.planner.depth``), else a full ``dry_run``."""
    task = task_of(work)
    batch, meta_init = micro_batches(task.batch, cfg.data.grad_accum), builds_on_meta(cfg)
    if isinstance(work, Prepared):
        run = extrapolated(work, cfg, world, batch, meta_init=meta_init, micro_batches=cfg.data.grad_accum)
        if run is not None:
            return run
    return dry_run_task(task, cfg, world, batch=batch,
                        hooks=DryRunHooks(meta_init=meta_init, micro_batches=cfg.data.grad_accum))


def dry_run_cost(work: PlanInput, cfg: EngineConfig) -> float:
    """Relative cost of ``predict(work, cfg, ...)``: the blocks its dry runs step through
    (recomputing policies step through them about twice), for ordering a grid's jobs."""
    stack = work.stack if isinstance(work, Prepared) else None
    if stack is None:
        return 1.0
    shape = shape_for(stack, cfg)
    blocks = stack.n if shape is None else shape.blocks
    return blocks * (1.0 if cfg.checkpointing.policy == "none" else 1.5)


def row(run: DryRun, choice: Choice, world: int, budget: int | None, *, recomputed: float | None = None,
        rates: Rates | None = None, tokens: int = 0, process: ProcessModel | None = None,
        counts: str = "tensors") -> PlanRow:
    """The plan row of ``choice`` (every field set: none left to the config) from its dry
    run: its peaks, whether the steady-state peak fits ``budget`` (None: fits), its relative
    cost (``recomputed``: a 'per_block' row's recomputed fraction, ``recomputed_fraction``),
    and with ``rates`` (``mct.planner.steptime``) the predicted seconds per step, their
    terms and the tokens per second (``tokens`` per step over it); with ``process`` the
    process peak beside the tensor peak (``mct.memory.process_peak``). ``counts``: what
    ``budget`` is compared with ('process': the process peak, then ``process`` is required;
    'tensors': the tensor peak)."""
    c = choice
    assert counts == "tensors" or process is not None, "a budget counting the process needs a process model"
    assert c.precision is not None and c.offload is not None and c.act_offload is not None
    at = run.phases[run.phase]
    timed = step_time(run.work, rates) if rates is not None and run.work is not None else None
    breakdown = {k: at.get(k, 0) for k in CATEGORIES}
    proc = (process.predict_run(run, offload=c.offload.kind != "none", sharded_save=saves_sharded(c.stage, world))
            if process else None)
    return PlanRow(
        stage=c.stage, policy=c.policy, per_block=c.per_block if c.policy == "per_block" else None,
        precision=c.precision, offload=c.offload, act_offload=c.act_offload, loss_chunk_tokens=c.loss_chunk or 0,
        mlp_tile_tokens=c.mlp_tile or 0, world=world, peak=run.peak, phase=run.phase,
        breakdown=breakdown, phases={k: v["total"] for k, v in run.phases.items()},
        first_step_peak=run.first_step_peak, init_peak=run.init_peak, offloaded=dict(run.offloaded),
        fits=budget is None or (proc.total if counts == "process" and proc else run.peak) <= budget,
        cost=step_cost(c.stage, c.policy, world, c.offload, c.act_offload, c.loss_chunk or 0,
                       recomputed if c.policy == "per_block" else None),
        step_s=timed.total if timed else None, time=timed.to_dict() if timed else None,
        tokens_per_s=tokens / timed.total if timed and timed.total > 0 else None,
        process_peak=proc.total if proc else None, runtime_baseline=proc.baseline if proc else None,
        allocator_overhead=proc.allocator_overhead if proc else None, process_counts=proc.counts if proc else None,
        process_at=proc.at if proc else None, rollback_snapshots=proc.snapshots if proc else None,
        budget_counts=counts)


@dataclass
class Plan:
    """The ``rows`` (``PlanRow``), the ``recommended`` row (None when no budget was given or
    nothing fits in ``precision``), and ``advice``, one line."""

    rows: list[PlanRow]
    budget: int | None
    world: int
    n_params: int
    precision: PrecisionMode
    recommended: PlanRow | None
    advice: str
    time_notes: list[str] = dataclasses.field(default_factory=list)
    """What the rows' step times could not count (a rate not measured here), one line each."""
    process_note: str = ""
    """Why the rows carry no process peak ('' when they do)."""
    budget_counts: str = "tensors"
    """What the budget is compared with: 'process' (each row's ``process_peak``) or 'tensors'
    (its ``peak``), as ``memory.budget_counts`` says."""
    process: ProcessModel | None = None
    """The process model the rows used (None: none known); not serialized."""
    device: str = "cpu"
    """The device type the plan is for ('cpu' or 'cuda'; ``mct plan --device``)."""

    def to_dict(self) -> dict[str, Any]:
        return {"budget": self.budget, "budget_counts": self.budget_counts, "world": self.world,
                "n_params": self.n_params, "precision": self.precision, "advice": self.advice,
                "recommended": self.recommended.to_dict() if self.recommended is not None else None,
                "rows": [r.to_dict() for r in self.rows], "time_notes": self.time_notes,
                "process_note": self.process_note, "device": self.device}

    def figure(self, run: DryRun, offload: bool, sharded_save: bool = False) -> int:
        """The figure this plan's budget compares for a dry run (its process or tensor peak;
        ``sharded_save`` as ``ProcessModel.predict``'s)."""
        if self.budget_counts != "process":
            return run.peak
        assert self.process is not None
        return self.process.predict_run(run, offload=offload, sharded_save=sharded_save).total


def saves_sharded(stage: Any, world: int) -> bool:
    """Whether a run at ZeRO ``stage`` on ``world`` ranks saves sharded state (stage 1 and up on
    several ranks): ``ProcessModel.predict``'s ``sharded_save``."""
    return world > 1 and isinstance(stage, int) and stage >= 1


def planned_device(cfg: EngineConfig) -> str:
    """The device type a plan of ``cfg`` is for: 'cuda' with ``distributed.backend = "nccl"``,
    else 'cpu' (``mct plan`` and the launcher's check, before any device is seen)."""
    return "cuda" if cfg.distributed.backend == "nccl" else "cpu"


DEVICES = ("cpu", "cuda")
"""The device types a plan can be for (``mct plan --device``)."""


def target_device(cfg: EngineConfig, device: str | None = None) -> str:
    """The device type a plan is for: ``device`` when given ('cpu' or 'cuda', from any machine),
    else the one a run of ``cfg`` would take here (``mct.dist``: 'cuda' with ``distributed.backend
    = "nccl"``, or with 'auto' where torch sees a CUDA device; else 'cpu'). Raises ValueError
    naming ``device`` when it is not a device type."""
    if device is None:
        backend = cfg.distributed.backend
        return "cuda" if backend == "nccl" or (backend == "auto" and default_device() == "cuda") else "cpu"
    if device not in DEVICES:
        raise ValueError(f"--device {device!r}: choose cpu or cuda (the device the run will compute on; "
                         f"default: this machine's own)")
    return device


def for_device(cfg: EngineConfig, device: str) -> EngineConfig:
    """``cfg`` as a dry run (on this CPU's fake tensors) must run it to predict a run on
    ``device``: a CUDA run never takes a CPU's fp32 kernels for its bf16/fp16 matmuls
    (``precision.cpu_matmul`` is for CPU devices), so its dry run takes the native ones
    whatever this CPU has, and its simulated ranks stand for NCCL ranks on CUDA devices
    (``distributed.backend = "nccl"``: NCCL's collectives, activation offload's 'cpu' tier);
    a CPU run, as configured (this CPU's kernels, gloo)."""
    dist = cfg.distributed
    if device == "cpu":
        return cfg if dist.backend != "nccl" else dataclasses.replace(
            cfg, distributed=dataclasses.replace(dist, backend="gloo"))
    prec = cfg.precision if cfg.precision.cpu_matmul == "native" else \
        dataclasses.replace(cfg.precision, cpu_matmul="native")
    return dataclasses.replace(cfg, precision=prec, distributed=dataclasses.replace(dist, backend="nccl"))


def make_plan(work: PlanInput, cfg: EngineConfig, world: int, budget: int | None, grid: Grid = Grid(), *,
              advise: bool = True, extrapolate: bool = True, workers: int = 1, rates: Rates | None = None,
              device: str = "cpu", measure: bool = True) -> Plan:
    """Dry-run every configuration of the ``grid`` for ``work`` on ``world`` ranks (the
    other keys as in ``cfg``; ``grid.offloads``: offload labels, default ``cfg``'s own);
    recommend the fastest predicted (``step_s``; without a machine profile the relative
    ``step_cost``) that fits ``budget`` in ``cfg``'s precision, or in the one precision
    planned when that is another (ties: the untiled row, the lower peak, the lower stage).
    Parameter offload is planned at stage 3 only. ``grid.act_offloads``: checkpointing.offload
    tiers (default ``cfg``'s own), planned for policies other than 'none'.
    ``grid.loss_chunks``: train.loss_chunk_tokens values (default ``cfg``'s own; other
    values need the default loss, ``Task.loss_for_chunk``).
    ``advise=False`` leaves ``advice`` empty (its search for what would fit dry-runs more).
    ``extrapolate``: a deep model's repeated blocks are dry-run at two small depths and
    extended (``mct.planner.depth``; exact where the blocks repeat); False: every
    configuration is dry-run at full depth. What every configuration shares (the
    model's structure, its construction) is found once (``prepare_work``). ``workers`` > 1:
    a long grid's dry runs run in up to that many forked processes (``mct.planner.pool``;
    the same rows). ``rates``: what turns each row's step into seconds (``step_s``,
    ``tokens_per_s``); default this machine's for ``device`` (``overhead.device_rates``:
    measured on first use, then cached; ``measure=False``: the cache only, no step times
    without one; none where this machine computes on another device type). ``device``: the
    device type the run computes on ('cpu', 'cuda': ``for_device``, the process model's terms).
    Raises ValueError for a bad world size, model factory, config or offload label."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    cfg = for_device(cfg, device)
    precisions = tuple(PrecisionMode(p) for p in grid.precisions)  # the Python API's Grid may hold names
    offloads = tuple(offload_choice(o) for o in grid.offloads) if grid.offloads else (OffloadChoice.of(cfg),)
    acts = tuple(grid.act_offloads) if grid.act_offloads else (cfg.checkpointing.offload,)
    for tier in acts:
        if tier not in OFFLOAD_TIERS:
            raise ValueError(f"activation offload {tier!r}: choose from {', '.join(OFFLOAD_TIERS)}")
    chunks = _loss_chunks(work, cfg, grid.loss_chunks)
    tiles = tuple(dict.fromkeys(int(t) for t in grid.mlp_tiles)) if grid.mlp_tiles else (cfg.checkpointing.mlp_tile_tokens,)
    notes: list[str] = []
    if rates is None:
        rates, notes = device_rates(world, device, measure=measure)
    if rates is not None or not notes:
        notes = [*notes, *(rates.notes if rates else ["no machine profile cached: no step times (mct calibrate)"])]
    # one window per context group (parallel.context ranks share it)
    tokens = tokens_per_step(task_of(work).batch, cfg.data.grad_accum, world // cfg.parallel.context)
    work = prepare_work(work, cfg, extrapolate)
    works = {c: map_task(work, with_loss_chunk, c) for c in chunks}
    mixed = _per_block_of(work, cfg) if "per_block" in grid.policies else {}
    choices = [Choice(stage, policy, precision, offload, act, chunk, tile,
                      mixed.get("per_block") if policy == "per_block" else None)
               for precision in precisions for offload in offloads for act in acts for chunk in chunks
               for tile in tiles for policy in grid.policies for stage in grid.stages
               if (offload.params == "none" or stage == 3) and (act == "none" or policy != "none")]
    configs = [apply(cfg, c) for c in choices]
    runs = run_jobs(lambda i: predict(works[choices[i].loss_chunk], configs[i], world), len(configs), workers=workers,
                    cost=[dry_run_cost(work, c) for c in configs])
    process, why = process_model(task_of(work), cfg, device, measure=measure)
    counts = budget_counts(cfg, process, why) if budget is not None else "tensors"
    rows = [row(run, c, world, budget, recomputed=mixed.get("recomputed"), rates=rates, tokens=tokens,
                process=process, counts=counts) for run, c in zip(runs, choices)]
    n_params = runs[-1].n_params if runs else 0
    # the config's precision; a grid of one other precision (`--precisions bf16`) is asked for that one
    mode = precisions[0] if len(precisions) == 1 and cfg.precision.mode not in precisions else cfg.precision.mode
    mine = [r for r in rows if r.precision == mode]
    # the fastest predicted (step_s; the relative step_cost when no machine profile is cached);
    # at equal cost the untiled row: step_cost does not count the tiled MLP's extra forward
    fitting = sorted((r for r in mine if r.fits), key=lambda r: (r.seconds, r.mlp_tile_tokens > 0, r.peak, r.stage))
    best = fitting[0] if fitting and budget is not None else None
    plan = Plan(rows, budget, world, n_params, mode, best, "", notes, why, counts, process, device)
    if advise:
        plan.advice = _advice(plan, work, cfg, runs)
    return plan


def budget_counts(cfg: EngineConfig, process: ProcessModel | None, why: str) -> str:
    """What a budget is compared with: ``memory.budget_counts``. Raises ValueError when it
    counts the process and no process model is known (``why``: the reason), naming both ways out."""
    if not cfg.memory.counts_process:
        return "tensors"
    if process is None:
        raise ValueError(f"memory.budget counts the process's peak (memory.budget_counts = 'process') and this "
                         f"plan cannot predict it: {why.removeprefix('no process peak: ')}; run `mct calibrate`, "
                         f"or set memory.budget_counts=tensors to budget tensor bytes only")
    return "process"


def offload_choice(offload: OffloadChoice | str) -> OffloadChoice:
    """An offload choice, or the label of one (the Python API's ``Grid.offloads`` may hold
    labels): parsed here, at the plan's boundary. Raises ValueError for a bad label."""
    return offload if isinstance(offload, OffloadChoice) else OffloadChoice.parse(offload)


predicted_seconds = seconds_of
"""What a recommendation and the solver rank a row by (``mct.planner.choice.seconds_of``)."""


def _per_block_of(work: PlanInput, cfg: EngineConfig) -> dict[str, Any]:
    """``row``'s per_block keywords: the config's checkpointing.per_block and its recomputed
    fraction at the model's block count. Raises ValueError as ``block_choices``."""
    if isinstance(work, Prepared):
        n = work.stack.n
    else:
        n = len(find_blocks(meta_model(task_of(work).model_fn), cfg.checkpointing.blocks))
    choices = block_choices(with_choice(cfg, 0, "per_block").checkpointing, n)
    assert choices is not None
    return {"per_block": cfg.checkpointing.per_block, "recomputed": recomputed_fraction(choices)}


def _policy_settings(r: PlanRow) -> str:
    """A row's checkpointing as --set arguments."""
    if r.policy == "per_block" and r.per_block:
        return f"checkpointing.policy=per_block {per_block_setting(r.per_block)}"
    return f"checkpointing.policy={r.policy}"


def _advice(plan: Plan, work: PlanInput, cfg: EngineConfig, runs: list[DryRun] | None = None) -> str:
    """The plan's one line: its recommendation, or why nothing fits and what would.
    ``runs``: the rows' dry runs, in ``plan.rows``' order, where known (saves one)."""
    if plan.budget is None:
        return "no budget given: pass --budget (e.g. 24GiB) to get a recommendation"
    if plan.recommended is not None:
        r = plan.recommended
        off = _offload_settings(r) + ("" if r.act_offload == "none" else f" checkpointing.offload={r.act_offload}")
        off += _chunk_setting(r)
        what = "peak" if plan.budget_counts != "process" else "process peak"
        return (f"recommended: zero.stage={r.stage} {_policy_settings(r)} "
                f"precision.mode={r.precision}{off} (predicted {what} {format_bytes(figure_of(r))} per rank of "
                f"{format_bytes(plan.budget)}, cost {r.cost:.2f})")
    mine = [r for r in plan.rows if r.precision == plan.precision]
    if not mine:
        return (f"no configuration in precision {plan.precision} (precision.mode) was planned: add it to the "
                f"precisions planned (--precisions) or set precision.mode to one of them")
    low = min(mine, key=figure_of)
    counted = "" if plan.budget_counts != "process" else " (process peak: the resident set)"
    msg = (f"nothing fits {format_bytes(plan.budget)} per rank in {plan.precision}: the smallest, "
           f"zero.stage={low.stage} {_policy_settings(low)}{_offload_settings(low)}{_chunk_setting(low)}, needs "
           f"{format_bytes(figure_of(low))}{counted} (misses by {format_bytes(figure_of(low) - plan.budget)})")
    run = next((d for r, d in zip(plan.rows, runs) if r is low), None) if runs is not None else None
    return msg + _what_would_fit(plan, work, cfg, low, run)


def _what_would_fit(plan: Plan, work: PlanInput, cfg: EngineConfig, low: PlanRow, run: DryRun | None) -> str:
    """Fewer bytes per rank: no rollback snapshots in memory, a smaller micro-batch, or more
    ranks at stage 3. ``run``: ``low``'s dry run where known (else made again)."""
    hints = []
    batch = task_of(work).batch
    B = batch_size(batch)
    budget = plan.budget
    assert budget is not None
    base = apply(cfg, low.choice)
    work = map_task(work, with_loss_chunk, low.loss_chunk_tokens)
    if plan.budget_counts == "process" and plan.process is not None and low.rollback_snapshots:
        bare = dataclasses.replace(plan.process, snapshot_every=0)
        if bare.predict_run(run or predict(work, base, plan.world), offload=low.offload.kind != "none",
                            sharded_save=saves_sharded(low.stage, plan.world)).total <= budget:
            hints.append(f"train.snapshot_every=0 (its rollback snapshots hold {format_bytes(low.rollback_snapshots)}; "
                         f"a rollback then restores the newest checkpoint on disk)")
    for b in sorted({max(1, (B or 1) // d) for d in (2, 4, 8, 16, 32, 64)}, reverse=True):
        if B is None or b >= B:
            continue
        smaller = map_task(work, dataclasses.replace, batch=smaller_batch(batch, b))
        if plan.figure(predict(smaller, base, plan.world), low.offload.kind != "none",
                       saves_sharded(low.stage, plan.world)) <= budget:
            hints.append(f"data.micro_batch_size={b} (x{B // b} data.grad_accum keeps the batch)")
            break
    stage3 = apply(cfg, dataclasses.replace(low.choice, stage=3))
    worlds = [w for w in (2 ** k for k in range(1, 13)) if w > plan.world]
    lo, hi = 0, len(worlds) - 1  # the peak falls as ranks are added: bisect for the fewest that fit
    found = None
    while lo <= hi:
        mid = (lo + hi) // 2
        if plan.figure(predict(work, stage3, worlds[mid]), low.offload.kind != "none",
                       sharded_save=saves_sharded(3, worlds[mid])) <= budget:
            found, hi = worlds[mid], mid - 1
        else:
            lo = mid + 1
    if found is not None:
        hints.append(f"{found} ranks at zero.stage=3")
    if not hints:
        return "; neither up to 4096 ranks nor a smaller micro-batch alone makes it fit: raise the budget"
    return "; it would fit with " + " or ".join(hints)


def _chunk_setting(r: PlanRow) -> str:
    chunk, tile = r.loss_chunk_tokens, r.mlp_tile_tokens
    return (f" train.loss_chunk_tokens={chunk}" if chunk else "") + (f" checkpointing.mlp_tile_tokens={tile}"
                                                                     if tile else "")


def _offload_settings(r: PlanRow) -> str:
    """A row's state offload as --set arguments, with a leading space ('' for none)."""
    text = r.offload.settings()
    return f" {text}" if text else ""


def _loss_chunks(work: PlanInput, cfg: EngineConfig, loss_chunks: tuple | None) -> tuple[int, ...]:
    """The grid's train.loss_chunk_tokens values. Raises ValueError for a negative one,
    or for values other than the config's own with a loss that is the user's."""
    own = cfg.train.loss_chunk_tokens
    chunks = tuple(dict.fromkeys(int(c) for c in loss_chunks)) if loss_chunks else (own,)
    if any(c < 0 for c in chunks):
        raise ValueError(f"loss chunks {chunks}: each must be >= 0 tokens (0 = off)")
    if task_of(work).loss_for_chunk is None and chunks != (own,):
        raise ValueError(f"loss chunks {chunks}: this model is trained with its own loss_fn, which mct cannot "
                         f"chunk; plan it as it is (drop --loss-chunks), or chunk inside it with "
                         f"mct.task.linear_cross_entropy")
    return chunks


def _tiling_may_fit(cfg: EngineConfig, work: PlanInput) -> bool:
    """Is MLP tiling worth planning for ``auto``? The config leaves it off and the model's
    blocks have an MLP (``mct.checkpointing.find_mlps``)."""
    if cfg.checkpointing.mlp_tile_tokens:
        return False
    return bool(find_mlps(find_blocks(meta_model(task_of(work).model_fn), cfg.checkpointing.blocks)))


def auto_offloads(device: str) -> tuple[OffloadChoice, ...]:
    """What ``auto`` tries when nothing fits without offload: host memory for a CUDA
    device, disk for a CPU device (where host memory is the budget)."""
    tier = "cpu" if device == "cuda" else "disk"
    return (OffloadChoice(tier), OffloadChoice(tier, tier))


def auto_act_offload(device: str) -> str:
    """The activation offload tier ``auto`` tries: pinned host memory for a CUDA device,
    disk for a CPU device."""
    return "cpu" if device == "cuda" else "disk"


def peak_check(measured: int, predicted: int, tolerance: float = 0.10) -> str | None:
    """A warning line when the measured peak exceeds the prediction by more than
    ``tolerance``; None otherwise."""
    if predicted > 0 and measured > predicted * (1 + tolerance):
        return (f"measured peak {format_bytes(measured)} per rank exceeds the planner's prediction "
                f"{format_bytes(predicted)} by {100 * (measured / predicted - 1):.1f}% (> {100 * tolerance:.0f}%)")
    return None
