"""Seeds: one user seed, and the streams derived from it, recorded in metadata.

Every micro-batch's dropout stream is seeded from (seed, step, global micro-batch
index), so a run is reproducible from any step, evaluation cannot shift training
randomness, the reference trainer can replay exactly what each rank drew, and a run
resumed on another number of ranks draws the same dropout for the same samples (rank r's
micro-batch m of a step is global micro-batch ``r * grad_accum + m``, on any world size).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Callable

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def micro_seed(seed: int, step: int, index: int) -> int:
    """The torch seed for global micro-batch ``index`` of one step (63-bit, stable)."""
    h = hashlib.sha256(f"mct-dropout:{seed}:{step}:{index}".encode()).digest()
    return int.from_bytes(h[:8], "little") >> 1


def seeded(loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]) -> Callable[[torch.nn.Module, Any], torch.Tensor]:
    """``loss_fn`` over ``(input_ids, targets, seed)`` (packed documents: ``(input_ids,
    targets, segments, seed)``): seeds the dropout stream first, so a recomputed region, a
    replayed step and the reference draw the same dropout; ``loss_fn`` gets the batch
    without the seed."""
    def loss(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
        *data, seed = batch
        torch.manual_seed(seed)
        return loss_fn(model, tuple(data))
    return loss
