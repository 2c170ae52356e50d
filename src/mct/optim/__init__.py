"""Optimizers the engine builds from ``[optimizer]`` (one technique per folder).

``make_adamw`` returns the optimizer factory ``mct.Engine`` takes: ``eager.AdamW`` for
fp32 state (torch's AdamW, bit for bit, fused where the recipe asks for it, without the
wrappers that import ``torch._dynamo``), ``LowPrecisionAdamW`` (``lowbit/``) for bf16 or
int8 moments (on the same base). Imports nothing of mct above ``config``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from mct.config import OptimizerConfig
from mct.optim.eager import AdamW, EagerOptimizer
from mct.optim.lowbit import BLOCK, LowPrecisionAdamW

__all__ = ["AdamW", "EagerOptimizer", "LowPrecisionAdamW", "make_adamw", "shard_align", "state_bytes_per_param"]


def shard_align(state_dtype: str) -> int:
    """Elements every ZeRO shard must hold a multiple of for this state dtype: int8 blocks
    must not straddle ranks; bf16 is aligned the same way so that every shard and chunk
    runs the same vectorized kernels on the same elements (bit-equal at any world size).
    1 for fp32: today's layouts and checkpoints, unchanged."""
    return 1 if state_dtype == "fp32" else BLOCK


def state_bytes_per_param(state_dtype: str) -> float:
    """Adam's moments in bytes per parameter (scales included; the scalar step not)."""
    return {"fp32": 8.0, "bf16": 4.0, "int8": 2.0 + 8.0 / BLOCK}[state_dtype]


def make_adamw(cfg: OptimizerConfig, *, lr: float, seed: int, betas: tuple[float, float] = (0.9, 0.999),
               eps: float = 1e-8, fused: bool = False) -> Callable[[list[dict[str, Any]]], torch.optim.Optimizer]:
    """The factory for ``cfg``: ``betas`` / ``eps`` are the recipe's defaults (the config's
    win when set); ``fused``: use torch's fused kernel for fp32 state where every tensor
    sits on a CPU or CUDA device. ``seed`` keys the low-precision state's rounding noise."""
    kwargs = cfg.adam_kwargs(betas, eps)

    def factory(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        if cfg.state_dtype != "fp32":
            return LowPrecisionAdamW(groups, lr=lr, state_dtype=cfg.state_dtype, seed=seed, **kwargs)
        if not fused:
            return AdamW(groups, lr=lr, **kwargs)
        params = [p for g in groups for p in g["params"]]
        ok = bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
        return AdamW(groups, lr=lr, fused=ok or None, **kwargs)
    return factory


def place(optimizer: torch.optim.Optimizer, shards: list[tuple[torch.Tensor, int]], state_dtype: str) -> None:
    """Tell ``optimizer`` where each flat master shard starts in its unit's global flat
    tensor ((shard, offset) in unit order). Raises ValueError when the optimizer does not
    keep the configured ``state_dtype`` (a hand-written factory under a low-precision
    config, or the reverse)."""
    have = getattr(optimizer, "state_dtype", "fp32")
    if have != state_dtype:
        raise ValueError(f"optimizer.state_dtype = {state_dtype!r}, but the optimizer factory built a "
                         f"{type(optimizer).__name__} keeping {have!r} state: build it with "
                         f"mct.optim.make_adamw(config.optimizer, ...) or set optimizer.state_dtype = {have!r}")
    if hasattr(optimizer, "place"):
        for stream, (shard, offset) in enumerate(shards):
            optimizer.place(shard, offset, stream)
