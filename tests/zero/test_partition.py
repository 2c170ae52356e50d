"""Flat-buffer layout math (mct.zero.partition): offsets, padding, shards, buckets,
and the ZeRO model-state formula."""

from __future__ import annotations

import math

import pytest
import torch

from mct.zero.partition import ALIGN_ELEMENTS, bucket_slices, build_layout, model_state_bytes

SHAPES = [torch.Size([3, 5]), torch.Size([7]), torch.Size([1]), torch.Size([4, 4])]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_layout_aligns_every_parameter_and_pads_to_world(world):
    layout = build_layout(["a", "b", "c", "d"], SHAPES, world)
    assert all(off % ALIGN_ELEMENTS == 0 for off in layout.offsets)
    ends = [off + n for off, n in zip(layout.offsets, layout.numels())]
    assert all(e <= nxt for e, nxt in zip(ends, layout.offsets[1:])), "parameters overlap"
    assert layout.numel == ends[-1]
    assert layout.padded_numel % world == 0
    assert 0 <= layout.padding < world
    assert layout.shard_numel * world == layout.padded_numel


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_shards_tile_the_buffer_and_pieces_cover_each_parameter_once(world):
    layout = build_layout(["a", "b", "c", "d"], SHAPES, world)
    ranges = [layout.shard_range(r) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layout.padded_numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    covered = [0] * len(SHAPES)
    for r in range(world):
        lo, hi = ranges[r]
        for i, a, b, at in layout.param_pieces(r):
            assert 0 <= a < b <= layout.numels()[i]
            assert lo + at == layout.offsets[i] + a and lo + at + (b - a) <= hi
            covered[i] += b - a
    assert covered == list(layout.numels())


def test_shard_range_rejects_a_rank_outside_the_world():
    layout = build_layout(["a"], [torch.Size([10])], 2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        layout.shard_range(2)


def test_empty_unit_still_gives_every_rank_one_element_and_world_must_be_positive():
    assert build_layout([], [], 3).padded_numel == 3
    with pytest.raises(ValueError, match="world size must be >= 1, got 0"):
        build_layout(["a"], [torch.Size([1])], 0)


@pytest.mark.parametrize("shard,world,esize,bucket", [(10, 2, 4, 16), (10, 2, 4, 1), (1000, 4, 2, 2**20), (7, 3, 4, 25)])
def test_bucket_slices_cover_the_columns_within_the_byte_budget(shard, world, esize, bucket):
    slices = bucket_slices(shard, world, esize, bucket)
    assert slices[0][0] == 0 and slices[-1][1] == shard
    assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))
    for a, b in slices:
        assert b > a
        assert (b - a) == 1 or (b - a) * world * esize <= bucket


def test_model_state_formula_per_stage_fp32_adam():
    n, world = 1000, 4
    kw = dict(param_bytes=4, grad_bytes=4, master_bytes=0, optim_bytes_per_param=8)
    total = {s: sum(model_state_bytes(n, world, s, **kw).values()) for s in range(4)}
    # Rajbhandari et al. 2020 with fp32 weights doubling as the master: 16, 4+4+8/N, 4+12/N, 16/N
    assert total == {0: 16 * n, 1: (8 + 8 / world) * n, 2: (4 + 12 / world) * n, 3: 16 * n / world}


def test_model_state_formula_bf16_stage3_keeps_only_the_master_shard():
    n, world = 1000, 2
    kw = dict(param_bytes=2, grad_bytes=4, master_bytes=4, optim_bytes_per_param=8)
    s1 = model_state_bytes(n, world, 1, **kw)
    assert s1 == {"params": 2 * n, "grads": 4 * n, "master": 4 * n / world, "optimizer": 8 * n / world}
    s3 = model_state_bytes(n, world, 3, **kw)
    assert s3 == {"params": 0, "grads": 4 * n / world, "master": 4 * n / world, "optimizer": 8 * n / world}
    assert math.isclose(sum(s3.values()), 16 * n / world)


def test_model_state_formula_rejects_an_unknown_stage():
    with pytest.raises(ValueError, match="zero.stage must be 0, 1, 2 or 3, got 4"):
        model_state_bytes(10, 2, 4, param_bytes=4, grad_bytes=4, master_bytes=0, optim_bytes_per_param=8)


def test_simulated_comm_runs_the_bucketing_with_shape_checked_no_op_collectives():
    """The planner's Comm: same code as the real one (buckets, temporaries, stats), raw
    collectives that only check shapes; a world of 4 exists only on paper."""
    import torch

    from mct.dist import DistContext
    from mct.zero.comm import Comm
    comm = Comm(DistContext.simulated(4), bucket_bytes=16)
    full, out = torch.arange(12.0), torch.zeros(3)
    comm.reduce_scatter(full, out)
    assert out.tolist() == [0.0, 0.0, 0.0] and comm.stats.calls == 1 and comm.stats.bytes == 48
    comm.all_gather(torch.ones(3), full)
    assert comm.all_gather_object("x") == ["x"] * 4
    with pytest.raises(AssertionError):  # one bucket: straight to the raw collective
        Comm(DistContext.simulated(4), bucket_bytes=2**20).all_gather(torch.ones(3), torch.zeros(10))
    with pytest.raises(ValueError, match="world size"):
        DistContext.simulated(0)


def test_a_shard_of_padding_only_starts_block_aligned_past_the_end():
    """64 elements over 2 ranks in 256-element shards: rank 1 holds padding only. The
    optimizer places it at 256 on the padded index (block-aligned, where ``extent``
    clamps its empty piece to 64), and it holds no per-block entry, after the last one."""
    from types import SimpleNamespace

    from mct.zero.state_io import block_extent, extent, shard_start
    unit = SimpleNamespace(name="u", layout=build_layout(["w"], [torch.Size([64])], 2, shard_align=256))
    assert [extent(unit, r) for r in (0, 1)] == [(0, 64), (64, 0)]
    assert [shard_start(unit, r) for r in (0, 1)] == [0, 256]
    assert [block_extent(unit, r, 256) for r in (0, 1)] == [(0, 1), (1, 0)]
