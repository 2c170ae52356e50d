"""Learning-rate schedule: linear warmup, then cosine decay to lr / 10; the rollback's
LR cuts scale it (``LRSchedule``, Stateful)."""

from __future__ import annotations

import math
from typing import Any

from mct.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based; skipped steps do not count)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


class LRSchedule:
    """``lr_at`` times a scale that only the rollback's LR cuts change. The position
    is the optimizer step count (``LoopCounters.opt_step``), owned by the loop;
    this component owns the scale, which persists across rollbacks."""

    def __init__(self, tcfg: TrainConfig) -> None:
        self.tcfg = tcfg
        self.scale = 1.0

    def lr(self, opt_step: int) -> float:
        return lr_at(opt_step, self.tcfg) * self.scale

    def cut(self, factor: float) -> None:
        self.scale *= factor

    def state_dict(self) -> dict[str, Any]:
        return {"lr_scale": self.scale}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.scale = float(sd["lr_scale"])
