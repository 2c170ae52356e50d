"""What is trained: a Task is everything the engine, the planner and the run need to
know about a model besides the engine config: how to build it, its loss, one rank's
example micro-batch, and the optimizer and parameter groups the engine is given."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

ModelFn = Callable[[], nn.Module]
LossFn = Callable[[nn.Module, Any], torch.Tensor]
OptimizerFactory = Callable[[list], torch.optim.Optimizer]
ParamGroupsFn = Callable[[nn.Module], list]


@dataclass(frozen=True)
class Task:
    """Everything a dry run needs besides the engine config. ``batch``: one rank's
    micro-batch, or a list of micro-batches (gradient accumulation)."""

    model_fn: ModelFn
    loss_fn: LossFn
    batch: Any
    optimizer: OptimizerFactory | None = None
    param_groups: ParamGroupsFn | None = None
    label: str = "model"
