"""The training loop's feedback loop: detect divergence, roll back, then stop.

Signals (every rank decides from the same all-reduced numbers, and the trainer
agrees on the verdict with one MAX all-reduce, so ranks never disagree):
non-finite loss; a loss above ``train.loss_spike_factor`` x the median of the last
``train.loss_spike_window`` good steps; a gradient norm above ``train.grad_norm_factor``
x the median of recent good norms; ``train.max_consecutive_skips`` skipped steps in a
row; the fp16 loss scale at its floor (``LossScaleFloorError``).

Rollback: restore the newest good state (a CPU copy of the engine's and the loop's
state, taken every ``train.snapshot_every`` steps and trusted only once the step that
starts from it passed detection). The window is the steps from that state to the
divergence. First divergence of a window: replay it (a transient fault leaves no
trace: the replay is bit-identical). Second: skip its batches (the data position moves
past them, PaLM-style). Third and later: also multiply the LR by
``train.lr_cut_factor``. After ``train.max_rollbacks`` rollbacks in the run, the next
divergence stops training (exit 3) with one line.
"""

from __future__ import annotations

import copy
import math
import os
import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from mct.config import TrainConfig

MIN_HISTORY = 5
"""Good steps needed before the spike detectors judge (the median of fewer is noise)."""
REASON_CODES = ("", "nonfinite_loss", "loss_spike", "grad_norm", "consecutive_skips", "scale_floor", "budget")
"""Verdicts of a step, agreed over ranks by MAX: a later one wins ('budget' is not a divergence)."""


class TrainingStopped(RuntimeError):
    """Training hit a stop condition; the message says why and what to do (exit 3)."""


class DivergenceDetector:
    """Running statistics of good steps and the divergence test.

    State: the last ``loss_spike_window`` good losses and gradient norms, and the count of
    consecutive skipped steps. ``observe`` returns a reason code (see ``REASON_CODES``) or
    '' and only updates the statistics when the step passed."""

    def __init__(self, tcfg: TrainConfig) -> None:
        self.tcfg = tcfg
        self.losses: deque[float] = deque(maxlen=tcfg.loss_spike_window)
        self.norms: deque[float] = deque(maxlen=tcfg.loss_spike_window)
        self.consecutive_skips = 0
        self.detail = ""

    def observe(self, loss: float, grad_norm: float, skipped: bool) -> str:
        """Judge one finished step; returns '' (passed) or the reason code, with
        ``self.detail`` saying it in words."""
        t = self.tcfg
        if not math.isfinite(loss):
            return self._fail("nonfinite_loss", f"non-finite loss {loss}")
        if skipped:
            self.consecutive_skips += 1
            if self.consecutive_skips >= t.max_consecutive_skips:
                return self._fail("consecutive_skips", f"{self.consecutive_skips} consecutive skipped steps "
                                  f"(non-finite gradients; train.max_consecutive_skips = {t.max_consecutive_skips})")
            return ""
        enough = min(MIN_HISTORY, t.loss_spike_window)
        if t.loss_spike_factor and len(self.losses) >= enough:
            med = statistics.median(self.losses)
            if loss > t.loss_spike_factor * med:
                return self._fail("loss_spike", f"loss spike {loss:.4g} > train.loss_spike_factor "
                                  f"{t.loss_spike_factor:g} x running median {med:.4g}")
        if t.grad_norm_factor and len(self.norms) >= enough and math.isfinite(grad_norm):
            med = statistics.median(self.norms)
            if grad_norm > t.grad_norm_factor * med:
                return self._fail("grad_norm", f"gradient norm explosion {grad_norm:.4g} > train.grad_norm_factor "
                                  f"{t.grad_norm_factor:g} x running median {med:.4g}")
        self.consecutive_skips = 0
        self.losses.append(loss)
        self.norms.append(grad_norm)
        return ""

    def _fail(self, code: str, detail: str) -> str:
        self.detail = detail
        return code

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses), "norms": list(self.norms), "consecutive_skips": self.consecutive_skips}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.losses = deque(sd["losses"], maxlen=self.tcfg.loss_spike_window)
        self.norms = deque(sd["norms"], maxlen=self.tcfg.loss_spike_window)
        self.consecutive_skips = int(sd["consecutive_skips"])


def cpu_copy(obj: Any) -> Any:
    """Deep copy with every tensor cloned to CPU (a snapshot that the next steps cannot
    modify in place)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


@dataclass
class Snapshot:
    step: int
    """The loop step that starts from this state."""
    engine: dict[str, Any]
    """``Engine.state_dict()`` copied to CPU."""
    loop: dict[str, Any]
    """The loop's own state (optimizer steps, counters, detector statistics)."""


@dataclass
class Decision:
    action: str
    """'replay', 'skip' or 'lr_cut'."""
    restore: Snapshot
    window: tuple[int, int]
    """First and last step of the diverged window."""


@dataclass
class RollbackController:
    """Rollback bookkeeping; persists across rollbacks (never restored by one).

    ``data_offset`` is added to the step to get the data position (grows when a window
    is skipped); ``lr_scale`` multiplies the LR schedule (shrinks on an LR cut)."""

    tcfg: TrainConfig
    good: Snapshot | None = None
    pending: Snapshot | None = None
    total: int = 0
    per_window: dict[int, int] = field(default_factory=dict)
    data_offset: int = 0
    lr_scale: float = 1.0

    def maybe_snapshot(self, step: int, capture: Callable[[], tuple[dict, dict]]) -> None:
        """At the start of ``step``: take a pending snapshot when due (step 0, then
        every ``snapshot_every``); it becomes the rollback target once ``step`` passes."""
        every = self.tcfg.snapshot_every
        if every and (self.good is None or step % every == 0) and (self.good is None or self.good.step != step):
            engine_sd, loop_sd = capture()
            self.pending = Snapshot(step, cpu_copy(engine_sd), cpu_copy(loop_sd))

    def passed(self, step: int) -> None:
        if self.pending is not None and self.pending.step == step:
            self.good, self.pending = self.pending, None

    def decide(self, step: int, reason: str) -> Decision:
        """A divergence at ``step``: the action and the state to restore. Mutates the
        counters, ``data_offset`` and ``lr_scale``. Raises TrainingStopped when the
        rollback budget is spent or there is no good state to go back to."""
        self.pending = None
        if self.good is None:
            why = "before any step passed" if self.tcfg.snapshot_every else "with train.snapshot_every = 0"
            raise TrainingStopped(f"{reason} at step {step}, {why}: no good state to roll back to")
        if self.total >= self.tcfg.max_rollbacks:
            raise TrainingStopped(f"{reason} at step {step}, after {self.total} rollbacks "
                                  f"(train.max_rollbacks = {self.tcfg.max_rollbacks})")
        start = self.good.step
        n = self.per_window.get(start, 0) + 1
        self.per_window[start] = n
        self.total += 1
        action = "replay" if n == 1 else "skip" if n == 2 else "lr_cut"
        if action == "skip":
            self.data_offset += step - start + 1
        elif action == "lr_cut":
            self.lr_scale *= self.tcfg.lr_cut_factor
        return Decision(action, self.good, (start, step))

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the feedback loop (plain numbers)."""
        return {"total": self.total, "per_window": {str(k): v for k, v in self.per_window.items()},
                "data_offset": self.data_offset, "lr_scale": self.lr_scale}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.total, self.data_offset, self.lr_scale = int(sd["total"]), int(sd["data_offset"]), float(sd["lr_scale"])
        self.per_window = {int(k): int(v) for k, v in sd["per_window"].items()}


def truncate_jsonl(path: str | Path, last_step: int) -> None:
    """Drop the rows of a metrics JSONL file whose ``step`` > ``last_step``, in place
    (``os.truncate``: a writer holding the file open in append mode keeps working)."""
    import json
    p = Path(path)
    if not p.is_file():
        return
    keep = 0
    with open(p, "rb") as f:
        for line in f:
            if line.strip() and json.loads(line).get("step", -1) > last_step:
                break
            keep += len(line)
    os.truncate(p, keep)


def engine_state(engine: Any, tag: str = "snapshot") -> dict[str, Any]:
    """The engine's state for a snapshot (``Engine.snapshot_state``: references, the
    caller copies; under offload a handle to a copy in the offload store)."""
    return engine.snapshot_state(tag)


def load_engine_state(engine: Any, sd: dict[str, Any]) -> None:
    engine.load_snapshot_state(sd)
