"""Defaults for token-id models: the example batch and the causal-LM loss.

The batch is ``(input_ids, targets)``, two int64 ``[data.micro_batch_size, model.seq_len]``
tensors, targets already shifted by one (the sampler's windows). The loss calls a
Hugging Face causal LM (a forward taking ``input_ids`` and ``use_cache``) as
``model(input_ids=x, use_cache=False)``: no labels, which it would shift a second time,
and no KV cache, which changes between a checkpointed block's forward and its
recompute. Another model whose forward takes ``labels`` is called with
``labels=targets`` and its ``.loss`` used; any other as ``model(input_ids)``. Without
a returned loss, the loss is the cross-entropy (in fp32) of the logits it returns (a
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
    params = inspect.signature(model.forward).parameters
    if "use_cache" in params and "input_ids" in params:
        out = model(input_ids=x, use_cache=False)
    elif "labels" in params:
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
    return logits_loss(logits, y)


def logits_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` [..., V] against ``targets`` [...], in fp32
    whatever the autocast dtype."""
    with torch.autocast(logits.device.type, enabled=False):
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def causal_lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The loss of a Hugging Face causal LM on (input_ids, shifted targets): its logits
    (no labels given, no KV cache kept) scored by ``logits_loss``."""
    x, y = batch
    return logits_loss(model(input_ids=x, use_cache=False).logits, y)
