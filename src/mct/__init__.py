"""mct: a memory-constrained trainer for PyTorch."""

from mct.config import EngineConfig

__version__ = "0.1.0"


def __getattr__(name: str):
    # Engine pulls in torch.distributed and every technique: import it on first use so
    # `mct --help` and config errors answer fast.
    if name in ("Engine", "StepResult"):
        from mct import engine
        return getattr(engine, name)
    if name in ("predict_peak", "plan"):
        from mct import planner
        return getattr(planner, name)
    if name == "MemoryBudgetExceeded":
        from mct.memory.tracker import MemoryBudgetExceeded
        return MemoryBudgetExceeded
    raise AttributeError(f"module 'mct' has no attribute {name!r}")


__all__ = ["Engine", "EngineConfig", "MemoryBudgetExceeded", "StepResult", "__version__", "plan", "predict_peak"]
