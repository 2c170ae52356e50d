"""Chunked linear cross-entropy (``train.loss_chunk_tokens``): the output head's matmul,
the log-softmax and the loss over ``chunk`` tokens at a time, so the [tokens, vocab]
logits never exist, neither in fp32 nor in the compute dtype.

Forward keeps the hidden states, the head's weight (and bias), the targets and one fp32
log-sum-exp per token; backward recomputes one chunk's logits at a time and turns them
into that chunk's gradients. The result is the unchunked loss up to the order of the
reductions: the logits are the compute dtype's matmul (what autocast computes), every
log-softmax statistic and the loss sum are fp32, and the mean is over the tokens whose
target is not ``ignore_index`` (``F.cross_entropy``'s 'mean'; nan when there are none).

How the head is reached: ``head_loss`` runs the model's own forward with its output head
(``get_output_embeddings()``, else the ``lm_head`` attribute) replaced, for that call,
by the chunked loss of its input. The head's weight is therefore used inside the
model's forward, where ZeRO stage 3 has it gathered, and the gradient reaching the
model's output gathers it again before this loss's backward recomputes; the weight's
gradient flows into the parameter like any other (tied or not).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable

from mct.checkpointing.blocks import find_output_head
from mct.task.vocab_slices import HeadRows, sliced_cross_entropy

IGNORE_INDEX = -100
"""Targets with this value do not count (``F.cross_entropy``'s default)."""


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         targets: torch.Tensor, chunk: int, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T + bias`` against ``targets``, ``chunk``
    tokens at a time. hidden [..., C], weight [V, C], bias [V] or None, targets [...]
    int64 -> fp32 scalar. The matmul runs in the autocast dtype when autocast is on (else
    in ``hidden``'s dtype); gradients come back in the inputs' dtypes. Raises ValueError
    for mismatched shapes or ``chunk < 1``."""
    if chunk < 1:
        raise ValueError(f"loss chunk = {chunk} tokens must be >= 1; set train.loss_chunk_tokens >= 1 (0 = off)")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1] or hidden.shape[:-1] != targets.shape:
        raise ValueError(f"chunked cross-entropy needs hidden [..., C], head weight [V, C] and targets [...]; got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)}: the model's output "
                         f"head must be applied last, to the hidden states of the targets' tokens")
    device = hidden.device.type
    compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    return _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias, targets.reshape(-1),
                                     int(chunk), int(ignore_index), compute)


def _logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, compute: torch.dtype) -> torch.Tensor:
    """One chunk's logits: the matmul in ``compute`` (``w``, ``b`` already in it), then
    fp32 (or wider: float64 inputs stay float64)."""
    z = h.to(compute) @ w.t()
    if b is not None:
        z = z + b
    return z.to(_stats(compute))


def _logsumexp_(z: torch.Tensor) -> torch.Tensor:
    """``torch.logsumexp(z, -1)``, the same ops in the same order (bit for bit), but
    ``z`` [n, V] is overwritten instead of copied: torch's makes a [n, V] temporary
    (``z - max``), a chunk's worth of memory traffic the loss does not need."""
    m = z.amax(dim=-1, keepdim=True)
    m.masked_fill_(m.abs() == float("inf"), 0)
    return z.sub_(m).exp_().sum(-1).log_().add_(m.squeeze(1))


def _stats(compute: torch.dtype) -> torch.dtype:
    """The dtype of the log-softmax statistics and the loss: fp32 at least."""
    return torch.promote_types(compute, torch.float32)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, ignore_index, compute):
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute)
            b = bias.to(compute) if bias is not None else None
            n = hidden.shape[0]
            lse = torch.empty(n, dtype=_stats(compute), device=hidden.device)
            total = torch.zeros((), dtype=_stats(compute), device=hidden.device)
            for lo in range(0, n, chunk):
                t = targets[lo:lo + chunk]
                z = _logits(hidden[lo:lo + chunk], w, b, compute)
                picked = z.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
                lse[lo:lo + chunk] = _logsumexp_(z)
                total += ((lse[lo:lo + chunk] - picked) * (t != ignore_index)).sum()
                del z
            count = (targets != ignore_index).sum()
        ctx.save_for_backward(hidden, weight, bias, targets, lse, count)
        ctx.chunk, ctx.ignore_index, ctx.compute = chunk, ignore_index, compute
        return total / count

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        hidden, weight, bias, targets, lse, count = ctx.saved_tensors
        chunk, compute = ctx.chunk, ctx.compute
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute)
            b = bias.to(compute) if bias is not None else None
            scale = grad_out.to(_stats(compute)) / count  # d loss / d (one token's loss)
            grad_h = torch.empty_like(hidden) if need_h else None
            grad_w = torch.zeros_like(weight) if need_w else None
            grad_b = torch.zeros(bias.shape, dtype=_stats(compute), device=bias.device) if need_b else None
            rows = torch.arange(min(chunk, hidden.shape[0]), device=hidden.device)
            for lo in range(0, hidden.shape[0], chunk):
                h, t = hidden[lo:lo + chunk], targets[lo:lo + chunk]
                valid = t != ctx.ignore_index
                p = _logits(h, w, b, compute).sub_(lse[lo:lo + chunk, None]).exp_()  # softmax
                p[rows[:len(t)], t.clamp(min=0)] -= 1.0
                p.mul_((scale * valid).unsqueeze(1))  # ignored tokens: zero rows
                gz = p.to(compute)
                del p
                if need_h:
                    grad_h[lo:lo + chunk] = gz @ w
                if need_w:
                    _accumulate(grad_w, gz.t(), h.to(compute))
                if need_b:
                    grad_b += gz.to(grad_b.dtype).sum(0)
        return (grad_h, grad_w, grad_b.to(bias.dtype) if need_b else None, None, None, None, None)


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b; in place when the dtypes agree (no [V, C] temporary), else the
    product is cast to ``acc``'s dtype (an fp32 weight under a low-precision autocast)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(a @ b)


def output_head(model: nn.Module) -> nn.Module:
    """The module a model applies last to its hidden states to make the logits:
    ``model.get_output_embeddings()`` (Hugging Face models; mct's GPT), else
    ``model.lm_head``. It must hold ``weight`` [vocab, hidden] (and ``bias`` or None).
    Raises ValueError naming the fix when the model exposes none."""
    head = find_output_head(model)
    weight = getattr(head, "weight", None)
    if head is None or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"train.loss_chunk_tokens needs a model that exposes its output head; "
                         f"{type(model).__name__} has none: define get_output_embeddings() returning the "
                         f"nn.Linear its forward applies last to the hidden states (docs/planner.md), or set "
                         f"train.loss_chunk_tokens = 0")
    return head


_ROWS = "_vocab_rows"
"""The attribute of a head module that holds its ``HeadRows`` (``attach_head_rows``)."""


def attach_head_rows(head: nn.Module, rows: HeadRows | None) -> None:
    """From now on the chunked loss reaches ``head``'s (frozen) weight through ``rows``, a
    vocabulary slice at a time (None: detach, the whole weight again). Mutates ``head``."""
    if rows is None:
        head.__dict__.pop(_ROWS, None)
    else:
        head.__dict__[_ROWS] = rows


@contextmanager
def _head_as_loss(head: nn.Module, targets: torch.Tensor, chunk: int) -> Iterator[list]:
    """Within: ``head(hidden)`` returns the chunked loss of ``hidden`` against ``targets``
    (an instance-level ``forward``, as checkpointing patches blocks). Yields the list
    the losses it returned are appended to. Restores the head's ``forward`` on exit."""
    produced: list[torch.Tensor] = []
    had_own = "forward" in head.__dict__
    own = head.__dict__.get("forward")

    rows: HeadRows | None = head.__dict__.get(_ROWS)

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if rows is not None:
            loss = sliced_cross_entropy(hidden, rows, targets, chunk, IGNORE_INDEX)
        else:
            loss = linear_cross_entropy(hidden, head.weight, getattr(head, "bias", None), targets, chunk)
        produced.append(loss)
        return loss
    head.forward = forward
    if rows is not None:
        rows.active = True
    try:
        yield produced
    finally:
        if rows is not None:
            rows.active = False
        if had_own:
            head.forward = own
        else:
            del head.forward


def head_loss(model: nn.Module, call: Callable[[], object], targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """Run ``call()`` (the model's own forward) with its output head turned into the
    chunked cross-entropy against ``targets`` and return that loss. The model must
    return what its head returned, as a tensor or as ``.logits``. Raises ValueError when
    the head is not called exactly once or its output is transformed (e.g. logit
    soft-capping): the chunked loss would not be the model's loss."""
    head = output_head(model)
    with _head_as_loss(head, targets, chunk) as produced:
        out = call()
    result = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    if len(produced) != 1 or result is not produced[0]:
        raise ValueError(f"train.loss_chunk_tokens: {type(model).__name__} does not return its output head's "
                         f"result unchanged (head called {len(produced)} time(s); the logits are transformed "
                         f"after it, e.g. soft-capped or scaled): chunking would change its loss; set "
                         f"train.loss_chunk_tokens = 0")
    return produced[0]
