"""The context split's pure parts: which tokens each rank holds, the masks it builds,
the batch it cuts, and the config's one-line errors."""

from __future__ import annotations

import pytest
import torch

from mct.config import EngineConfig
from mct.context import data_parallel, gathered_order, rank_indices, shard_batch
from mct.models.documents import block_causal_mask


@pytest.mark.parametrize("degree", [1, 2, 3, 4])
def test_ranks_hold_every_token_once_with_equal_causal_work(degree):
    T = 8 * degree
    held = [rank_indices(T, degree, r) for r in range(degree)]
    assert torch.equal(torch.cat(held).sort().values, torch.arange(T))
    assert torch.equal(gathered_order(T, degree), torch.cat(held))
    work = {int((idx + 1).sum()) for idx in held}  # keys a causal query attends: its position + 1
    assert len(work) == 1


def test_rank_holds_chunk_r_and_its_mirror():
    assert rank_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert rank_indices(8, 2, 1).tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("packed", [False, True])
def test_shard_masks_are_the_rows_and_columns_of_the_window_mask(packed):
    T, degree = 12, 3
    segments = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [0] * 2 + [1] * 10]) if packed else None
    x = torch.arange(2 * T).reshape(2, T)
    batch = (x, x, segments) if packed else (x, x)
    full = block_causal_mask(segments) if packed else torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    for rank in range(degree):
        local, shard = shard_batch(batch, degree, rank)
        assert torch.equal(local[0], x[:, shard.index])
        gather = shard.mask(shard.index, shard.order)
        assert torch.equal(gather.expand(2, 1, -1, -1), full[:, :, shard.index][:, :, :, shard.order].expand(2, 1, -1, -1))
        heads = shard.mask(shard.order, shard.order)
        assert torch.equal(heads.expand(2, 1, -1, -1), full[:, :, shard.order][:, :, :, shard.order].expand(2, 1, -1, -1))


def test_packed_positions_restart_at_documents_that_cross_the_split():
    segments = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])  # document 1 crosses both split points
    x = torch.zeros_like(segments)
    _, shard = shard_batch((x, x, segments, 7), 2, 1)  # a trailing seed passes through
    assert shard.positions.tolist() == [[2, 0, 1, 2]]  # global tokens 2, 3, 4, 5


def test_a_window_that_does_not_split_is_refused():
    x = torch.zeros(1, 10, dtype=torch.long)
    with pytest.raises(ValueError, match="2 x parallel.context = 4"):
        shard_batch((x, x), 2, 0)


def test_config_refuses_a_window_that_does_not_split_and_a_world_the_degree_does_not_divide():
    with pytest.raises(ValueError, match=r"model.seq_len = 128 .* multiple of 2 x parallel.context = 6"):
        EngineConfig.from_dict({"parallel": {"context": 3}})
    with pytest.raises(ValueError, match=r"parallel.context_attention = 'rings' .* 'ring'"):
        EngineConfig.from_dict({"parallel": {"context_attention": "rings"}})
    with pytest.raises(ValueError, match=r"parallel.context = 2 must divide the number of ranks \(3\)"):
        data_parallel(0, 3, 2)
    assert data_parallel(5, 6, 2) == (2, 3)
    assert EngineConfig.from_dict({"model": {"seq_len": 13}}).parallel.context == 1  # degree 1: any window
