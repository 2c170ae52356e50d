"""apply_checkpointing: turn a plain nn.Module into one that recomputes chosen blocks.

Parameters are untouched (no wrapper module, names unchanged): each chosen block gets an
instance-level ``forward`` that opens/continues/closes a checkpoint region.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch.nn as nn

from mct.checkpointing.blocks import find_blocks
from mct.checkpointing.offload import ActivationOffload, ReportFn
from mct.memory.host import Advise, as_is
from mct.checkpointing.policies import context_fn_for, policy_label, region_plans
from mct.checkpointing.region import Region
from mct.checkpointing.norms import TiledNorms, find_rms_norms
from mct.checkpointing.tiled import MLP_NAMES, TiledMLPs, find_mlps
from mct.config import CheckpointingConfig


class CheckpointState:
    """What ``apply_checkpointing`` did to a model, its metrics, and how to undo it.

    Per-step counters (``recompute_calls``, ``recomputed_blocks``, ``recompute_time_s``)
    grow during backward and are zeroed by ``reset_step``. ``verified`` turns True once
    every region has been replayed and matched its forward by value (only when
    ``cfg.verify``); from then on verification costs nothing.
    """

    def __init__(self, policy: str, verify: bool,
                 recompute_context: Callable[[], ContextManager] | None) -> None:
        self.policy = policy
        self.verify = verify
        self.regions: list[Region] = []
        self._recompute_context = recompute_context
        self.offload: ActivationOffload | None = None
        self.tiled: TiledMLPs | None = None  # checkpointing.mlp_tile_tokens
        self.norms: TiledNorms | None = None  # the same tiles, for the model's RMSNorms

    @property
    def more_tiles(self) -> bool:
        """True while backward runs a tiled MLP's tile other than its last: the gradients
        arriving at its weights now are partial sums (``mct.checkpointing.tiled``)."""
        return self.tiled is not None and self.tiled.more_tiles

    @property
    def verified(self) -> bool:
        """Every region replayed once and matched its forward by value."""
        return bool(self.regions) and all(r.verified for r in self.regions)

    @property
    def recompute_calls(self) -> int:
        return sum(r.recompute_calls for r in self.regions)

    @property
    def recomputed_blocks(self) -> int:
        return sum(r.recomputed_blocks for r in self.regions)

    @property
    def recompute_time_s(self) -> float:
        return sum(r.recompute_time_s for r in self.regions)

    @property
    def checkpointed_blocks(self) -> list[str]:
        """Qualified names of the blocks inside a checkpoint region."""
        return [name for r in self.regions for name, _ in r.blocks]

    @property
    def selective_blocks(self) -> list[str]:
        """Qualified names of the blocks inside a 'selective' region (they keep matmul outputs)."""
        return [name for r in self.regions if r.mode == "selective" for name, _ in r.blocks]

    @property
    def recomputing(self) -> bool:
        """True while backward replays a region (a forward pre-hook can read this)."""
        return any(r.replaying for r in self.regions)

    def recompute_context(self) -> ContextManager:
        """Context the replay of a region runs in (e.g. a memory tracker's category)."""
        return self._recompute_context() if self._recompute_context else contextlib.nullcontext()

    def metrics(self) -> dict[str, Any]:
        """Metric keys as the engine reports them: ``recompute_policy``,
        ``recompute_checkpointed_blocks`` (count), ``recompute_regions``,
        ``recompute_verified``, ``recompute_selective_blocks`` (how many of the checkpointed
        blocks keep their matmul outputs), and for the current step: ``recompute_calls`` (regions
        replayed), ``recomputed_blocks`` (block forwards rerun),
        ``recompute_time_s`` (host wall time of replays inside backward; CUDA kernels are
        asynchronous, so on GPU this is launch time unless the caller synchronizes)."""
        return {"recompute_policy": self.policy, "recompute_checkpointed_blocks": len(self.checkpointed_blocks),
                "recompute_selective_blocks": len(self.selective_blocks),
                "recompute_regions": len(self.regions), "recompute_calls": self.recompute_calls,
                "recomputed_blocks": self.recomputed_blocks,
                "recompute_time_s": self.recompute_time_s, "recompute_verified": self.verified,
                **(self.offload.metrics() if self.offload is not None else {}),
                **(self.tiled.metrics() if self.tiled is not None else {}),
                **(self.norms.metrics() if self.norms is not None else {})}

    def reset_step(self) -> None:
        """Zero the per-step counters; call at the start of each optimizer step."""
        for r in self.regions:
            r.recompute_calls = r.recomputed_blocks = 0
            r.recompute_time_s = 0.0
        if self.offload is not None:
            self.offload.end_step()
        if self.tiled is not None:
            self.tiled.tiles = 0

    def remove(self) -> None:
        """Restore every patched block's ``forward``; the model is as before ``apply``."""
        for region in self.regions:
            region.remove()
        self.regions = []
        if self.tiled is not None:
            self.tiled.remove()
            self.tiled = None
        if self.norms is not None:
            self.norms.remove()
            self.norms = None
        self.close()

    def close(self) -> None:
        """End activation offload's I/O thread and remove its files (no-op without it)."""
        if self.offload is not None:
            self.offload.close()


def apply_checkpointing(model: nn.Module, cfg: CheckpointingConfig, *,
                        recompute_context: Callable[[], ContextManager] | None = None,
                        device: Any = "cpu", offload_dir: str = "", name: str = "act",
                        report: ReportFn | None = None,
                        advise: Advise = as_is, planned_for: str | None = None) -> CheckpointState:
    """Patch the blocks chosen by ``cfg.policy`` (and ``cfg.per_block``) so backward recomputes them.

    Accepts any ``nn.Module``; blocks are found by ``find_blocks(model, cfg.blocks)``.
    ``recompute_context`` is entered around every replay (the engine passes its memory
    tracker's ``activations`` category). ``cfg.offload`` != 'none': each region's input
    waits for backward in that tier (``ActivationOffload`` on ``device``; 'disk' files in
    a folder named after ``name`` under ``offload_dir``; ``report(tier, bytes)`` hears the
    bytes parked; ``advise``: called on each buffer an input is read back into; ``planned_for``:
    the device type a dry run stands for, ``ActivationOffload``'s). Returns the ``CheckpointState`` (its ``policy``: ``policy_label(cfg)``);
    mutates only the blocks' instance ``forward`` attribute. Raises ValueError for policy
    'auto', no detectable blocks, an unknown class name in ``cfg.blocks``, ``every_k`` with
    k larger than the block count, a ``per_block`` list or counts that do not match it,
    a model already checkpointed, or ``cfg.offload = 'cpu'`` on a CPU ``device``.
    ``cfg.mlp_tile_tokens`` > 0 (any policy): each block's MLP runs over tiles of that many
    tokens (``mct.checkpointing.tiled``); ValueError when no block has one. So does every
    standard RMSNorm of the model (``mct.checkpointing.norms``; others are left alone).
    """
    state = CheckpointState(policy_label(cfg), cfg.verify, recompute_context)
    if cfg.policy == "auto":
        region_plans(cfg, 0)  # raises: the planner resolves it first
    if cfg.policy == "none" and not cfg.mlp_tile_tokens:
        return state  # patches nothing
    blocks = find_blocks(model, cfg.blocks)
    if not blocks:
        key = f"checkpointing.policy = {cfg.policy!r}" if cfg.policy != "none" else \
            f"checkpointing.mlp_tile_tokens = {cfg.mlp_tile_tokens}"
        raise ValueError(
            f"{key} found no blocks in {type(model).__name__}: "
            "it has no nn.ModuleList; name the block class, e.g. checkpointing.blocks = [\"MyLayer\"]")
    plans = region_plans(cfg, len(blocks)) if cfg.policy != "none" else []
    if cfg.offload != "none":
        state.offload = ActivationOffload(cfg.offload, device, root=offload_dir, name=name, report=report,
                                          advise=advise, planned_for=planned_for)
    for plan in plans:
        region = Region([blocks[i] for i in plan.blocks], context_fn_for(plan.mode), verify=cfg.verify,
                        recompute_context=state.recompute_context)
        region.mode = plan.mode
        region.offload = state.offload
        state.regions.append(region)
    try:
        for region in state.regions:
            region.install()
        if cfg.mlp_tile_tokens:
            _tile_mlps(state, blocks, cfg.mlp_tile_tokens)
            state.norms = TiledNorms(cfg.mlp_tile_tokens)
            state.norms.install(find_rms_norms(model))
    except BaseException:
        state.remove()
        raise
    return state


def _tile_mlps(state: CheckpointState, blocks: list[tuple[str, nn.Module]], tile_tokens: int) -> None:
    mlps = find_mlps(blocks)
    if not mlps:
        raise ValueError(
            f"checkpointing.mlp_tile_tokens = {tile_tokens}: no block of the model ({blocks[0][0]}, ...) has an MLP "
            f"child named {' / '.join(MLP_NAMES)}; name the MLP submodule so, or set checkpointing.mlp_tile_tokens = 0")
    state.tiled = TiledMLPs(tile_tokens, state.recompute_context)
    state.tiled.install(mlps)
