"""Recovery: the run's feedback and stop paths, one object with declared collaborators:
the rollback (restore the good state, then replay, skip the window's data, or cut the
LR), the budget fallback (a more frugal configuration), and the stop on SIGTERM/SIGINT.
The policies (what to detect, what to restore, which configuration next) are
``rollback.py`` and ``budget_loop.py``; here they are carried out, logged and recorded.

What it needs of the run is ``RunHost`` (``Trainer`` is one): the live engine and
config, the checkpoint of the completed steps, and ``replace_engine``, the one place an
engine is swapped (between steps). ``StepOutcome`` is what one step of the loop hands
on: the engine's result and this rank's verdict on it.
"""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from mct.persistence.resume import rewind_metrics
from mct.persistence.run_dir import checkpoints, is_trusted, set_aside_newer, step_dir
from mct.reporting.events import append_event
from mct.run.budget_loop import record_config_change
from mct.run.rollback import Action, Decision, Snapshot, TrainingStopped, Verdict
from mct.run.signals import Preempted

if TYPE_CHECKING:
    from mct.config import EngineConfig
    from mct.data.sampler import DataPosition
    from mct.dist import DistContext
    from mct.engine import Engine, StepResult
    from mct.offload.snapshot import EngineSnapshot
    from mct.persistence.run_checkpoint import RunCheckpointer
    from mct.reporting.metrics import MetricsWriter
    from mct.run.budget_loop import BudgetLoop
    from mct.run.components import LoopCounters, Progress
    from mct.run.rollback import DivergenceDetector, RollbackController
    from mct.run.schedule import LRSchedule
    from mct.run.signals import StopRequest


@dataclass
class StepOutcome:
    """One step of the loop, as this rank saw it."""

    step: int
    result: StepResult | None
    """The engine's result; None when the step raised (budget exceeded, scale floor)."""
    verdict: Verdict
    """This rank's verdict (the loop then agrees on one across ranks)."""
    lr: float
    t_data: float
    """Seconds spent building the step's batches."""
    started: float
    """``time.perf_counter()`` when the step began."""


class RunHost(Protocol):
    """What recovery needs of the run it serves."""

    cfg: EngineConfig
    engine: Engine

    def save_checkpoint(self, trusted: bool = False) -> None: ...

    def replace_engine(self, cfg: EngineConfig, state_from: Path | None) -> None: ...


class Recovery:
    """Carries out the feedback decisions for ``host``'s run. The components are the
    run's own (their state is what a run checkpoint saves); recovery mutates them."""

    def __init__(self, host: RunHost, *, ctx: DistContext, run_dir: Path, counters: LoopCounters,
                 data: DataPosition, schedule: LRSchedule, detector: DivergenceDetector,
                 rollback: RollbackController, budget: BudgetLoop | None, checkpointer: RunCheckpointer,
                 writer: MetricsWriter, stop: StopRequest) -> None:
        self.host, self.ctx, self.run_dir = host, ctx, run_dir
        self.counters, self.data, self.schedule, self.detector = counters, data, schedule, detector
        self.rollback, self.budget, self.checkpointer = rollback, budget, checkpointer
        self.writer, self.stop = writer, stop

    # ---- rollback snapshots ----
    def capture(self) -> tuple[EngineSnapshot, dict[str, Any]]:
        """The engine's and the loop's state for a rollback snapshot (the engine's copy
        under a tag the good snapshot does not hold, where the engine keeps copies)."""
        good = self.rollback.good
        tag = "snapshot1" if good is not None and good.engine.tag == "snapshot0" else "snapshot0"
        return self.host.engine.snapshot(tag), {"loop": self.counters.state_dict(),
                                                "detector": self.detector.state_dict()}

    def restore(self, snapshot: Snapshot) -> None:
        """Put a rollback snapshot back: the engine's state, the loop's counters and the
        detector's statistics."""
        snapshot.engine.restore()
        self.counters.load_state_dict(snapshot.loop["loop"])
        self.detector.load_state_dict(snapshot.loop["detector"])

    # ---- the feedback paths ----
    def roll_back(self, step: int, verdict: Verdict) -> None:
        """Restore the newest good state and apply the rollback's decision (replay, skip,
        LR cut); set aside checkpoints and metrics rows past it, so disk, memory and
        metrics agree on the good step; log it. Raises TrainingStopped when no rollback
        is left."""
        detail, main = self.detector.detail or verdict.value, self.ctx.is_main
        try:
            d = self.rollback.decide(step, detail)
        except TrainingStopped as e:
            good = self.rollback.good
            if good is not None:  # what is left in memory is a good state, never the diverged one
                self.restore(good)
            append_event(self.run_dir, step=step, kind="stop", action="exit 3", reason=detail, is_main=main)
            raise TrainingStopped(f"{e}; the model state is that of the last good step ({good.step if good else step}). "
                                  f"{_last_good_checkpoint(self.run_dir)} Try: lower train.lr, precision.mode = "
                                  f"'bf16', or look at the data of steps near {step}") from None
        self.restore(d.restore)
        if d.action is Action.SKIP:
            self.data.skip(*d.window)
        elif d.action is Action.LR_CUT:
            self.schedule.cut(self.host.cfg.train.lr_cut_factor)
        self.writer.flush()
        rewind_metrics(self.run_dir, d.restore.step, [self.writer.path])  # the history stays one clean series
        self.checkpointer.unconfirmed = None
        if main:
            set_aside_newer(self.run_dir, d.restore.step, why="diverged")
        self._log_rollback(step, detail, d)

    def _log_rollback(self, step: int, detail: str, d: Decision) -> None:
        main, window = self.ctx.is_main, f"steps {d.window[0]}-{d.window[1]}"
        append_event(self.run_dir, step=step, kind="rollback", action=f"{d.action.value}: restore step {d.restore.step}",
                     reason=detail, is_main=main, rollbacks=self.rollback.total)
        if d.action is Action.SKIP:
            append_event(self.run_dir, step=step, kind="skip_window", action=f"skip the batches of {window}",
                         reason=detail, is_main=main, data_offset=self.data.offset)
        if d.action is Action.LR_CUT:
            append_event(self.run_dir, step=step, kind="lr_cut", action=f"lr x {self.schedule.scale:g}",
                         reason=detail, is_main=main)
        if main:
            print(f"mct: warning: {detail} at step {step}: rollback {self.rollback.total}/"
                  f"{self.host.cfg.train.max_rollbacks} ({d.action.value}), restored the state of step "
                  f"{d.restore.step}", file=sys.stderr)

    def preempt(self, signum: int, bar: Progress, trusted: bool = False) -> None:
        """Save the last completed step, log, print one line; raises Preempted. ``trusted``:
        the step that made this state passed the divergence checks (finite loss and gradient
        norm) and applied its update, so its checkpoint is marked trusted at once, as the
        run's last step's is (no later step will confirm it)."""
        name = signal.Signals(signum).name
        step = self.counters.step
        bar.close()
        if step > 0:
            self.host.save_checkpoint(trusted=trusted)
        append_event(self.run_dir, step=step, kind="signal", action=f"checkpoint step {step}, exit {128 + signum}",
                     reason=name, is_main=self.ctx.is_main)
        self.stop.cancel_watchdog()
        raise Preempted(signum, f"stopped by {name} at step {step}; resume with mct train --resume {self.run_dir}")

    def budget_fallback(self, step: int) -> None:
        """MemoryBudgetExceeded at ``step`` under ``auto``: checkpoint the last completed
        step, swap in an engine of the planner's next, more frugal configuration with
        that checkpoint's state (``RunHost.replace_engine``), record the change. Raises
        ValueError when none is left."""
        assert self.budget is not None
        new_cfg, change = self.budget.next_config(self.host.cfg, self.detector.detail)
        done = self.counters.step
        if done > 0:
            self.host.save_checkpoint()
        self.host.replace_engine(new_cfg, step_dir(self.run_dir, done) if done > 0 else None)
        self.rollback.good = self.rollback.pending = None  # in-memory states have the old layout
        change = {"step": step, **change}
        to = change["to"]
        action = f"zero.stage={to['zero.stage']} checkpointing.policy={to['checkpointing.policy']}" + (
            " zero.reshard_root_after_forward=true" if to.get("zero.reshard_root_after_forward") else "")
        if self.ctx.is_main:
            record_config_change(self.run_dir, change)
            print(f"mct: warning: memory budget exceeded at step {step}; continuing with {action}", file=sys.stderr)
        append_event(self.run_dir, step=step, kind="budget_fallback", action=action, reason=self.detector.detail,
                     is_main=self.ctx.is_main)


def _last_good_checkpoint(run_dir: Path) -> str:
    found = [c for c in checkpoints(run_dir) if is_trusted(c[1])]
    if found:
        return f"The last good checkpoint is {found[-1][1]} (continue with mct train --resume {run_dir})."
    return "No checkpoint was written yet (train.checkpoint_every)."
