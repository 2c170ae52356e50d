"""The global gradient norm's local part (``ShardedModel.local_sq_norm``): each shard's
squared L2 norm accumulated in fp64, chunk by chunk through one small reused fp64 buffer
(``mct.zero.flat.fp64_sq_norm``). The clip coefficient (and so every weight) depends on the
last bits of this sum, so its order is pinned: the same bits wherever it is taken (the
offloaded gradients' norm takes it shard by shard), and close to the exact sum."""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mct.zero.flat import NORM_CHUNK, fp64_sq_norm, scale_


def _spelled_out(shards: list[torch.Tensor]) -> torch.Tensor:
    """The definition, written plainly: per shard, chunk sums of exact fp64 squares added in
    order from zero; the shards' totals added in order."""
    total = None
    for g in shards:
        s = torch.zeros((), dtype=torch.float64)
        for a in range(0, g.numel(), NORM_CHUNK):
            s = s + (g[a:a + NORM_CHUNK].double() ** 2).sum()
        total = s if total is None else total + s
    return total


def _shards(sizes: list[int]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(sum(sizes))
    # magnitudes over many binades, so the fp64 sums round in their last bits
    return [torch.randn(n, generator=gen) * torch.rand(n, generator=gen).pow(8) * 1e3 for n in sizes]


SIZES = [[1], [7, 1000, 3], [12_345, 0, 65_537], [300_001, 5, 299_999], [NORM_CHUNK + 1, 17],
         [3 * NORM_CHUNK - 64, NORM_CHUNK]]


@pytest.mark.parametrize("sizes", SIZES)
def test_fp64_sq_norm_is_its_definition_bit_for_bit(sizes):
    shards = _shards(sizes)
    got = fp64_sq_norm(shards)
    assert got.dtype == torch.float64
    assert got.item() == _spelled_out(shards).item()
    # taken shard by shard (as the offloaded gradients' norm is) and added in order: the same bits
    assert sum(fp64_sq_norm([g]) for g in shards).item() == got.item()


@pytest.mark.parametrize("sizes", SIZES)
def test_fp64_sq_norm_is_within_fp64_rounding_of_the_exact_sum(sizes):
    shards = _shards(sizes)
    exact = math.fsum(x * x for g in shards for x in g.double().tolist())
    assert fp64_sq_norm(shards).item() == pytest.approx(exact, rel=1e-15, abs=0)


def test_fp64_sq_norm_of_16_bit_gradients_squares_exactly():
    g = (torch.randn(NORM_CHUNK + 5) * 7).to(torch.bfloat16)
    exact = math.fsum(x * x for x in g.double().tolist())
    assert fp64_sq_norm([g]).item() == pytest.approx(exact, rel=1e-15, abs=0)


def test_fp64_sq_norm_keeps_non_finite_shards_non_finite():
    shards = [torch.ones(10), torch.tensor([1.0, float("inf")]), torch.ones(3)]
    assert fp64_sq_norm(shards).item() == float("inf")
    shards[1][0] = float("nan")
    assert torch.isnan(fp64_sq_norm(shards))
    # a non-finite value in a later chunk of a long shard
    long = torch.ones(2 * NORM_CHUNK + 3)
    long[-1] = float("inf")
    assert fp64_sq_norm([long]).item() == float("inf")


def test_fp64_sq_norm_of_a_later_smaller_shard_reads_only_its_own_values():
    # the buffer is sized by the largest shard (up to a chunk): a smaller one after it reads a prefix
    big, small = torch.full((1000,), 3.0), torch.full((10,), 2.0)
    for shards in ([big, small], [small, big]):
        assert fp64_sq_norm(shards).item() == 1000 * 9.0 + 10 * 4.0
    assert fp64_sq_norm([]).item() == 0.0 and fp64_sq_norm([torch.ones(0)]).item() == 0.0


def test_fp64_sq_norm_on_fake_tensors_allocates_one_chunk_in_few_ops():
    """A dry run's shards are fake: a chunk's buffer, one op per shard (not four per 2 MiB)."""
    with FakeTensorMode():
        shards = [torch.empty(40 * NORM_CHUNK), torch.empty(3)]
        calls = []
        with _Count(calls):
            out = fp64_sq_norm(shards)
        assert out.dtype == torch.float64 and out.shape == ()
    assert 0 < len(calls) < 12


class _Count(torch.overrides.TorchFunctionMode):
    def __init__(self, calls: list) -> None:
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(func)
        return func(*args, **(kwargs or {}))


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
