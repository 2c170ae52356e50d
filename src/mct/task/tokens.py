"""Defaults for token-id models: the example batch and the causal-LM loss.

The batch is ``(input_ids, targets)``, two int64 ``[data.micro_batch_size, model.seq_len]``
tensors; the loss calls the model with ``labels=targets`` when its forward takes
``labels`` (Hugging Face causal LMs) and uses the returned ``.loss``, else calls
``model(input_ids)`` and takes the cross-entropy (in fp32) of the logits it returns (a
tensor, or an object with ``.logits``).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn
import torch.nn.functional as F

from mct.config import EngineConfig


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
