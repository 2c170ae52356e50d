"""The ring's schedule: which chunk pairs each rank attends, and what it refuses."""

from __future__ import annotations

import pytest
import torch

from mct.context.layout import shard_batch
from mct.context.ring import _pairs, ring_attention


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


def test_attention_dropout_and_a_device_without_its_kernel_are_refused_with_the_keys_to_change():
    _, shard = shard_batch((torch.zeros(1, 8, dtype=torch.int64),) * 2, 2, 0)
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="model.dropout = 0 or parallel.context_attention"):
        ring_attention(None, shard, q, q, q, dropout_p=0.1)
    q = q.to("meta")
    with pytest.raises(ValueError, match="no meta kernel yet: set parallel.context_attention = 'all_gather'"):
        ring_attention(None, shard, q, q, q)
