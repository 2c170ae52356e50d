"""Flat-buffer layout: pure arithmetic, no tensors allocated, no collectives.

A *unit* is the set of trainable parameters that are gathered, reduced and freed
together (one block, or the parameters outside every block), split by optimizer
param group, since each group keeps its own hyperparameters. Its parameters are
packed in order into one flat buffer padded to a multiple of the world size; rank r
owns the contiguous slice ``[r * shard_numel, (r + 1) * shard_numel)``.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter lives in a flat buffer split over ``world`` ranks."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numel: int
    """Sum of the parameters' elements (unpadded)."""
    world: int
    shard_align: int = 1
    """Every shard holds a multiple of this many elements, so shards start at multiples
    of it on the global flat index (block-quantized optimizer state: a block never
    straddles two ranks). 1 = today's layouts, unchanged."""

    @property
    def padded_numel(self) -> int:
        per = self.world * self.shard_align
        return math.ceil(self.numel / per) * per if self.numel else per

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank's slice in the padded flat buffer."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank must be in [0, {self.world}), got {rank}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def param_pieces(self, rank: int) -> list[tuple[int, int, int, int]]:
        """Pieces of parameters that fall in rank's slice, as tuples
        (param_index, start_in_param, end_in_param, start_in_shard)."""
        return self.pieces(*self.shard_range(rank))

    def pieces(self, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
        """Pieces of parameters that fall in elements [lo, hi) of the flat buffer, in order,
        as tuples (param_index, start_in_param, end_in_param, start_in_range); alignment
        gaps and padding are in none. The offsets ascend: found by bisection, O(pieces)."""
        out = []
        for i in range(max(0, bisect.bisect_right(self.offsets, lo) - 1), len(self.offsets)):
            off = self.offsets[i]
            if off >= hi:
                break
            a, b = max(off, lo), min(off + math.prod(self.shapes[i]), hi)
            if a < b:
                out.append((i, a - off, b - off, a - lo))
        return out


ALIGN_ELEMENTS = 16
"""Each parameter starts at a multiple of 16 elements (64 bytes in fp32): kernels pick
code paths by alignment, so unaligned views would round differently from the same
parameter allocated on its own, and parity with the reference would suffer."""


def build_layout(names: list[str], shapes: list[torch.Size], world: int,
                 align: int = ALIGN_ELEMENTS, shard_align: int = 1) -> FlatLayout:
    """Pack parameters in the given order, each at an ``align``-element boundary.
    ``world`` is the number of shards (1 when nothing is sharded, as at stage 0);
    each shard holds a multiple of ``shard_align`` elements (the offsets of the
    parameters do not depend on it, only the tail padding does)."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if shard_align < 1:
        raise ValueError(f"shard_align must be >= 1, got {shard_align}")
    offsets, total = [], 0
    for s in shapes:
        total = math.ceil(total / align) * align
        offsets.append(total)
        total += math.prod(s)
    return FlatLayout(tuple(names), tuple(torch.Size(s) for s in shapes), tuple(offsets), total, world,
                      shard_align)


def bucket_slices(shard_numel: int, world: int, element_size: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """Split the columns of a [world, shard_numel] view into chunks so that each
    collective moves at most about ``bucket_bytes`` (at least one column each)."""
    per_col = world * element_size
    cols = max(1, bucket_bytes // per_col)
    return [(a, min(a + cols, shard_numel)) for a in range(0, shard_numel, cols)] or [(0, 0)]


def model_state_bytes(n_params: int, world: int, stage: int, *, param_bytes: int, grad_bytes: int,
                      master_bytes: int, optim_bytes_per_param: int, cast_shard: bool = False) -> dict[str, float]:
    """ZeRO (Rajbhandari et al. 2020) per-rank model-state bytes by category.

    stage 0: everything replicated; 1: master + optimizer state sharded; 2: also
    gradients; 3: also working parameters. ``master_bytes`` is 0 when the working
    parameters are fp32 and double as the master copy. At stage 3 the engine keeps no
    low-precision parameter shard: blocks are gathered from the fp32 master shard and
    freed after use, so persistent ``params`` is 0 when a separate master exists (in
    fp32 the master shard is the parameter shard and counts as ``params``). Gathered
    blocks in flight are transients, not counted here. ``cast_shard``: stage 3 with a
    separate master whose ranks share memory (``mct.zero.shm``): each keeps a
    param-dtype cast of its master shard for its peers to read, ``params`` =
    ``n_params * param_bytes / world`` (the low-precision shard of DeepSpeed's formula).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero.stage must be 0, 1, 2 or 3, got {stage!r}")
    shard = 1 / world
    params = n_params * param_bytes * (shard if stage >= 3 else 1)
    if stage == 3 and master_bytes > 0 and not cast_shard:
        params = 0.0
    return {
        "params": params,
        "grads": n_params * grad_bytes * (shard if stage >= 2 else 1),
        "master": n_params * master_bytes * (shard if stage >= 1 else 1),
        "optimizer": n_params * optim_bytes_per_param * (shard if stage >= 1 else 1),
    }
