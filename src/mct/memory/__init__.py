"""Memory: live tensor bytes by category and per-stage peaks (CPU exact, CUDA from torch.cuda stats)."""

from mct.memory.tracker import CATEGORIES, MemoryBudgetExceeded, MemoryTracker, format_bytes

__all__ = ["CATEGORIES", "MemoryBudgetExceeded", "MemoryTracker", "format_bytes"]
