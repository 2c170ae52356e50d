"""Activation checkpointing: drop chosen blocks' intermediates in forward and recompute
them in backward, replaying every random op exactly. See docs/checkpointing.md."""

from mct.checkpointing.apply import CheckpointState, apply_checkpointing
from mct.checkpointing.blocks import find_blocks
from mct.checkpointing.cache import disable_kv_cache
from mct.checkpointing.measure import saved_activation_bytes
from mct.checkpointing.tiled import MLP_NAMES, TiledMLPs, find_mlps
from mct.checkpointing.policies import (RegionPlan, block_choices, choices_label, plan_regions, policy_label,
                                        region_plans)

__all__ = ["MLP_NAMES", "CheckpointState", "RegionPlan", "TiledMLPs", "find_mlps", "apply_checkpointing", "block_choices", "choices_label",
           "disable_kv_cache", "find_blocks", "plan_regions", "policy_label", "region_plans", "saved_activation_bytes"]
