"""What the planner plans: a model factory, a loss, one rank's micro-batch, and the
optimizer the engine would be given; and ``--model pkg.module:factory`` modules.

A module named by ``mct plan --model pkg.module:factory`` provides ``factory()``, a
function with no arguments returning the ``nn.Module`` (it is called under
``torch.device('meta')``, so it must not load weights or move tensors by itself).
Optionally, at module level:

- ``loss_fn(model, batch) -> scalar tensor``: the loss the model is trained with;
- ``example_batch(config) -> batch``: one rank's micro-batch (real, meta or fake
  tensors; only shapes and dtypes matter), given the resolved ``EngineConfig``;
- ``optimizer(groups) -> torch.optim.Optimizer``: the factory ``mct.Engine`` takes;
- ``param_groups(model) -> list[dict]``: the engine's ``param_groups``.

Defaults, for token-id models: the batch is ``(input_ids, targets)``, two int64
``[data.micro_batch_size, model.seq_len]`` tensors; the loss calls the model with
``labels=targets`` when its forward takes ``labels`` (Hugging Face causal LMs) and
uses the returned ``.loss``, else calls ``model(input_ids)`` and takes the
cross-entropy (in fp32) of the logits it returns (a tensor, or an object with
``.logits``); the optimizer is ``mct.Engine``'s default, AdamW over one group.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from mct.config import EngineConfig
from mct.planner.dry_run import LossFn, ModelFn, OptimizerFactory, ParamGroupsFn


@dataclass(frozen=True)
class Workload:
    """Everything a dry run needs besides the engine config. ``batch``: one rank's
    micro-batch, or a list of micro-batches (gradient accumulation)."""

    model_fn: ModelFn
    loss_fn: LossFn
    batch: Any
    optimizer: OptimizerFactory | None = None
    param_groups: ParamGroupsFn | None = None
    label: str = "model"


def token_batch(cfg: EngineConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, targets): int64 [data.micro_batch_size, model.seq_len] on the meta
    device (shapes only)."""
    shape = (cfg.data.micro_batch_size, cfg.model.seq_len)
    return (torch.zeros(shape, dtype=torch.long, device="meta"), torch.zeros(shape, dtype=torch.long, device="meta"))


def token_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The default loss of a token-id model (see the module docstring). Raises
    ValueError when the model returns neither a loss, logits nor a tensor."""
    x, y = batch
    if "labels" in inspect.signature(model.forward).parameters:
        out = model(input_ids=x, labels=y)
    else:
        out = model(x)
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"the model returned {type(out).__name__}, which has no .loss or .logits: define "
                         f"loss_fn(model, batch) in the --model module")
    with torch.autocast(logits.device.type, enabled=False):
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


def load_workload(path: str, cfg: EngineConfig) -> Workload:
    """'pkg.module:factory' -> the Workload of that module (convention above).
    Raises ValueError naming the path for a bad import, a missing or non-callable
    factory, or a non-callable hook."""
    mod_name, _, attr = path.partition(":")
    if not mod_name or not attr:
        raise ValueError(f"--model {path!r} must look like 'package.module:factory'")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"--model {path!r}: cannot import {mod_name!r} ({e}); is it on PYTHONPATH?") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--model {path!r}: {mod_name} has no function {attr!r} returning an nn.Module")
    hooks: dict[str, Callable | None] = {}
    for name in ("loss_fn", "example_batch", "optimizer", "param_groups"):
        hook = getattr(module, name, None)
        if hook is not None and not callable(hook):
            raise ValueError(f"--model {path!r}: {mod_name}.{name} must be a function, got {type(hook).__name__}")
        hooks[name] = hook
    batch = hooks["example_batch"](cfg) if hooks["example_batch"] else token_batch(cfg)
    return Workload(model_fn=factory, loss_fn=hooks["loss_fn"] or token_loss, batch=batch,
                    optimizer=hooks["optimizer"], param_groups=hooks["param_groups"], label=path)


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
