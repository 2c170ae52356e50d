"""Policies: which blocks are recomputed, grouped into regions, and what a region keeps."""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, ContextManager

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# Expensive ops whose outputs selective checkpointing keeps; everything else
# (norms, activations, dropout, softmax, elementwise) is recomputed.
SELECTIVE_SAVE_OPS = (
    "mm", "addmm", "bmm", "baddbmm", "linear",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
)


def plan_regions(policy: str, n_blocks: int, k: int) -> list[list[int]]:
    """Group block indices into checkpoint regions; each region keeps only its input.

    Accepts a policy name from ``CheckpointingConfig``, the block count and ``k``.
    Returns one list of consecutive block indices per region (``[]`` for ``none``).
    Raises ValueError for an unresolved ``auto`` (the planner resolves it first) and for ``every_k`` with
    ``k`` larger than the block count.
    """
    if policy == "auto":
        raise ValueError(
            "checkpointing.policy = 'auto' must be resolved by the memory planner before "
            "checkpointing is applied (mct.planner.resolve_auto; `mct train` does it)")
    if policy == "none":
        return []
    if policy in ("all", "selective"):
        return [[i] for i in range(n_blocks)]
    if policy == "every_k":
        if k > n_blocks:
            raise ValueError(
                f"checkpointing.k = {k} is larger than the number of blocks ({n_blocks}); "
                f"choose k between 1 and {n_blocks}")
        # Blocks 0, k, 2k, ...: k = 1 is 'all', and the first block is always covered.
        return [[i] for i in range(0, n_blocks, k)]
    if policy == "sqrt":
        size = math.ceil(math.sqrt(n_blocks))
        return [list(range(s, min(s + size, n_blocks))) for s in range(0, n_blocks, size)]
    raise ValueError(f"checkpointing.policy = {policy!r} is not allowed: "
                     "choose none/all/every_k/sqrt/selective")


def _selective_policy(save: frozenset, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    name = getattr(op, "overloadpacket", op).__name__
    return CheckpointPolicy.MUST_SAVE if name in save else CheckpointPolicy.PREFER_RECOMPUTE


def context_fn_for(policy: str) -> Callable[[], tuple[ContextManager, ContextManager]] | None:
    """The ``context_fn`` a region runs its forward and recompute under, or None
    (keep nothing inside the region). ``selective`` keeps matmul/attention outputs."""
    if policy != "selective":
        return None
    save = frozenset(n for n in SELECTIVE_SAVE_OPS if hasattr(torch.ops.aten, n))
    return functools.partial(create_selective_checkpoint_contexts,
                             functools.partial(_selective_policy, save))
