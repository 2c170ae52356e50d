"""The ring's schedule: which chunk pairs each rank attends, and what it refuses."""

from __future__ import annotations

import pytest
import torch

from mct.context.layout import shard_batch
from mct.context.ring import (_FLASH, _FLASH_BACKWARD, _PairMask, _math_block, _math_block_backward, _pairs,
                              ring_attention)


@pytest.mark.parametrize("degree", [2, 3, 4])
def test_every_causal_query_key_pair_is_attended_once_with_equal_work_per_rank(degree):
    T = 8 * degree
    counts = torch.zeros(T, T, dtype=torch.int64)
    work = []
    for r in range(degree):
        _, shard = shard_batch((torch.zeros(1, T, dtype=torch.int64),) * 2, degree, r)
        cells = 0
        for s in range(degree):
            src = (r - s) % degree
            _, src_shard = shard_batch((torch.zeros(1, T, dtype=torch.int64),) * 2, degree, src)
            for rows, cols, pair in _pairs(shard, degree, r, src, torch.float32):
                q, k = shard.index[rows], src_shard.index[cols]
                causal = k[None, :] <= q[:, None]
                assert pair.causal == (not bool(causal.all())) and pair.mask is None  # masked only on the diagonal
                counts[q[:, None], k[None, :]] += causal.long() if pair.causal else 1
                cells += rows.stop - rows.start
        work.append(cells)
    assert torch.equal(counts, torch.ones(T, T, dtype=torch.int64).tril())  # every (query, earlier key) once
    assert len(set(work)) == 1, work  # the causal load balance: every rank attends as many rows x chunks


def test_attention_dropout_is_refused_with_the_keys_to_change():
    _, shard = shard_batch((torch.zeros(1, 8, dtype=torch.int64),) * 2, 2, 0)
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="model.dropout = 0 or parallel.context_attention"):
        ring_attention(None, shard, q, q, q, dropout_p=0.1)


def _pairs_to_check(rows: int) -> list:
    mask = torch.zeros(2, 1, rows, rows)
    mask[0, :, :, 3:] = float("-inf")  # documents: some keys hidden
    mask[1, :, 2] = float("-inf")  # a row that sees no key of the block
    return [_PairMask(), _PairMask(causal=True), _PairMask(mask=mask)]


@pytest.mark.parametrize("which", [0, 1, 2])
def test_the_math_block_kernel_other_devices_use_equals_the_cpu_flash_kernel(which):
    """Off the CPU a block is attended by fp32 matmuls (``_math_block`` and its backward): the
    same output, log-sum-exp and gradients as SDPA's CPU flash kernel within 1e-6."""
    torch.manual_seed(0)
    B, H, n, D = 2, 2, 6, 8
    pair = _pairs_to_check(n)[which]
    q, k, v, dy = (torch.randn(B, H, n, D, dtype=torch.float64).float() for _ in range(4))
    out, lse = _FLASH(q, k, v, 0.0, pair.causal, attn_mask=pair.mask, scale=D ** -0.5)
    m_out, m_lse = _math_block(q, k, v, pair, D ** -0.5)
    seen = torch.isfinite(m_lse)
    assert torch.allclose(out, m_out, atol=1e-6) and torch.allclose(lse[seen], m_lse[seen], atol=1e-6)
    assert which != 2 or not bool(seen.all())  # the empty row is there: the check above is not vacuous
    final = m_lse.masked_fill(~seen, 0.5)  # the rows' log-sum-exp over every block (the empty row saw others)
    got = _FLASH_BACKWARD(dy, q, k, v, out, final, 0.0, pair.causal, attn_mask=pair.mask, scale=D ** -0.5)
    mine = _math_block_backward(dy, q, k, v, out, final, pair, D ** -0.5)
    for a, b in zip(got, mine):
        assert torch.allclose(a.float(), b, atol=1e-6), (a - b).abs().max()
