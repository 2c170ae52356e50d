"""The chunked loss with a frozen output head streamed in vocabulary slices
(``train.loss_vocab_slice``): the head's weight is never held whole, only one slice of its
rows at a time, and the logits only as one [chunk, slice] block.

Forward, for each slice of rows (outer loop) and each chunk of tokens (inner): the block's
logits in the compute dtype, then fp32; an online log-sum-exp per token (running maximum and
rescaled sum) and the target's logit picked from the slice that holds it. Backward gathers the
slices again and recomputes each block: softmax minus the target's one-hot, times the upstream
gradient, and d(hidden) += dlogits_block @ W_slice, summed in fp32 over the slices. Slices
are the outer loop so a sharded head is gathered once per forward and once per backward,
slice by slice, with the same collectives on every rank whatever its token count.

Where the rows come from (``HeadRows``): a frozen head that is a sharded unit of its own
(``mct.zero.frozen``, stages 1-3) lays its shards on whole rows, rank r holding rows
[r * R, (r + 1) * R); a slice is rows [r * R + lo, r * R + hi) of every rank, one all-gather
of the same sub-range of every rank's shard (``FrozenUnit.gather_rows``). Rows past the
vocabulary (the last shard's padding) are masked out of the logits. Any other frozen head
(stage 0, a tied head in the root unit) is sliced as views of its weight, one part.

The result equals the unsliced chunked loss up to the order of the fp32 reductions.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch.autograd.function import once_differentiable


class HeadRows:
    """A frozen head's weight [vocab, C], reachable a vocabulary slice at a time.
    ``block(lo, hi)`` returns rows [p * per_part + lo, p * per_part + hi) of every part
    p < ``parts``, as one [parts * (hi - lo), C] tensor (collective when the head is
    sharded: every rank must call it with the same arguments in the same order). Rows at
    or past ``vocab`` (padding) count as absent. ``slice_rows``: rows per slice in all
    (``train.loss_vocab_slice``), at least one per part. ``active`` is True while the head's
    call runs as this loss (``mct.task.chunked``): the stage-3 lifecycle then gathers nothing
    for it."""

    def __init__(self, block: Callable[[int, int], torch.Tensor], *, parts: int, per_part: int, vocab: int,
                 slice_rows: int) -> None:
        if slice_rows < 1:
            raise ValueError(f"train.loss_vocab_slice = {slice_rows} rows must be >= 1 (0 = the whole head)")
        assert parts >= 1 and per_part >= 1 and parts * per_part >= vocab, (parts, per_part, vocab)
        self.block, self.parts, self.per_part, self.vocab = block, parts, per_part, vocab
        self.step = math.ceil(slice_rows / parts)  # rows of each part per slice
        self.active = False

    def slices(self) -> list[tuple[int, int]]:
        """The (lo, hi) row ranges within every part, in order."""
        return [(lo, min(lo + self.step, self.per_part)) for lo in range(0, self.per_part, self.step)]

    def columns(self, lo: int, hi: int, targets: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor,
                                                                        torch.Tensor]:
        """For slice [lo, hi): the mask of its padding columns [parts * (hi - lo)] (None when
        none), and, per token, whether its target lies in the slice and at which column."""
        width = hi - lo
        ids = (torch.arange(self.parts, device=targets.device)[:, None] * self.per_part
               + torch.arange(lo, hi, device=targets.device)[None, :]).reshape(-1)
        padded = (self.parts - 1) * self.per_part + hi > self.vocab  # decided on shapes: no data read
        t = targets.clamp(min=0)
        j = t % self.per_part
        inside = (j >= lo) & (j < hi) & (targets >= 0)
        col = ((t // self.per_part) * width + (j - lo)).clamp(0, self.parts * width - 1)
        return (ids >= self.vocab if padded else None), inside, col


def sliced_cross_entropy(hidden: torch.Tensor, rows: HeadRows, targets: torch.Tensor, chunk: int,
                         ignore_index: int) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ W.T`` against ``targets`` (hidden [..., C], targets
    [...] int64 -> fp32 scalar; W reached through ``rows``, frozen: no gradient for it),
    ``chunk`` tokens by one slice of W at a time. The matmul runs in the autocast dtype
    when autocast is on (else ``hidden``'s). Raises ValueError for ``chunk < 1`` or
    mismatched shapes."""
    if chunk < 1:
        raise ValueError(f"loss chunk = {chunk} tokens must be >= 1; set train.loss_chunk_tokens >= 1 (0 = off)")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"chunked cross-entropy needs hidden [..., C] and targets [...]; got {tuple(hidden.shape)}, "
                         f"{tuple(targets.shape)}: the model's output head must be applied last, to the hidden "
                         f"states of the targets' tokens")
    device = hidden.device.type
    compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    return _SlicedCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1), rows, int(chunk),
                                     int(ignore_index), compute)


def _stats(compute: torch.dtype) -> torch.dtype:
    return torch.promote_types(compute, torch.float32)


def _block_logits(h: torch.Tensor, w: torch.Tensor, pad: torch.Tensor | None, compute: torch.dtype) -> torch.Tensor:
    """One [chunk, slice] block of logits, in the statistics' dtype; padding columns -inf."""
    z = (h.to(compute) @ w.t()).to(_stats(compute))
    if pad is not None:
        z.masked_fill_(pad, float("-inf"))
    return z


def _online_lse_(m: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> None:
    """Fold block ``z`` [n, k] into the running maximum ``m`` [n] and the sum ``s`` [n] of
    exp(logit - m). Mutates ``m``, ``s`` and ``z`` (overwritten)."""
    new = torch.maximum(m, z.amax(dim=-1))
    shift = new.masked_fill(new.abs() == float("inf"), 0)
    s.mul_(torch.exp(m - shift)).add_(z.sub_(shift[:, None]).exp_().sum(-1))
    m.copy_(shift)


class _SlicedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, targets, rows, chunk, ignore_index, compute):
        stats = _stats(compute)
        n = hidden.shape[0]
        with torch.autocast(hidden.device.type, enabled=False):
            m = torch.full((n,), float("-inf"), dtype=stats, device=hidden.device)
            s = torch.zeros(n, dtype=stats, device=hidden.device)
            picked = torch.zeros(n, dtype=stats, device=hidden.device)
            for lo, hi in rows.slices():
                w = rows.block(lo, hi).to(compute)
                pad, inside, col = rows.columns(lo, hi, targets)
                for a in range(0, n, chunk):
                    z = _block_logits(hidden[a:a + chunk], w, pad, compute)
                    mine = z.gather(1, col[a:a + chunk, None]).squeeze(1)
                    picked[a:a + chunk] += torch.where(inside[a:a + chunk], mine, 0)
                    _online_lse_(m[a:a + chunk], s[a:a + chunk], z)
                    del z
                del w
            lse = s.log_().add_(m)
            valid = targets != ignore_index
            total = ((lse - picked) * valid).sum()
            count = valid.sum()
        ctx.save_for_backward(hidden, targets, lse, count)
        ctx.rows, ctx.chunk, ctx.ignore_index, ctx.compute = rows, chunk, ignore_index, compute
        return total / count

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        hidden, targets, lse, count = ctx.saved_tensors
        rows, chunk, compute = ctx.rows, ctx.chunk, ctx.compute
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        stats = _stats(compute)
        n = hidden.shape[0]
        with torch.autocast(hidden.device.type, enabled=False):
            weight = (grad_out.to(stats) / count) * (targets != ctx.ignore_index)  # d loss / d token loss
            grad_h = torch.zeros(hidden.shape, dtype=stats, device=hidden.device)
            for lo, hi in rows.slices():
                w = rows.block(lo, hi).to(compute)
                pad, inside, col = rows.columns(lo, hi, targets)
                for a in range(0, n, chunk):
                    p = _block_logits(hidden[a:a + chunk], w, pad, compute).sub_(lse[a:a + chunk, None]).exp_()
                    p.scatter_add_(1, col[a:a + chunk, None], -inside[a:a + chunk, None].to(stats))
                    p.mul_(weight[a:a + chunk, None])
                    gz = p.to(compute)
                    del p
                    part = gz @ w
                    if part.dtype == stats:
                        grad_h[a:a + chunk] += part
                    else:
                        grad_h[a:a + chunk] += part.to(stats)
                    del gz, part
                del w
        return grad_h.to(hidden.dtype), None, None, None, None, None


def head_rows(head: torch.nn.Module | None, unit, comm, slice_rows: int) -> HeadRows | None:
    """How the chunked loss reaches a frozen head ``head`` in slices of ``slice_rows`` rows:
    through ``unit`` (its frozen unit, ``mct.zero.frozen.FrozenUnit``, when it has one of its
    own: ``gather_rows`` over ``comm``), else as views of its weight. None (the whole head,
    as before) when ``slice_rows`` is 0, the head trains, has a bias, or its unit's shards
    do not hold whole rows."""
    weight = getattr(head, "weight", None)
    if not slice_rows or head is None or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    params = list(head.parameters())
    if len(params) != 1 or params[0] is not weight or weight.requires_grad:
        return None
    if unit is None:
        return HeadRows(lambda lo, hi: head.weight[lo:hi], parts=1, per_part=weight.shape[0],
                        vocab=weight.shape[0], slice_rows=slice_rows)
    row = unit.row_length()
    if not row:
        return None
    return HeadRows(lambda lo, hi: unit.gather_rows(comm, lo, hi), parts=unit.layout.world,
                    per_part=unit.layout.shard_numel // row, vocab=weight.shape[0], slice_rows=slice_rows)
