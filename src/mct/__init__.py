"""mct: a memory-constrained trainer for PyTorch."""

from mct.config import EngineConfig

__version__ = "0.1.0"

__all__ = ["EngineConfig", "__version__"]
