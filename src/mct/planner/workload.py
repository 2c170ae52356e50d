"""Batch shapes a dry run steps on. What the planner plans is a ``mct.task.Task``
(``Workload`` is its name here, kept for callers of ``mct.planner``)."""

from __future__ import annotations

from typing import Any

import torch

from mct.task.spec import Task as Workload  # noqa: F401 - re-exported


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
