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


class _Watched:
    """Collectives of a world whose ranks all hold what this one does, moving real data,
    that count how many bucket temporaries are alive at each call."""

    def __init__(self, world: int, rank: int) -> None:
        import weakref
        self.world, self.rank, self.ref, self.seen, self.most = world, rank, weakref.ref, [], 0

    def _watch(self, t) -> None:
        self.seen.append(self.ref(t if t._base is None else t._base))
        self.most = max(self.most, sum(r() is not None for r in self.seen))

    def reduce_scatter(self, out, inp):
        self._watch(inp)
        out.copy_(self.world * inp.view(self.world, -1)[self.rank])
        return self

    def all_gather(self, out, inp):
        self._watch(out)
        out.copy_(inp.repeat(self.world).view(out.shape))
        return self

    def wait(self) -> None:
        pass


def test_bucketed_collectives_keep_at_most_their_window_of_buckets_alive(monkeypatch):
    """A reduce-scatter split into 10 buckets, given a window of IN_FLIGHT_BUCKETS (2,
    the root unit's), holds at most that many buckets' temporaries at once (without one:
    all 10, a block's, overlapping its backward), lands every column where it belongs,
    and its pending result does not keep its input alive (the full gradient is freed once
    the call returns). An all-gather of 10 buckets has no temporaries: each bucket lands
    in its columns of the output (every call writes a view of it). A HeldGrads source
    (gradients kept as they arrived) reduces as its flat buffer does, bit for bit."""
    import weakref

    from mct.dist import DistContext
    from mct.zero import comm as comm_module
    from mct.zero.flat import HeldGrads
    from mct.zero.partition import build_layout
    monkeypatch.setattr(comm_module, "BUCKETS_AS_ONE", False)  # bucket by bucket, as on real ranks
    assert comm_module.window_numels([4, 4, 4, 2]) == (8, 6) and comm_module.window_numels([4, 3], None) == (7, 7)
    world, S, k = 4, 1000, comm_module.IN_FLIGHT_BUCKETS
    comm = comm_module.Comm(DistContext.simulated(world), bucket_bytes=100 * world * 4)  # 100 columns a bucket
    comm.ops = ops = _Watched(world, comm.rank)
    for window, most in ((k, k), (None, 10)):
        ops.seen, ops.most = [], 0
        full, out = torch.arange(world * S, dtype=torch.float32), torch.zeros(S)
        pending = comm.reduce_scatter(full, out, async_op=True, window=window)
        gone = weakref.ref(full)
        del full
        assert len(ops.seen) == 10 and ops.most == most and gone() is None, (window, ops.most)
        pending.wait()
        lo = comm.rank * S
        assert torch.equal(out, world * torch.arange(lo, lo + S, dtype=torch.float32))
        ops.seen, ops.most = [], 0
        shard, full = torch.arange(S, dtype=torch.float32), torch.zeros(world * S)
        comm.all_gather(shard, full, async_op=True, window=window).wait()
        assert len(ops.seen) == 10 and all(r() is full for r in ops.seen) and torch.equal(full, shard.repeat(world))
    # ragged parameters across shard edges, arriving out of order, one of them twice
    shapes = [torch.Size([37, 21]), torch.Size([5]), torch.Size([1500, 2])]
    layout = build_layout(["a", "b", "c"], shapes, world)
    gen = torch.Generator().manual_seed(0)
    grads = [(i, torch.randn(shapes[i], generator=gen).to(torch.bfloat16)) for i in (2, 0, 1, 0)]
    flat = torch.zeros(layout.padded_numel)
    for i, gr in grads:
        flat[layout.offsets[i]:layout.offsets[i] + gr.numel()].add_(gr.reshape(-1))
    S = layout.shard_numel
    comm = comm_module.Comm(DistContext.simulated(world), bucket_bytes=50 * world * 4)
    comm.ops = _Watched(world, comm.rank)
    want, got = torch.zeros(S), torch.zeros(S)
    comm.reduce_scatter(flat, want, window=k)
    comm.reduce_scatter(HeldGrads(layout, grads, torch.float32, flat.device), got, window=k)
    assert torch.equal(got, want) and got.abs().sum() > 0


@pytest.mark.parametrize("world", [1, 3, 8, 64])
def test_held_gradients_fill_every_rank_column_window_as_the_flat_buffer(world):
    """HeldGrads.fill gives, for any column window [a, b), every rank's row of the flat
    gradient viewed as [world, S], bit for bit as adding the arrivals (out of order, one
    parameter twice, parameters across many shards) into a zeroed flat buffer."""
    from mct.zero.flat import HeldGrads
    from mct.zero.partition import build_layout
    shapes = [torch.Size([37, 21]), torch.Size([5]), torch.Size([1500, 2]), torch.Size([1])]
    layout = build_layout(["a", "b", "c", "d"], shapes, world)
    gen = torch.Generator().manual_seed(world)
    grads = [(i, torch.randn(shapes[i], generator=gen).to(torch.bfloat16)) for i in (2, 0, 3, 1, 0)]
    grads.append((2, torch.randn(shapes[2][::-1], generator=gen).t()))  # not contiguous
    flat = torch.zeros(layout.padded_numel)
    for i, gr in grads:
        flat[layout.offsets[i]:layout.offsets[i] + gr.numel()].add_(gr.reshape(-1))
    S = layout.shard_numel
    held = HeldGrads(layout, grads, torch.float32, flat.device)
    for a, b in ((0, S), (0, 1), (S // 3, S // 2 + 1), (S - 1, S)):
        dst = torch.full((world, b - a), float("nan"))
        held.fill(dst, a, b)
        assert torch.equal(dst, flat.view(world, S)[:, a:b]), (world, a, b)
