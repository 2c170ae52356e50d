"""Ring attention: the keys and values travel around the context group, one block a step.

Rank r holds its two load-balanced chunks (r and 2N-1-r of 2N, ``layout``). At step s it
holds the key/value block of rank (r - s) mod N; while it attends its queries to that
block, the block moves on to rank r + 1 and the next arrives from rank r - 1 (one
point-to-point exchange, posted before the block's attention and waited after it: the
transfer overlaps the compute). The block's positions and document ids do not travel:
every rank holds the whole window's (the shard), so it derives them from the source rank.

Per block, each pair (query chunk, key chunk) is attended only where the causal mask lets
some query see some key: a key chunk after the query chunk is skipped, the diagonal pair
takes the causal mask, an earlier chunk no causal mask (packed: the document mask). Every
rank attends the same number of pairs (2 a step, 3 for its own block, the diagonal half
masked): the causal load balance. Each pair runs SDPA's CPU flash kernel, which returns
the rows' log-sum-exp with the output; partial outputs merge by log-sum-exp in fp32.

Backward (``_Ring``'s own): the keys and values go around again with their gradients; for
each block the flash kernel's backward, given the final output and log-sum-exp, recomputes
the block's probabilities (nothing of a block is kept from forward) and returns its part of
dQ, dK, dV; a rank adds its dK, dV to the ones that arrived with the block and passes them
on; after N exchanges each block's gradients are back at their owner.
Forward keeps this rank's q, k, v, output and log-sum-exp: 2/N of the window's keys and
values are in memory at once (the own block and the one in flight), not all of them.
Recompute (checkpointing) re-runs the same exchanges and arithmetic: the same bits.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from mct.context.comm import ContextComm
from mct.context.layout import ContextShard, additive

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
"""SDPA's CPU flash kernel and its backward: the output with each row's log-sum-exp, and a
block's gradients from the final output and log-sum-exp (what a ring needs; public SDPA
returns neither)."""

FORWARD, BACKWARD_KV, BACKWARD_GRAD = 1, 2, 3
"""Tags of the ring's exchanges: the backward's blocks and gradients travel at once, to the same rank."""


def ring_attention(comm: ContextComm, shard: ContextShard, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   *, scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """q [B, H, t, D], k, v [B, Hkv, t, D] (Hkv divides H) -> [B, H, t, D]: this rank's
    queries over the window (see the module docstring). Blocks are attended by SDPA's CPU
    flash kernel on the CPU and by ``_math_block`` (fp32 matmuls, any device) elsewhere.
    Raises ValueError for attention dropout (not implemented by the ring)."""
    if dropout_p:
        raise ValueError(f"parallel.context_attention = 'ring' has no attention dropout (dropout_p = {dropout_p}): "
                         f"set model.dropout = 0 or parallel.context_attention = 'all_gather'")
    return _Ring.apply(q, k, v, comm, shard, q.shape[-1] ** -0.5 if scale is None else scale)


class _Ring(torch.autograd.Function):
    """The ring's forward and its own backward (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: ContextComm,
                shard: ContextShard, scale: float) -> torch.Tensor:
        n, r = comm.degree, comm.rank
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for s in range(n):
            pending = comm.exchange(kv, FORWARD) if s < n - 1 else None
            with _scope("mct.ring.attend"):
                for rows, cols, pair in _pairs(shard, n, r, (r - s) % n, q.dtype):
                    _attend_block(q[:, :, rows], kv[:, :, :, cols], pair, scale, out[:, :, rows], lse[:, :, rows])
            if pending is not None:
                with _scope("mct.ring.wait"):
                    kv = pending.wait()
        y = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, y, lse)
        ctx.comm, ctx.shard, ctx.scale = comm, shard, scale
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, y, lse = ctx.saved_tensors
        comm, n, r = ctx.comm, ctx.comm.degree, ctx.comm.rank
        grad = grad.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv, arriving = torch.stack([k, v]), None
        for s in range(n):
            pending = comm.exchange(kv, BACKWARD_KV) if s < n - 1 else None
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            with _scope("mct.ring.attend"):
                for rows, cols, pair in _pairs(ctx.shard, n, r, (r - s) % n, q.dtype):
                    _block_grads(q[:, :, rows], kv[:, :, :, cols], pair, ctx.scale, y[:, :, rows], lse[:, :, rows],
                                 grad[:, :, rows], dq[:, :, rows], dkv[:, :, :, cols])
            with _scope("mct.ring.wait"):
                if arriving is not None:
                    dkv += arriving.wait()  # the block's gradients from the ranks before this one
                arriving = comm.exchange(dkv, BACKWARD_GRAD)
                if pending is not None:
                    kv = pending.wait()
        with _scope("mct.ring.wait"):
            dkv = arriving.wait().to(k.dtype)  # this rank's own block, back with every rank's part
        return dq.to(q.dtype), dkv[0], dkv[1], None, None, None


def _pairs(shard: ContextShard, n: int, r: int, src: int, dtype: torch.dtype) -> list[tuple[slice, slice, Any]]:
    """The (query rows, key columns, ``_PairMask``) pairs rank ``r`` attends in the block of
    rank ``src``: every pair of chunks whose key chunk is not after the query chunk. From the
    sizes alone (the planner's fake tensors have no values)."""
    c = shard.index.shape[0] // 2
    mine, theirs = (r, 2 * n - 1 - r), (src, 2 * n - 1 - src)
    out = []
    for qh, qc in enumerate(mine):
        for kh, kc in enumerate(theirs):
            if kc <= qc:
                out.append((slice(qh * c, (qh + 1) * c), slice(kh * c, (kh + 1) * c),
                            _pair_mask(shard, qc, kc, c, dtype)))
    return out


class _PairMask:
    """How one chunk pair is masked: ``causal`` (the diagonal pair of a window that is one
    sequence: the kernel's own causal mask), or ``mask`` (additive, in the queries' dtype;
    packed windows) with ``empty`` (bool [B or 1, 1, rows]: rows that see no key of the
    pair, whose log-sum-exp the kernel reports as 0 rather than -inf), or neither."""

    def __init__(self, causal: bool = False, mask: torch.Tensor | None = None) -> None:
        self.causal, self.mask = causal, mask
        self.empty = None if mask is None else torch.isneginf(mask).all(-1)


def _pair_mask(shard: ContextShard, qc: int, kc: int, c: int, dtype: torch.dtype) -> _PairMask:
    """The mask of query chunk ``qc`` over key chunk ``kc`` (global chunk numbers), built
    once a micro-batch (see ``_PairMask``)."""
    if shard.segments is None:
        return _PairMask(causal=qc == kc)
    if ("ring", qc, kc, dtype) not in shard.masks:
        device = shard.index.device
        queries = torch.arange(qc * c, (qc + 1) * c, device=device)
        keys = torch.arange(kc * c, (kc + 1) * c, device=device)
        shard.masks["ring", qc, kc, dtype] = _PairMask(mask=additive(shard.mask(queries, keys), dtype))
    return shard.masks["ring", qc, kc, dtype]


def _attend_block(q: torch.Tensor, kv: torch.Tensor, pair: _PairMask, scale: float,
                  out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge one block's attention (SDPA's CPU flash kernel, which also returns the rows'
    log-sum-exp) into the running ``out`` [B, H, rows, D] and ``lse`` [B, H, rows] (fp32
    views; mutated in place). A row that sees no key of the block adds nothing."""
    heads = q.shape[1]
    if q.device.type == "cpu":
        block_out, block_lse = _FLASH(q, _repeat(kv[0], heads), _repeat(kv[1], heads), 0.0, pair.causal,
                                      attn_mask=pair.mask, scale=scale)
    else:
        block_out, block_lse = _math_block(q, _repeat(kv[0], heads), _repeat(kv[1], heads), pair, scale)
    if pair.empty is not None:
        block_lse = block_lse.masked_fill(pair.empty, float("-inf"))
    merged = torch.logaddexp(lse, block_lse)
    safe = _finite(merged)
    out.mul_(torch.exp(lse - safe)[..., None]).add_(block_out.float() * torch.exp(block_lse - safe)[..., None])
    lse.copy_(merged)


def _block_grads(q: torch.Tensor, kv: torch.Tensor, pair: _PairMask, scale: float, y: torch.Tensor,
                 lse: torch.Tensor, dy: torch.Tensor, dq: torch.Tensor, dkv: torch.Tensor) -> None:
    """One block's part of the gradients: adds into ``dq`` [B, H, rows, D] and ``dkv`` [2, B,
    Hkv, keys, D] (fp32 views; mutated). The flash kernel's backward given the final output
    ``y`` and log-sum-exp ``lse`` of these rows computes exactly this block's part."""
    heads = q.shape[1]
    k, v = _repeat(kv[0], heads), _repeat(kv[1], heads)
    if q.device.type == "cpu":
        dq_b, dk_b, dv_b = _FLASH_BACKWARD(dy, q, k, v, y, lse.contiguous(), 0.0, pair.causal,
                                           attn_mask=pair.mask, scale=scale)
    else:
        dq_b, dk_b, dv_b = _math_block_backward(dy, q, k, v, y, lse, pair, scale)
    dq.add_(dq_b)
    dkv[0].add_(_sum_heads(dk_b.float(), kv.shape[2]))
    dkv[1].add_(_sum_heads(dv_b.float(), kv.shape[2]))


def _math_scores(q: torch.Tensor, k: torch.Tensor, pair: _PairMask, scale: float) -> torch.Tensor:
    """fp32 scores [B, H, rows, keys] of one block with its mask (-inf where masked)."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if pair.causal:
        rows, keys = s.shape[-2:]
        s = s.masked_fill(torch.ones(rows, keys, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if pair.mask is not None:
        s = s + pair.mask.float()
    return s


def _math_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pair: _PairMask,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``_FLASH`` returns, by fp32 matmuls on any device: the block's output (q's dtype)
    and each row's log-sum-exp (-inf for a row that sees no key of the block)."""
    s = _math_scores(q, k, pair, scale)
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.exp(s - _finite(lse)[..., None]), v.float()).to(q.dtype), lse


def _math_block_backward(dy: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, y: torch.Tensor,
                         lse: torch.Tensor, pair: _PairMask, scale: float) -> tuple[torch.Tensor, ...]:
    """What ``_FLASH_BACKWARD`` returns (dq, dk, dv of this block, fp32), by fp32 matmuls on
    any device, from the rows' final output ``y`` and log-sum-exp ``lse`` over every block."""
    p = torch.exp(_math_scores(q, k, pair, scale) - _finite(lse)[..., None])
    dyf = dy.float()
    dp = torch.matmul(dyf, v.float().transpose(-1, -2))
    ds = p * (dp - (dyf * y.float()).sum(-1, keepdim=True))
    return (torch.matmul(ds, k.float()) * scale, torch.matmul(ds.transpose(-1, -2), q.float()) * scale,
            torch.matmul(p.transpose(-1, -2), dyf))


def _repeat(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, Hkv, n, D] -> [B, heads, n, D], each key/value head repeated for its query group."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _sum_heads(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The adjoint of ``_repeat``: [B, H, n, D] -> [B, kv_heads, n, D], each query group summed."""
    B, H, n, D = x.shape
    return x if H == kv_heads else x.reshape(B, kv_heads, H // kv_heads, n, D).sum(2)


def _scope(name: str) -> contextlib.AbstractContextManager:
    """A profiler scope named ``name`` while torch.profiler records (where the ring's time
    goes: benchmarks/context_parallel.py), else nothing (no op for the planner's counters)."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


def _finite(x: torch.Tensor) -> torch.Tensor:
    """``x`` with -inf (rows that saw no key) replaced by 0, so exp(-inf - 0) = 0 rather than nan."""
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)
