"""The memory planner: per-rank peak bytes of any model's training step, predicted by
running the engine's own code on fake tensors (``dry_run``), and the plan that picks
the cheapest configuration fitting a budget (``plan``; ``mct plan``), and the solver that
searches for the fastest one that fits (``solver``; ``mct plan --solve``; ``auto``).

It sits above the engine: it imports ``mct.engine``, never the other way round.
"""

from __future__ import annotations

from typing import Any

from mct.config import EngineConfig, with_values
from mct.planner.depth import Prepared
from mct.planner.dry_run import (DryRun, DryRunHooks, LossFn, ModelFn, OptimizerFactory, ParamGroupsFn, dry_run,
                                 dry_run_task)
from mct.planner.grid import PLANNED_POLICIES, PRECISIONS, STAGES, Grid
from mct.planner.auto import resolve_auto
from mct.planner.plan import Plan, make_plan, peak_check, step_cost, target_device
from mct.planner.pool import plan_workers
from mct.task import Task, load_workload, token_batch, token_loss

Workload = Task
"""The former name of ``mct.task.Task`` here, kept for callers of ``mct.planner``."""

__all__ = ["DryRun", "DryRunHooks", "Grid", "Plan", "Prepared", "Task", "Workload", "dry_run", "dry_run_task",
           "load_workload", "make_plan", "peak_check", "plan", "plan_task", "plan_workers", "predict_peak",
           "predict_task", "resolve_auto", "step_cost", "token_batch", "token_loss"]


def _config(config: EngineConfig | dict | None) -> EngineConfig:
    if config is None:
        return EngineConfig()
    if isinstance(config, dict):
        return EngineConfig.from_dict(config)
    if not isinstance(config, EngineConfig):
        raise ValueError(f"config must be an mct.EngineConfig or its dict, got {type(config).__name__}")
    return config


def predict_task(task: Task, config: EngineConfig | dict | None = None, world_size: int = 1) -> int:
    """Per-rank peak bytes of a steady-state training step of ``task`` (its model,
    loss, example micro-batch, optimizer and parameter groups) under ``config`` on
    ``world_size`` ranks: ``predict_peak`` with the Task's pieces."""
    return dry_run_task(task, _config(config), world_size).peak


def predict_peak(model_fn: ModelFn, loss_fn: LossFn, batch: Any, config: EngineConfig | dict | None = None,
                 world_size: int = 1, optimizer: OptimizerFactory | None = None, *,
                 param_groups: ParamGroupsFn | None = None) -> int:
    """Per-rank peak bytes of a steady-state training step of ``mct.Engine(model_fn(),
    optimizer, config)`` on ``world_size`` ranks, each stepping on ``batch`` (one
    rank's micro-batch, or a list of micro-batches) with ``loss_fn(model, batch)``.

    Nothing is allocated: the model is built on the meta device and the engine runs on
    fake tensors (``dry_run``, which also gives the first-step and initialization peaks
    and the bytes per category and phase). ``param_groups(model)``: what you would pass
    as the engine's ``param_groups``. Raises ValueError for a config the engine rejects,
    'auto' values, or a factory that returns no nn.Module. The Task form: ``predict_task``."""
    return predict_task(Task(model_fn, loss_fn, batch, optimizer, param_groups), config, world_size)


def plan_task(task: Task, config: EngineConfig | dict | None = None, world_size: int = 1,
              budget: int | str | None = None, grid: Grid = Grid(), *, extrapolate: bool = True,
              workers: int | None = None, device: str | None = None) -> Plan:
    """Every configuration of ``grid`` (``Grid``: stages x policies x precisions x
    offload labels; default every stage, policy and fp32/bf16 with the config's own
    offload) dry-run for ``task`` on ``world_size`` ranks (other keys as in ``config``),
    as plain data: the rows that ``mct plan`` prints and the recommendation for a
    per-rank ``budget`` (bytes or a size like '24GiB'; default ``memory.budget``).
    ``extrapolate``: a deep model's repeated blocks are dry-run at two small depths and
    extended (exact where they repeat; ``mct.planner.depth``); False: every
    configuration at full depth. ``workers``: processes for a long grid's dry runs
    (``mct.planner.pool``; None: one per usable core, at most 8; 1: all in this
    process); the rows are the same. ``device``: the device type the run computes on, 'cpu' or
    'cuda' (default: this machine's own; ``Plan.device``): the process peak's terms, and step
    times only where this machine computes on it. Raises ValueError as ``predict_peak``, or for a
    bad budget, worker count or device."""
    cfg = _config(config)
    limit = with_values(cfg, {"memory.budget": budget}).memory.budget if budget is not None else cfg.memory.budget
    return make_plan(task, cfg, world_size, limit, grid, extrapolate=extrapolate, workers=plan_workers(workers),
                     device=target_device(cfg, device))


def plan(model_fn: ModelFn, loss_fn: LossFn, batch: Any, config: EngineConfig | dict | None = None,
         world_size: int = 1, budget: int | str | None = None, optimizer: OptimizerFactory | None = None, *,
         param_groups: ParamGroupsFn | None = None, stages: tuple = STAGES, policies: tuple = PLANNED_POLICIES,
         precisions: tuple = PRECISIONS, offloads: tuple | None = None, extrapolate: bool = True,
         workers: int | None = None, act_offloads: tuple | None = None,
         loss_chunks: tuple | None = None, device: str | None = None) -> Plan:
    """``plan_task`` of ``Task(model_fn, loss_fn, batch, optimizer, param_groups)`` over
    ``Grid(stages, policies, precisions, offloads)``: every ZeRO stage x checkpointing
    policy x precision (x offload label: 'none', 'optimizer=cpu|disk',
    'optimizer+params=cpu|disk'; default the config's own) dry-run for this model on
    ``world_size`` ranks, and the recommendation for ``budget``. Raises ValueError as
    ``plan_task``. ``act_offloads``: checkpointing.offload tiers to plan ('none', 'cpu',
    'disk'; default the config's own; each row's ``act_offload``); ``loss_chunks``:
    train.loss_chunk_tokens values to plan (0 = off; default the config's own); ``device``:
    'cpu' or 'cuda', the device the run computes on (default: this machine's own)."""
    task = Task(model_fn, loss_fn, batch, optimizer, param_groups)
    return plan_task(task, config, world_size, budget, Grid(tuple(stages), tuple(policies), tuple(precisions),
                                                            tuple(offloads) if offloads else None,
                                                            tuple(act_offloads) if act_offloads else None,
                                                            tuple(loss_chunks) if loss_chunks else None),
                     extrapolate=extrapolate, workers=workers, device=device)
