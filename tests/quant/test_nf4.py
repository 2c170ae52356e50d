"""NF4 codec: the error bound per block, shard invariance of the bytes, stored size."""

from __future__ import annotations

import pytest
import torch

from mct.quant.nf4 import NF4_ALIGN, NF4_BLOCK, NF4_GROUP, LEVELS, MAX_ERROR_PER_ABSMAX, NF4Codec, round_trip


def _weights(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # per-block spread of magnitudes (and a few outliers), as real weight rows have
    w = torch.randn(n, generator=g) * torch.rand(n // NF4_BLOCK, 1, generator=g).expand(-1, NF4_BLOCK).reshape(-1)
    w[torch.randint(0, n, (n // 1000,), generator=g)] *= 20
    return w * 0.02


def test_round_trip_error_within_bound_of_each_block():
    codec = NF4Codec()
    n = 3 * NF4_ALIGN + 5 * NF4_BLOCK  # a partial last group
    w = _weights(n)
    parts = codec.encode(w)
    back = codec.decode(parts, n, torch.float32)
    absmax = w.view(-1, NF4_BLOCK).abs().amax(dim=1)
    # the largest int8 rounding of a block maximum in its group: half that group's scale
    scale = parts["scale"].repeat_interleave(NF4_GROUP)[:absmax.numel()]
    err = (back - w).view(-1, NF4_BLOCK).abs().amax(dim=1)
    bound = MAX_ERROR_PER_ABSMAX * absmax + 0.5 * scale * (1 + 1e-5) + 1e-9
    assert (err <= bound).all(), f"worst block: {(err / bound).max().item():.4f} of its bound"
    # the bound is not vacuous: typical blocks come near it, and the error is an NF4 one
    assert (err / bound).max() > 0.5
    assert 0.05 < ((back - w).norm() / w.norm()).item() < 0.15


def test_levels_of_a_block_decode_exactly():
    """A block holding exactly the levels times a representable maximum decodes to itself."""
    codec = NF4Codec()
    w = torch.zeros(NF4_ALIGN)
    w[:NF4_BLOCK] = torch.tensor(LEVELS).repeat(NF4_BLOCK // 16) * 0.5
    back = codec.decode(codec.encode(w), NF4_ALIGN, torch.float32)
    # block 0's max (0.5) is off the int8 grid only by the group mean's rounding
    assert torch.allclose(back[:NF4_BLOCK], w[:NF4_BLOCK], rtol=0, atol=1e-3)
    assert torch.equal(back[NF4_BLOCK:], w[NF4_BLOCK:])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_encode_of_flat_equals_concat_of_aligned_slices(world):
    codec = NF4Codec()
    n = 12 * NF4_ALIGN
    w = _weights(n, seed=world).bfloat16()
    whole = codec.encode(w)
    cuts = [0, NF4_ALIGN, 5 * NF4_ALIGN, 6 * NF4_ALIGN, n][:world] + [n]
    pieces = [codec.encode(w[a:b]) for a, b in zip(cuts, cuts[1:])]
    for key, t in whole.items():
        assert torch.equal(t, torch.cat([p[key] for p in pieces])), key
    # and a slice decodes to the same values as that part of the whole
    a, b = cuts[1], cuts[2]
    assert torch.equal(codec.decode(pieces[1], b - a, torch.bfloat16),
                       codec.decode(whole, n, torch.bfloat16)[a:b])


def test_stored_bytes_under_0_57_per_param_for_4096_square():
    codec = NF4Codec()
    n = 4096 * 4096
    parts = codec.encode(torch.randn(n) * 0.02)
    stored = sum(t.numel() * t.element_size() for t in parts.values())
    assert stored == codec.stored_bytes(n)
    assert stored / n <= 0.57
    assert stored / n == pytest.approx(0.5 + 1 / 64 + 8 / NF4_ALIGN)


def test_decode_casts_once_from_fp32_product():
    codec = NF4Codec()
    n = 2 * NF4_ALIGN + 100  # the tail is decoded apart from the whole chunks
    parts = codec.encode(_weights(n + 28)[:n])
    fp32 = codec.decode(parts, n, torch.float32)
    assert torch.equal(codec.decode(parts, n, torch.bfloat16), fp32.bfloat16())
    big = codec.encode(_weights(5 * NF4_ALIGN))  # > one decode chunk
    assert torch.equal(codec.decode(big, 5 * NF4_ALIGN, torch.bfloat16),
                       codec.decode(big, 5 * NF4_ALIGN, torch.float32).bfloat16())


def test_round_trip_of_a_parameter_equals_its_aligned_place_in_a_flat():
    """What the reference is given (a parameter on its own) is what a unit decodes for it."""
    codec = NF4Codec()
    a, b = _weights(96 * 64).view(96, 64), _weights(3 * NF4_ALIGN, seed=1).view(-1, 128)
    flat = torch.zeros(NF4_ALIGN + 3 * NF4_ALIGN)
    flat[:a.numel()] = a.reshape(-1)
    flat[NF4_ALIGN:] = b.reshape(-1)
    back = codec.decode(codec.encode(flat), flat.numel(), torch.float32)
    assert torch.equal(round_trip(a, codec), back[:a.numel()].view_as(a))
    assert torch.equal(round_trip(b, codec), back[NF4_ALIGN:].view_as(b))


def test_non_finite_values_refused():
    w = torch.zeros(NF4_ALIGN)
    w[7] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        NF4Codec().encode(w)
