"""What is trained: a Task is everything the engine, the planner and the run need to
know about a model besides the engine config: how to build it, its loss, one rank's
example micro-batch, and the optimizer and parameter groups the engine is given."""

from __future__ import annotations

import dataclasses
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
    loss_for_chunk: Callable[[int], LossFn] | None = None
    """The default loss for a ``train.loss_chunk_tokens`` value (0 = unchunked), so the
    planner can plan loss chunking on and off; None: the loss is the user's own."""


def with_loss_chunk(task: Task, chunk_tokens: int) -> Task:
    """``task`` trained with ``train.loss_chunk_tokens = chunk_tokens``: its loss_fn
    swapped for the default loss of that setting; ``task`` itself when its loss is the
    user's own (``loss_for_chunk`` None)."""
    if task.loss_for_chunk is None:
        return task
    return dataclasses.replace(task, loss_fn=task.loss_for_chunk(chunk_tokens))
