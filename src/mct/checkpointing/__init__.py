"""Activation checkpointing: drop chosen blocks' intermediates in forward and recompute
them in backward, replaying every random op exactly. See docs/checkpointing.md."""

from mct.checkpointing.apply import CheckpointState, apply_checkpointing
from mct.checkpointing.blocks import find_blocks
from mct.checkpointing.cache import disable_kv_cache
from mct.checkpointing.measure import saved_activation_bytes
from mct.checkpointing.policies import plan_regions

__all__ = ["CheckpointState", "apply_checkpointing", "disable_kv_cache", "find_blocks", "plan_regions",
           "saved_activation_bytes"]
