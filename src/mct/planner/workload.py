"""What the planner plans: a ``mct.task.Task`` (``Workload`` is its name here, kept for
callers of ``mct.planner``), prepared once per plan (``prepare``: what every
configuration of the grid shares), and the batch shapes a dry run steps on."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from mct.config import EngineConfig
from mct.planner.depth import Stack, find_stack
from mct.planner.dry_run import construction_peak
from mct.task.spec import Task
from mct.task.spec import Task as Workload  # noqa: F401 - re-exported


@dataclass(frozen=True)
class PlannedTask(Task):
    """A Task with what every configuration of a plan shares, found once: the model's
    repeated blocks (``stack``; None: every configuration gets a full dry run), its
    parameter count, and the peak of building it as its factory does
    (``construction``, see ``dry_run.construction_peak``)."""

    stack: Stack | None = None
    n_params: int = 0
    construction: dict[str, int] | None = None


def prepare(work: Task, cfg: EngineConfig, extrapolate: bool = True) -> Task:
    """``work`` as a ``PlannedTask`` when its depth can be extrapolated (and
    ``extrapolate``), else ``work`` itself. Builds the model on meta and on fake
    tensors once (nothing allocated); the plan's shallow copies are cut from the first. Raises ValueError for a factory that returns
    no nn.Module."""
    if isinstance(work, PlannedTask) or not extrapolate:
        return work
    stack = find_stack(work, cfg)
    if stack is None:
        return work
    n_params = sum(p.numel() for p in {id(p): p for p in stack.model.parameters()}.values())
    base = {f.name: getattr(work, f.name) for f in fields(Task)}
    return PlannedTask(**base, stack=stack, n_params=n_params, construction=construction_peak(work.model_fn))


def micro_batches(batch: Any, grad_accum: int) -> Any:
    """The batch a dry run steps on: one micro-batch, or two when ``grad_accum`` > 1
    (the second already finds the first's gradients; later ones are alike)."""
    return [batch, batch] if grad_accum > 1 and not isinstance(batch, list) else batch


def smaller_batch(batch: Any, size: int) -> Any:
    """``batch`` with every tensor cut to its first ``size`` rows (the micro-batch
    dimension); other leaves unchanged."""
    return torch.utils._pytree.tree_map(lambda t: t[:size] if isinstance(t, torch.Tensor) and t.dim() else t, batch)


def batch_size(batch: Any) -> int | None:
    """Rows of the first tensor in ``batch`` (its micro-batch size), or None."""
    leaves = [t for t in torch.utils._pytree.tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim()]
    return int(leaves[0].shape[0]) if leaves else None
