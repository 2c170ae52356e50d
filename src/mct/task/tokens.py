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

Packed documents (``data.packing = 'documents'``) add a third tensor, ``segments``
int64 [B, T] (``mct.data.packing``): a Hugging Face causal LM is then called with
``position_ids`` restarting at each document and transformers builds the block-causal
mask from them (its packed-sequence support: ``masking_utils.find_packed_sequence_indices``);
a model whose ``forward`` takes ``segments`` (mct's GPT) gets them; any other model
cannot be trained packed (a ValueError naming the fix).
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
from mct.models.documents import document_positions
from mct.task.chunked import head_loss


def token_batch(cfg: EngineConfig) -> tuple[torch.Tensor, ...]:
    """(input_ids, targets): int64 [data.micro_batch_size, model.seq_len] on the meta
    device (shapes only); with ``data.packing = 'documents'`` also the segments (the
    dry run then builds the block-causal mask a real step builds)."""
    shape = (cfg.data.micro_batch_size, cfg.model.seq_len)
    n = 3 if cfg.data.packing == "documents" else 2
    return tuple(torch.zeros(shape, dtype=torch.long, device="meta") for _ in range(n))


def token_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The default loss of a token-id model (see the module docstring). Raises
    ValueError when the model returns neither a loss, logits nor a tensor."""
    x, y = batch[:2]
    params = inspect.signature(model.forward).parameters
    if _is_causal_lm(params) or len(batch) > 2:
        out = forward_tokens(model, x, *batch[2:])
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
    def loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch[:2]
        return head_loss(model, lambda: forward_tokens(model, x, *batch[2:]), y, chunk_tokens)
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


def causal_lm_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The loss of a Hugging Face causal LM on (input_ids, shifted targets[, segments]):
    its logits (no labels given, no KV cache kept) scored by ``logits_loss``."""
    x, y = batch[:2]
    return logits_loss(_causal_lm(model, x, *batch[2:]).logits, y)


def forward_tokens(model: nn.Module, x: torch.Tensor, segments: torch.Tensor | None = None):
    """``model``'s output on token ids ``x`` (packed: documents ``segments``): a Hugging
    Face causal LM (its ``forward`` takes ``input_ids`` and ``use_cache``) through
    ``_causal_lm``, any other as ``model(x)`` (packed: ``model(x, segments)`` when its
    forward takes ``segments``). Raises ValueError for packed documents and a model
    that takes neither position ids nor segments."""
    params = inspect.signature(model.forward).parameters
    if _is_causal_lm(params):
        return _causal_lm(model, x, segments)
    if segments is None:
        return model(x)
    if "segments" not in params:
        raise ValueError(f"data.packing = 'documents' needs a model that keeps attention inside each document: "
                         f"{type(model).__name__}.forward takes neither Hugging Face's position_ids nor segments; "
                         f"add a segments argument (docs/data.md, 'packing') or set data.packing = 'stream'")
    return model(x, segments)


def _is_causal_lm(params) -> bool:
    """Do these ``forward`` parameters take a Hugging Face causal LM's call?"""
    return "use_cache" in params and "input_ids" in params


def _causal_lm(model: nn.Module, x: torch.Tensor, segments: torch.Tensor | None = None):
    """``model(input_ids=x, use_cache=False)``: the model makes its own position ids
    (0..T-1 in every row), so no row packs several sequences, and a real run of a
    transformers model sees that in their values and lets SDPA mask causally by itself.
    Packed (``segments``): ``position_ids`` restart at each document, from which
    transformers finds the documents and builds the block-causal mask. On fake tensors (a
    dry run) the values are not there and transformers would build a mask the real run
    does not: it is told what the values would show."""
    if segments is None:
        with _found_sequences(x, None):
            return model(input_ids=x, use_cache=False)
    with _found_sequences(x, segments):
        return model(input_ids=x, position_ids=document_positions(segments), use_cache=False)


@contextmanager
def _found_sequences(x: torch.Tensor, segments: torch.Tensor | None) -> Iterator[None]:
    """On a fake ``x`` with transformers' masking utilities loaded: their packed-sequence
    finder answers ``segments`` (None: 'none', what it answers for the position ids
    0..T-1; packed: the documents it would find in the position ids) while the block
    runs. Restores it after. Else nothing."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not is_fake(x) or not hasattr(masking, "find_packed_sequence_indices"):
        yield
        return
    finder = masking.find_packed_sequence_indices
    masking.find_packed_sequence_indices = lambda position_ids: segments
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = finder
