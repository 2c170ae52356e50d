"""The training loop's feedback loop: detect divergence, roll back, then stop.

Signals (every rank decides from the same all-reduced numbers, and the trainer
agrees on the verdict with one MAX all-reduce, so ranks never disagree):
non-finite loss; a loss above ``train.loss_spike_factor`` x the median of the last
``train.loss_spike_window`` good steps; a gradient norm above ``train.grad_norm_factor``
x the median of recent good norms; ``train.max_consecutive_skips`` skipped steps in a
row; the fp16 loss scale at its floor (``LossScaleFloorError``).

A skipped step (non-finite gradients, no update) is not a pass: its loss, when
finite, is judged by the spike detector like any other, and it never makes a state
trusted.

Rollback: restore the newest good state (a CPU copy of the engine's and the loop's
state, taken every ``train.snapshot_every`` steps and trusted only once a step that
starts from it applied an update and passed detection; a run of skipped steps keeps a
snapshot taken inside it pending, so the rollback goes back to before the run). The window is the steps from that state to the
divergence. First divergence of a window: replay it (a transient fault leaves no
trace: the replay is bit-identical). Second: skip its batches (the data position moves
past them, PaLM-style). Third and later: also multiply the LR by
``train.lr_cut_factor``. After ``train.max_rollbacks`` rollbacks in the run, the next
divergence stops training (exit 3) with one line.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from mct.config import Name, TrainConfig
from mct.offload.snapshot import EngineSnapshot, cpu_copy  # cpu_copy: re-exported

MIN_HISTORY = 5
"""Good steps needed before the spike detectors judge (the median of fewer is noise)."""


class Verdict(Name):
    """A step's verdict; agreed over ranks by MAX of the index in this order, so a later
    one wins ('budget' is not a divergence: the budget loop handles it)."""

    PASSED = ""
    NONFINITE_LOSS = "nonfinite_loss"
    LOSS_SPIKE = "loss_spike"
    GRAD_NORM = "grad_norm"
    CONSECUTIVE_SKIPS = "consecutive_skips"
    SCALE_FLOOR = "scale_floor"
    BUDGET = "budget"

    @property
    def code(self) -> int:
        return list(Verdict).index(self)


class Action(Name):
    """What a rollback does besides restoring the good state."""

    REPLAY = "replay"
    SKIP = "skip"
    """Also skip the diverged window's batches."""
    LR_CUT = "lr_cut"
    """Also multiply the LR by ``train.lr_cut_factor``."""


class TrainingStopped(RuntimeError):
    """Training hit a stop condition; the message says why and what to do (exit 3)."""


class DivergenceDetector:
    """Running statistics of good steps and the divergence test.

    State: the last ``loss_spike_window`` good losses and gradient norms, and the count of
    consecutive skipped steps. ``observe`` returns the step's ``Verdict`` and only adds
    to the statistics when the step applied an update and passed."""

    def __init__(self, tcfg: TrainConfig) -> None:
        self.tcfg = tcfg
        self.losses: deque[float] = deque(maxlen=tcfg.loss_spike_window)
        self.norms: deque[float] = deque(maxlen=tcfg.loss_spike_window)
        self.consecutive_skips = 0
        self.detail = ""

    def observe(self, loss: float, grad_norm: float, skipped: bool) -> Verdict:
        """Judge one finished step; returns its Verdict, with ``self.detail`` saying a
        failure in words. A skipped step's finite loss is judged by the spike test too."""
        t = self.tcfg
        if not math.isfinite(loss):
            return self._fail(Verdict.NONFINITE_LOSS, f"non-finite loss {loss}")
        enough = min(MIN_HISTORY, t.loss_spike_window)
        if t.loss_spike_factor and len(self.losses) >= enough:
            med = statistics.median(self.losses)
            if loss > t.loss_spike_factor * med:
                what = "loss spike" if not skipped else "loss spike on a skipped step"
                return self._fail(Verdict.LOSS_SPIKE, f"{what} {loss:.4g} > train.loss_spike_factor "
                                  f"{t.loss_spike_factor:g} x running median {med:.4g}")
        if skipped:
            self.consecutive_skips += 1
            if self.consecutive_skips >= t.max_consecutive_skips:
                return self._fail(Verdict.CONSECUTIVE_SKIPS, f"{self.consecutive_skips} consecutive skipped steps "
                                  f"(non-finite gradients; train.max_consecutive_skips = {t.max_consecutive_skips})")
            return Verdict.PASSED
        if t.grad_norm_factor and len(self.norms) >= enough and math.isfinite(grad_norm):
            med = statistics.median(self.norms)
            if grad_norm > t.grad_norm_factor * med:
                return self._fail(Verdict.GRAD_NORM, f"gradient norm explosion {grad_norm:.4g} > "
                                  f"train.grad_norm_factor {t.grad_norm_factor:g} x running median {med:.4g}")
        self.consecutive_skips = 0
        self.losses.append(loss)
        self.norms.append(grad_norm)
        return Verdict.PASSED

    def _fail(self, code: Verdict, detail: str) -> Verdict:
        self.detail = detail
        return code

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses), "norms": list(self.norms), "consecutive_skips": self.consecutive_skips}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.losses = deque(sd["losses"], maxlen=self.tcfg.loss_spike_window)
        self.norms = deque(sd["norms"], maxlen=self.tcfg.loss_spike_window)
        self.consecutive_skips = int(sd["consecutive_skips"])


@dataclass
class Snapshot:
    step: int
    """The loop step that starts from this state."""
    engine: EngineSnapshot
    """The engine's copy (``Engine.snapshot``), restored by its own ``restore()``."""
    loop: dict[str, Any]
    """The loop's own state (optimizer steps, counters, detector statistics)."""


@dataclass
class Decision:
    action: Action
    restore: Snapshot
    window: tuple[int, int]
    """First and last step of the diverged window."""


@dataclass
class RollbackController:
    """Rollback policy and its bookkeeping; persists across rollbacks (never restored
    by one). ``decide`` returns a Decision; applying it (restoring the state, moving
    the data position, cutting the LR) is the trainer's job."""

    tcfg: TrainConfig
    good: Snapshot | None = None
    pending: Snapshot | None = None
    total: int = 0
    per_window: dict[int, int] = field(default_factory=dict)

    def maybe_snapshot(self, step: int, capture: Callable[[], tuple[EngineSnapshot, dict]]) -> None:
        """At the start of ``step``: take a pending snapshot when due (step 0, then
        every ``snapshot_every``); it becomes the rollback target once a step from it
        applies an update and passes (``passed``)."""
        every = self.tcfg.snapshot_every
        due = bool(every) and (self.good is None or step % every == 0)
        if due and (self.good is None or self.good.step != step) and \
                (self.pending is None or self.pending.step != step):
            engine, loop_sd = capture()
            self.pending = Snapshot(step, engine, cpu_copy(loop_sd))  # the engine's is a copy already

    def passed(self, step: int, updated: bool) -> None:
        """``step`` passed detection; ``updated``: it applied an update (a skipped step
        trusts nothing: the pending snapshot waits for a step that updates)."""
        if updated and self.pending is not None and self.pending.step <= step:
            self.good, self.pending = self.pending, None

    def decide(self, step: int, reason: str) -> Decision:
        """A divergence at ``step``: the action and the state to restore. Mutates the
        counters. Raises TrainingStopped when the rollback budget is spent or there is
        no good state to go back to."""
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
        action = Action.REPLAY if n == 1 else Action.SKIP if n == 2 else Action.LR_CUT
        return Decision(action, self.good, (start, step))

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the policy (plain numbers)."""
        return {"total": self.total, "per_window": {str(k): v for k, v in self.per_window.items()}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.total = int(sd["total"])
        self.per_window = {int(k): int(v) for k, v in sd["per_window"].items()}
