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
import sys
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from mct.config import EngineConfig
from mct.task.chunked import head_loss


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
    if _is_causal_lm(params):
        out = _causal_lm(model, x)
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


def chunked_token_loss(chunk_tokens: int) -> Callable[[nn.Module, tuple], torch.Tensor]:
    """The default loss of a token-id model with chunked linear cross-entropy
    (``mct.task.chunked``): the model is called as the unchunked loss calls it (a
    Hugging Face causal LM as ``model(input_ids=x, use_cache=False)``, any other as
    ``model(x)``), with its output head computing the loss ``chunk_tokens`` tokens at a
    time. Raises ValueError for a model that exposes no output head."""
    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return head_loss(model, lambda: forward_tokens(model, x), y, chunk_tokens)
    loss.__qualname__ = f"chunked_token_loss({chunk_tokens})"
    return loss


def loss_for(cfg: EngineConfig, unchunked: Callable[[nn.Module, tuple], torch.Tensor]
             ) -> Callable[[nn.Module, tuple], torch.Tensor]:
    """A model source's default loss under ``cfg``: ``unchunked`` when
    ``train.loss_chunk_tokens`` is 0, else ``chunked_token_loss`` of that many tokens."""
    return chunk_choices(unchunked)(cfg.train.loss_chunk_tokens)


def chunk_choices(unchunked: Callable[[nn.Module, tuple], torch.Tensor]
                  ) -> Callable[[int], Callable[[nn.Module, tuple], torch.Tensor]]:
    """``Task.loss_for_chunk`` of a default loss: chunk tokens -> the loss of that setting."""
    return lambda chunk: chunked_token_loss(chunk) if chunk > 0 else unchunked


def causal_lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The loss of a Hugging Face causal LM on (input_ids, shifted targets): its logits
    (no labels given, no KV cache kept) scored by ``logits_loss``."""
    x, y = batch
    return logits_loss(_causal_lm(model, x).logits, y)


def forward_tokens(model: nn.Module, x: torch.Tensor):
    """``model``'s output on token ids ``x``: a Hugging Face causal LM (its ``forward``
    takes ``input_ids`` and ``use_cache``) through ``_causal_lm``, any other as ``model(x)``."""
    return _causal_lm(model, x) if _is_causal_lm(inspect.signature(model.forward).parameters) else model(x)


def _is_causal_lm(params) -> bool:
    """Do these ``forward`` parameters take a Hugging Face causal LM's call?"""
    return "use_cache" in params and "input_ids" in params


def _causal_lm(model: nn.Module, x: torch.Tensor):
    """``model(input_ids=x, use_cache=False)``: the model makes its own position ids
    (0..T-1 in every row), so no row packs several sequences, and a real run of a
    transformers model sees that in their values and lets SDPA mask causally by itself.
    On fake tensors (a dry run) the values are not there and transformers would build the
    explicit mask a real run never holds: it is told what the values would show."""
    with _unpacked_positions(x):
        return model(input_ids=x, use_cache=False)


@contextmanager
def _unpacked_positions(x: torch.Tensor) -> Iterator[None]:
    """On a fake ``x`` with transformers' masking utilities loaded: their packed-sequence
    finder answers 'none' (what it answers for the position ids 0..T-1) while the block
    runs. Restores it after. Else nothing."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not is_fake(x) or not hasattr(masking, "find_packed_sequence_indices"):
        yield
        return
    finder = masking.find_packed_sequence_indices
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = finder
