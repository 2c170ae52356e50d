"""Memory at run time: live tensor bytes by category and per-phase peaks (CPU exact, CUDA from
torch.cuda stats), and the enforced budget. Predicting memory is the planner's (mct.planner)."""

from mct.memory.tracker import CATEGORIES, MemoryBudgetExceeded, MemoryTracker, format_bytes

__all__ = ["CATEGORIES", "MemoryBudgetExceeded", "MemoryTracker", "format_bytes"]
