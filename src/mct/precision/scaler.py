"""Dynamic loss scaling for fp16, and the non-finite gradient check.

``LossScaler`` is a no-op object when disabled (fp32, bf16), so the engine runs one
code path in every mode. The overflow check is the engine's: it all-reduces the
squared gradient norm, which is non-finite when any gradient element is.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mct.config import PrecisionConfig, check_int

# Growth stops here: far beyond any useful fp16 scale, and loss * scale stays finite in fp32.
MAX_SCALE = 2.0**64

_STATE_KEYS = ("enabled", "scale", "growth_tracker", "hysteresis_left",
               "overflows", "skipped_steps", "consecutive_skips")


class LossScaleFloorError(RuntimeError):
    """Gradients overflow fp16 even at ``precision.min_scale`` with hysteresis used up."""


class LossScaler:
    """Dynamic loss scale with hysteresis (the DeepSpeed fp16 scheme, refill on growth).

    State: ``scale``, ``growth_tracker`` (consecutive clean steps since the last
    growth or overflow), ``hysteresis_left`` (overflows still tolerated without a
    back-off). ``update(found_inf)`` after every optimizer step:

    - clean step: ``growth_tracker += 1``; when it reaches ``growth_interval`` the
      scale doubles (capped at 2**64), the tracker resets and ``hysteresis_left`` is
      refilled to ``hysteresis``.
    - overflow (the step is skipped): the tracker resets; if ``hysteresis_left > 1``
      it is decremented and the scale stays; otherwise the scale halves, floored at
      ``min_scale``, and ``hysteresis_left`` stays 1 until the next growth refills it.
    - overflow with the scale already at ``min_scale`` and ``hysteresis_left == 1``:
      the skip is counted, then ``LossScaleFloorError`` is raised.

    ``hysteresis=1`` is exactly ``torch.amp.GradScaler`` (growth/backoff factor 2).
    Disabled (fp32/bf16): ``scale == 1.0``, ``scale_loss`` is the identity, and
    ``update(True)`` only counts the skipped step; it never raises.
    """

    def __init__(self, *, enabled: bool, initial_scale_power: int = 16, growth_interval: int = 1000,
                 hysteresis: int = 2, min_scale: float = 1.0) -> None:
        check_int("precision.initial_scale_power", initial_scale_power, 0, 65)
        check_int("precision.growth_interval", growth_interval, 1)
        check_int("precision.hysteresis", hysteresis, 1)
        if isinstance(min_scale, bool) or not isinstance(min_scale, (int, float)) \
                or not 0 < min_scale <= 2.0**initial_scale_power:
            raise ValueError(f"precision.min_scale = {min_scale!r} is not allowed: must be > 0 and <= the "
                             f"initial scale 2**initial_scale_power = {2.0**initial_scale_power}")
        self.enabled = bool(enabled)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self._scale = 2.0**initial_scale_power if self.enabled else 1.0
        self._growth_tracker = 0
        self._hysteresis_left = hysteresis
        self._overflows = 0
        self._skipped_steps = 0
        self._consecutive_skips = 0

    @classmethod
    def from_config(cls, cfg: PrecisionConfig) -> "LossScaler":
        """Enabled only for ``mode == 'fp16'``; a no-op scaler otherwise."""
        return cls(enabled=cfg.mode == "fp16", initial_scale_power=cfg.initial_scale_power,
                   growth_interval=cfg.growth_interval, hysteresis=cfg.hysteresis,
                   min_scale=cfg.min_scale)

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def inv_scale(self) -> float:
        """1 / scale: multiply gradients by it to unscale them (exact, scales are powers of 2)."""
        return 1.0 / self._scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` in fp32 when enabled; ``loss`` itself (same object) when disabled."""
        if not self.enabled:
            return loss
        return loss.float() * self._scale

    def update(self, found_inf: bool | torch.Tensor) -> None:
        """Advance the state machine by one optimizer step; ``found_inf`` must already be
        reduced over ranks. Mutates scale and counters; raises LossScaleFloorError at the floor
        (after counting the skip)."""
        if not bool(found_inf):
            self._consecutive_skips = 0
            if self.enabled:
                self._grow_if_due()
            return
        self._skipped_steps += 1
        self._consecutive_skips += 1
        if self.enabled:
            self._overflows += 1
            self._back_off()

    def _grow_if_due(self) -> None:
        self._growth_tracker += 1
        if self._growth_tracker >= self.growth_interval:
            self._scale = min(self._scale * 2.0, MAX_SCALE)
            self._growth_tracker = 0
            self._hysteresis_left = self.hysteresis

    def _back_off(self) -> None:
        self._growth_tracker = 0
        if self._hysteresis_left > 1:
            self._hysteresis_left -= 1
            return
        if self._scale <= self.min_scale:
            raise LossScaleFloorError(
                f"fp16 gradients overflowed with the loss scale already at its floor "
                f"(scale = {self._scale:g} = precision.min_scale, hysteresis = {self.hysteresis} used up) "
                f"after {self._consecutive_skips} consecutive overflowing steps; the scale cannot back off "
                f"further. Use precision.mode = 'bf16', lower train.lr, or check the data/model for values "
                f"that overflow fp16.")
        self._scale = max(self._scale / 2.0, self.min_scale)

    def metrics(self) -> dict[str, Any]:
        """``loss_scale`` (None when disabled), ``overflows`` (fp16 overflows seen),
        ``skipped_steps`` (non-finite steps in any mode), ``consecutive_skips``."""
        return {"loss_scale": self._scale if self.enabled else None, "overflows": self._overflows,
                "skipped_steps": self._skipped_steps, "consecutive_skips": self._consecutive_skips}

    def state_dict(self) -> dict[str, Any]:
        """Plain Python numbers only, so it saves with ``torch.save`` or JSON."""
        return {"enabled": self.enabled, "scale": self._scale, "growth_tracker": self._growth_tracker,
                "hysteresis_left": self._hysteresis_left, "overflows": self._overflows,
                "skipped_steps": self._skipped_steps, "consecutive_skips": self._consecutive_skips}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from ``state_dict()``. Counters always load; scale, tracker and
        hysteresis load only when ``state`` and this scaler agree on ``enabled`` (a resume
        that switches fp16 <-> bf16 restarts the scale). Raises ValueError on a bad state."""
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"loss scaler state is missing keys {missing}; expected {list(_STATE_KEYS)}")
        for key in ("growth_tracker", "hysteresis_left", "overflows", "skipped_steps", "consecutive_skips"):
            check_int(f"loss scaler state {key}", state[key], 0)
        scale = state["scale"]
        if not isinstance(scale, (int, float)) or not (0 < scale < math.inf):
            raise ValueError(f"loss scaler state scale = {scale!r} is not allowed: must be finite and > 0")
        self._overflows = state["overflows"]
        self._skipped_steps = state["skipped_steps"]
        self._consecutive_skips = state["consecutive_skips"]
        if bool(state["enabled"]) == self.enabled and self.enabled:
            self._scale = max(float(scale), self.min_scale)
            self._growth_tracker = min(state["growth_tracker"], self.growth_interval - 1)
            self._hysteresis_left = min(max(state["hysteresis_left"], 1), self.hysteresis)
