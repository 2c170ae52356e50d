"""Policies: which blocks are recomputed, grouped into regions, and what a region keeps.

Every policy has one representation, a list of ``RegionPlan`` (``region_plans``); every
policy but ``sqrt`` (whose regions span blocks) also reads as one choice per block,
'all' / 'selective' / 'none' (``block_choices``): what ``checkpointing.per_block`` says."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch
from torch.utils.checkpoint import CheckpointPolicy

from mct.checkpointing.frame import selective_contexts
from mct.config import BLOCK_POLICIES, POLICIES, CheckpointingConfig

# Expensive ops whose outputs selective checkpointing keeps; everything else
# (norms, activations, dropout, softmax, elementwise) is recomputed.
SELECTIVE_SAVE_OPS = (
    "mm", "addmm", "bmm", "baddbmm", "linear",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
)


@dataclass(frozen=True)
class RegionPlan:
    """One checkpoint region: consecutive block indices that keep only their input, and
    what the region keeps inside ('all': nothing; 'selective': matmul/attention outputs)."""

    blocks: tuple[int, ...]
    mode: str


def block_choices(cfg: CheckpointingConfig, n_blocks: int) -> list[str] | None:
    """Each block's choice ('all', 'selective' or 'none') under ``cfg``, or None for a policy
    whose regions span several blocks (``sqrt``) and for an unresolved ``auto``.

    ``checkpointing.per_block`` as a list is taken as it is; as counts it fills the stack in
    ``BLOCK_POLICIES`` order (the first blocks 'all', the next 'selective', the rest 'none').
    Uniform policies map onto the same form: none/all/selective give every block that choice,
    every_k gives 'all' to blocks 0, k, 2k, ... Raises ValueError when the list's length or
    the counts do not match ``n_blocks``, and for every_k with k above it."""
    policy = cfg.policy
    if policy == "per_block":
        return _per_block(cfg.per_block, n_blocks)
    if policy in ("none", "all", "selective"):
        return [policy] * n_blocks
    if policy == "every_k":
        if cfg.k > n_blocks:
            raise ValueError(
                f"checkpointing.k = {cfg.k} is larger than the number of blocks ({n_blocks}); "
                f"choose k between 1 and {n_blocks}")
        # Blocks 0, k, 2k, ...: k = 1 is 'all', and the first block is always covered.
        return ["all" if i % cfg.k == 0 else "none" for i in range(n_blocks)]
    return None


def _per_block(spec: list[str] | dict[str, int], n_blocks: int) -> list[str]:
    if isinstance(spec, list):
        if len(spec) != n_blocks:
            raise ValueError(
                f"checkpointing.per_block lists {len(spec)} block(s) and the model has {n_blocks}: give one of "
                f"all/selective/none per block, or counts like {{all = {n_blocks // 2}}} (the rest none)")
        return list(spec)
    counts = {name: int(spec.get(name, 0)) for name in BLOCK_POLICIES}
    given = sum(counts.values()) if "none" in spec else counts["all"] + counts["selective"]
    if given > n_blocks or ("none" in spec and given != n_blocks):
        raise ValueError(
            f"checkpointing.per_block = {spec!r} counts {given} block(s) and the model has {n_blocks}: make "
            f"all + selective at most {n_blocks}" + (" and leave none out (the rest) or make the sum "
                                                     f"{n_blocks}" if "none" in spec else ""))
    counts["none"] = n_blocks - counts["all"] - counts["selective"]
    return [name for name in BLOCK_POLICIES for _ in range(counts[name])]


def region_plans(cfg: CheckpointingConfig, n_blocks: int) -> list[RegionPlan]:
    """The regions ``cfg`` checkpoints in a stack of ``n_blocks`` blocks: every policy's
    one representation. A block whose choice is 'all' or 'selective' is a region of its
    own; ``sqrt`` makes consecutive runs of ceil(sqrt(n)) blocks ('all'). Raises ValueError
    for an unresolved ``auto`` (the planner resolves it first) and as ``block_choices``."""
    if cfg.policy == "auto":
        raise ValueError(
            "checkpointing.policy = 'auto' must be resolved by the memory planner before "
            "checkpointing is applied (mct.planner.resolve_auto; `mct train` does it)")
    if cfg.policy == "sqrt":
        size = math.ceil(math.sqrt(n_blocks))
        return [RegionPlan(tuple(range(s, min(s + size, n_blocks))), "all") for s in range(0, n_blocks, size)]
    choices = block_choices(cfg, n_blocks)
    if choices is None:
        raise ValueError(f"checkpointing.policy = {cfg.policy!r} is not allowed: "
                         "choose none/all/every_k/sqrt/selective/per_block")
    return [RegionPlan((i,), c) for i, c in enumerate(choices) if c != "none"]


def plan_regions(policy: str, n_blocks: int, k: int,
                 per_block: list[str] | dict[str, int] | None = None) -> list[list[int]]:
    """Group block indices into checkpoint regions; each region keeps only its input.

    Accepts a policy name from ``CheckpointingConfig``, the block count, ``k`` and (policy
    'per_block') ``per_block``. Returns one list of consecutive block indices per region
    (``[]`` for ``none``); ``region_plans`` also says what each region keeps. Raises
    ValueError as ``region_plans``."""
    if policy not in POLICIES:
        raise ValueError(f"checkpointing.policy = {policy!r} is not allowed: "
                         "choose none/all/every_k/sqrt/selective/per_block")
    cfg = CheckpointingConfig(policy=policy, k=k, per_block=per_block or [])
    return [list(r.blocks) for r in region_plans(cfg, n_blocks)]


def choices_label(choices: list[str]) -> str:
    """Each block's choice as runs, in block order: 'all*8,selective*8,none*16'."""
    runs: list[list] = []
    for c in choices:
        if runs and runs[-1][0] == c:
            runs[-1][1] += 1
        else:
            runs.append([c, 1])
    return ",".join(f"{c}*{n}" for c, n in runs)


def policy_label(cfg: CheckpointingConfig) -> str:
    """The policy as a table or report shows it: the policy's name, or for 'per_block' the
    config's own value as runs ('all*8,selective*8' for counts: the rest none)."""
    if cfg.policy != "per_block":
        return cfg.policy
    spec = cfg.per_block
    if isinstance(spec, dict):
        return ",".join(f"{c}*{spec[c]}" for c in BLOCK_POLICIES if c in spec)
    return choices_label(list(spec))


def _selective_policy(save: frozenset, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    name = getattr(op, "overloadpacket", op).__name__
    return CheckpointPolicy.MUST_SAVE if name in save else CheckpointPolicy.PREFER_RECOMPUTE


def context_fn_for(policy: str) -> Callable[[], tuple[ContextManager, ContextManager]] | None:
    """The ``context_fn`` a region runs its forward and recompute under, or None
    (keep nothing inside the region). ``selective`` keeps matmul/attention outputs."""
    if policy != "selective":
        return None
    save = frozenset(n for n in SELECTIVE_SAVE_OPS if hasattr(torch.ops.aten, n))
    return functools.partial(_counted_contexts, functools.partial(_selective_policy, save))


class SelectiveDispatch:
    """Counts the ops dispatched through torch's selective-checkpoint dispatch modes (the
    forward of a 'selective' region caches or marks each op's output, its recompute replays
    from that cache): each pays a Python call there (20-30 us an op on the AVX2 machine, more
    than most of a small block's ops cost themselves, ``extra['selective_mode_op_s']`` of the machine
    profile). ``dispatched``: in this process, so that the planner's dry run can count a
    step's (``mct.planner.work.mode_counts``) and its time model charge them."""

    dispatched = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace != "prim":  # a fake tensor's device query, which a real step never dispatches
            SelectiveDispatch.dispatched += 1
        return super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[misc]


_COUNTED: dict[type, type] = {}


def _counted_contexts(policy_fn: Callable[..., CheckpointPolicy]) -> tuple[ContextManager, ContextManager]:
    """torch's selective-checkpoint contexts for ``policy_fn`` (not wrapped for dynamo where it is
    not loaded: ``frame.selective_contexts``), each mode counting its ops (``SelectiveDispatch``):
    the same instances, of a subclass of their own class that adds the count."""
    modes = selective_contexts(policy_fn)
    for mode in modes:
        cls = type(mode)
        if cls not in _COUNTED:
            _COUNTED[cls] = type(f"Counted{cls.__name__}", (SelectiveDispatch, cls), {})
        mode.__class__ = _COUNTED[cls]
    return modes
