"""The global gradient norm's local part (``ShardedModel.local_sq_norm``): each shard's
squared L2 norm accumulated in fp64. ``fp64_sq_norm`` casts every shard into one reused
fp64 buffer instead of a fresh copy per shard; the clip coefficient (and so every weight)
depends on the last bits of this sum, so it must equal the per-shard form bit for bit."""

from __future__ import annotations

import pytest
import torch

from mct.zero.flat import scale_
from mct.zero.sharded import fp64_sq_norm


def _per_shard(shards: list[torch.Tensor]) -> torch.Tensor:
    """The form it replaces: a materialized fp64 copy of each shard, squared norms summed."""
    return sum(torch.linalg.vector_norm(g, dtype=torch.float64).square() for g in shards)


@pytest.mark.parametrize("sizes", [[1], [7, 1000, 3], [12_345, 0, 65_537], [300_001, 5, 299_999], [1 << 20, 17]])
def test_fp64_sq_norm_equals_the_per_shard_cast_bit_for_bit(sizes):
    gen = torch.Generator().manual_seed(sum(sizes))
    # magnitudes over many binades, so the fp64 sums round in their last bits
    shards = [torch.randn(n, generator=gen) * torch.rand(n, generator=gen).pow(8) * 1e3 for n in sizes]
    got, want = fp64_sq_norm(shards), _per_shard(shards)
    assert got.dtype == torch.float64
    assert got.item() == want.item()


def test_fp64_sq_norm_keeps_non_finite_shards_non_finite():
    shards = [torch.ones(10), torch.tensor([1.0, float("inf")]), torch.ones(3)]
    assert fp64_sq_norm(shards).item() == float("inf")
    shards[1][0] = float("nan")
    assert torch.isnan(fp64_sq_norm(shards))


def test_fp64_sq_norm_of_a_later_smaller_shard_reads_only_its_own_values():
    # the buffer is sized by the largest shard: a smaller one after it reads a prefix of it
    big, small = torch.full((1000,), 3.0), torch.full((10,), 2.0)
    for shards in ([big, small], [small, big]):
        assert fp64_sq_norm(shards).item() == _per_shard(shards).item()
        assert fp64_sq_norm(shards).item() == pytest.approx(1000 * 9.0 + 10 * 4.0, rel=1e-15)


def test_scale_multiplies_in_place_and_leaves_an_exact_one_or_none_alone():
    """Averaging and clipping go through ``scale_``: x 1.0 (one rank, no clipping) and None
    change no bit, -0.0 and NaN included; any other factor multiplies in place."""
    g = torch.tensor([-0.0, float("nan"), 3.0, -5e-39])
    before = g.clone()
    for factor in (1.0, None):
        scale_([g], factor)
        assert torch.equal(g.view(torch.int32), before.view(torch.int32))
    scale_([g], 0.5)
    assert g[2].item() == 1.5 and torch.isnan(g[1]) and torch.equal(g[[0, 3]], before[[0, 3]] * 0.5)
    scale_([], 0.5)  # nothing to scale: no error
