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
"""(model, micro-batch) -> scalar loss tensor."""
OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
"""Called with param groups (dicts with "params"), returns the optimizer over them."""
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
    vocab_size: int | None = None
    """Token ids the model embeds (the corpus must stay below it); None: not known."""
    max_positions: int | None = None
    """The longest sequence the model can embed; None: unbounded or not known."""
    hf_dir: str | None = None
    """The Hugging Face directory the model comes from (config.json and tokenizer files
    that an HF export writes back); None for other sources."""
