"""What a plan covers: a ``mct.task.Task`` (prepared once per plan: ``prepare_work``, what
every configuration shares) and the ``Grid`` of configurations it dry-runs, with the
batch shapes a dry run steps on."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from mct.config import EngineConfig
from mct.planner.depth import Prepared, find_stack
from mct.planner.dry_run import construction_peak
from mct.task.spec import Task

STAGES = (0, 1, 2, 3)
PLANNED_POLICIES = ("none", "selective", "sqrt", "all")
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class Grid:
    """The configurations a plan dry-runs: every ZeRO stage x checkpointing policy x
    precision x offload label ('none', 'optimizer=cpu|disk', 'optimizer+params=cpu|disk';
    None: the config's own). The other keys are the config's. Policy 'per_block' plans the
    config's own checkpointing.per_block."""

    stages: tuple[int, ...] = STAGES
    policies: tuple[str, ...] = PLANNED_POLICIES
    precisions: tuple[str, ...] = PRECISIONS
    offloads: tuple[str, ...] | None = None
    act_offloads: tuple[str, ...] | None = None  # checkpointing.offload tiers; None: the config's own
    loss_chunks: tuple[int, ...] | None = None  # train.loss_chunk_tokens values; None: the config's own
    mlp_tiles: tuple[int, ...] | None = None  # checkpointing.mlp_tile_tokens values; None: the config's own


def prepare_work(task: Task | Prepared, cfg: EngineConfig, extrapolate: bool = True) -> Task | Prepared:
    """``task`` as ``Prepared`` when its depth can be extrapolated (and ``extrapolate``),
    else ``task`` itself. Builds the model on meta and on fake tensors once (nothing
    allocated); the plan's shallow copies are cut from the first. Raises ValueError for
    a factory that returns no nn.Module."""
    if isinstance(task, Prepared) or not extrapolate:
        return task
    stack = find_stack(task, cfg)
    if stack is None:
        return task
    n_params = sum(p.numel() for p in {id(p): p for p in stack.model.parameters()}.values())
    return Prepared(task, stack, n_params, construction_peak(task.model_fn))


def task_of(work: Task | Prepared) -> Task:
    """The Task itself of ``work``."""
    return work.task if isinstance(work, Prepared) else work


def map_task(work: Task | Prepared, fn: Callable[..., Task], *args: Any, **kwargs: Any) -> Task | Prepared:
    """``work`` with its Task replaced by ``fn(task, *args, **kwargs)`` (e.g. another
    batch or loss), keeping what a ``Prepared`` shares (the model's structure)."""
    if isinstance(work, Prepared):
        return dataclasses.replace(work, task=fn(work.task, *args, **kwargs))
    return fn(work, *args, **kwargs)


def micro_batches(batch: Any, grad_accum: int) -> Any:
    """The batch a dry run steps on: one micro-batch, or ``min(grad_accum, 3)`` copies of it
    (the second already finds the first's gradients, which is all the peaks need; a third
    is a middle micro-batch, neither the first nor the last, whose work the time model
    counts once for each micro-batch not stepped: ``DryRunHooks.micro_batches``)."""
    return [batch] * min(grad_accum, 3) if grad_accum > 1 and not isinstance(batch, list) else batch


def smaller_batch(batch: Any, size: int) -> Any:
    """``batch`` with every tensor cut to its first ``size`` rows (the micro-batch
    dimension); other leaves unchanged."""
    return torch.utils._pytree.tree_map(lambda t: t[:size] if isinstance(t, torch.Tensor) and t.dim() else t, batch)


def resized_batch(batch: Any, size: int) -> Any:
    """``batch`` with every tensor at ``size`` rows (the micro-batch dimension): cut
    (``smaller_batch``), or its rows repeated up to ``size`` (a dry run needs the shapes
    only). Other leaves unchanged."""
    def grow(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or not t.dim() or t.shape[0] >= size:
            return t
        times = -(-size // t.shape[0])
        return t.repeat(times, *([1] * (t.dim() - 1)))[:size]
    return smaller_batch(torch.utils._pytree.tree_map(grow, batch), size)


def batch_size(batch: Any) -> int | None:
    """Rows of the first tensor in ``batch`` (its micro-batch size), or None."""
    leaves = [t for t in torch.utils._pytree.tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim()]
    return int(leaves[0].shape[0]) if leaves else None
