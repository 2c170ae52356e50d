"""Learning-rate schedules (``train.lr_schedule``) as pure functions of the optimizer
step and the config, so a resumed run recomputes exactly the LR it would have had; the
rollback's LR cuts scale it (``LRSchedule``, Stateful).

With w = warmup_steps, S = steps, m = min_lr_ratio, p = min(1, (step - w) / max(1, S - w)):
  cosine    linear warmup over w steps, then lr * (m + (1 - m) * (1 + cos(pi p)) / 2)
            (the default: m = 0.1, today's warm-up then cosine to lr / 10)
  linear    linear warmup, then lr * (1 - (1 - m) p)
  constant  lr at every step (no warmup: warmup_steps does not apply)
  wsd       warmup, stable, decay: linear warmup, lr until the last
            round(decay_fraction * (S - w)) steps, then linear decay towards lr * m over
            them (decay_fraction = 0: warmup then constant)
"""

from __future__ import annotations

import math
from typing import Any

from mct.config import LR_SCHEDULES, TrainConfig

__all__ = ["LR_SCHEDULES", "LRSchedule", "lr_at"]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based; skipped steps do not count)."""
    kind = cfg.lr_schedule
    if kind == "constant":
        return cfg.lr
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    m = cfg.min_lr_ratio
    span = max(1, cfg.steps - cfg.warmup_steps)
    if kind == "wsd":
        decay = round(cfg.decay_fraction * (cfg.steps - cfg.warmup_steps))
        start = cfg.steps - decay
        if step < start:
            return cfg.lr
        return cfg.lr * (1.0 - (1.0 - m) * min(1.0, (step - start) / max(1, decay)))
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if kind == "linear":
        return cfg.lr * (1.0 - (1.0 - m) * progress)
    assert kind == "cosine", kind  # TrainConfig validates the name
    return cfg.lr * (m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * progress)))


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
