"""Stages 2/3 accumulate a block unit's gradient bucket by bucket (``FlatParamUnit.grad_buckets``),
so each bucket of its reduce-scatter reads a slice in place: no copy of the unit's whole
gradient exists while it is reduced. The layout is a permutation of the flat gradient: the
same sums, bit for bit, with many buckets as with one."""

from __future__ import annotations

import pytest
import torch

from mct.precision.policy import PrecisionPolicy
from mct.zero.flat import FlatParamUnit, put_zero_plus
from mct.zero.partition import bucket_slices, build_layout
from tests.distributed import run_distributed
from tests.helpers import engine_run, sgd_momentum, tiny_config


SHAPES = [(5, 3), (7,), (2, 2, 2), (1,)]


def _unit(world: int) -> FlatParamUnit:
    """A stage-3 style unit (sharded, gradients not kept) of four parameters of SHAPES."""
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    layout = build_layout([f"p{i}" for i in range(len(SHAPES))], SHAPES, world)
    return FlatParamUnit("u", [(f"p{i}", p) for i, p in enumerate(params)], layout, shard_rank=0,
                         precision=PrecisionPolicy.for_mode("fp32"), persistent=False, full_grads=False,
                         device=torch.device("cpu"))


@pytest.mark.parametrize("world,cols", [(3, 4), (2, 1), (4, 1000)])
def test_bucket_major_gradient_is_the_flat_gradient_bucket_by_bucket(world, cols):
    shapes = SHAPES
    unit = _unit(world)
    layout, S = unit.layout, unit.layout.shard_numel
    unit.reduce_in_place, unit.grad_buckets = True, bucket_slices(S, world, 4, cols * world * 4)
    buckets = unit.grad_buckets
    assert len(buckets) > 1 or cols == 1000
    g = torch.Generator().manual_seed(world)
    grads = [torch.randn(s, generator=g) for s in shapes]
    for i, grad in enumerate(grads):
        unit.accumulate_grad(i, grad)
    flat = torch.zeros(layout.padded_numel)
    for i, grad in enumerate(grads):
        flat[layout.offsets[i]:layout.offsets[i] + grad.numel()] = grad.reshape(-1)
    expected = torch.cat([flat.view(world, S)[:, a:b].reshape(-1) for a, b in buckets])
    assert torch.equal(unit.grad_full, expected)


def _train(rank: int, world: int) -> list:
    out = []
    for stage in (2, 3):
        runs = [engine_run(tiny_config(zero={"stage": stage, "bucket_mb": mb}), rank, 3, sgd_momentum, n_micro=2)
                for mb in (25.0, 0.0005)]  # one bucket per unit, and dozens
        out.append((stage, runs[0][0] == runs[1][0],
                    all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])))
    return out


@pytest.mark.multirank
def test_many_buckets_train_bit_identically_to_one_bucket_stages_2_and_3():
    for stage, same_losses, same_params in run_distributed(_train, 2)[0]:
        assert same_losses and same_params, stage


@pytest.mark.parametrize("buckets", [False, True])
def test_first_gradient_is_written_and_parameters_without_one_are_zeroed(buckets):
    """Stages 2/3 allocate a unit's flat gradient without a zero-fill: a parameter's first
    gradient is written as ``0 + g`` (the same bits as adding it into zeros, -0.0 included),
    later ones are added, and at the reduce the elements no gradient reached (alignment
    gaps, padding, a parameter that got none) are zeros, whatever the buffer held."""
    world = 3
    shapes = SHAPES
    unit = _unit(world)
    layout, S = unit.layout, unit.layout.shard_numel
    if buckets:
        unit.reduce_in_place, unit.grad_buckets = True, bucket_slices(S, world, 4, 4 * world * 4)
    g = torch.Generator().manual_seed(0)
    grads = [(0, torch.randn(shapes[0], generator=g)), (2, torch.randn(shapes[2], generator=g).to(torch.bfloat16)),
             (0, torch.randn(shapes[0], generator=g)), (3, torch.tensor([-0.0]))]  # p1 gets none
    real_empty = torch.empty
    try:  # what a fresh allocation may hold
        torch.empty = lambda *a, **k: real_empty(*a, **k).fill_(float("nan"))
        for i, grad in grads:
            unit.accumulate_grad(i, grad)
    finally:
        torch.empty = real_empty
    unit.zero_unwritten()
    flat = torch.zeros(layout.padded_numel)
    for i, grad in grads:
        flat[layout.offsets[i]:layout.offsets[i] + grad.numel()].add_(grad.reshape(-1))
    expected = (torch.cat([flat.view(world, S)[:, a:b].reshape(-1) for a, b in unit.grad_buckets])
                if buckets else flat)
    assert torch.equal(unit.grad_full.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("src_dtype,out_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                                 (torch.float32, torch.bfloat16), (torch.float32, torch.float32)])
def test_first_gradient_of_another_dtype_is_written_as_torch_add_writes_it(src_dtype, out_dtype):
    """``put_zero_plus`` casts a gradient of another dtype straight into the buffer and adds
    the zero in place (no temporary); the bits must be ``torch.add(zero, g, out=)``'s: -0.0
    becomes +0.0, infinities, NaNs, subnormals and rounding as there; strided columns too."""
    g = torch.Generator().manual_seed(1)
    vals = torch.cat([torch.randn(4000, generator=g) * torch.rand(4000, generator=g).pow(12) * 1e4,
                      torch.tensor([-0.0, 0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-42, 3e38])])
    src = vals.to(src_dtype)[: 2 * 2004].view(2, 2004)[:, 1:2003]  # rows of a flat gradient: strided
    zero = torch.zeros(1, dtype=out_dtype)
    want = torch.empty(2, 2002, dtype=out_dtype)
    torch.add(zero, src, out=want)
    buf = torch.full((2, 3000), float("nan"), dtype=out_dtype)
    put_zero_plus(buf[:, 500:2502], src, zero)
    bits = torch.int16 if out_dtype.itemsize == 2 else torch.int32
    assert torch.equal(buf[:, 500:2502].contiguous().view(bits), want.view(bits))
    assert torch.isnan(buf[:, :500]).all() and torch.isnan(buf[:, 2502:]).all()
