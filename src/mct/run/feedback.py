"""The run's feedback and stop paths, as the Trainer applies them: the rollback
(restore the good state, then replay, skip the window's data, or cut the LR), the
budget fallback (a more frugal configuration), and the stop on SIGTERM/SIGINT.
The policies (what to detect, what to restore, which configuration next) are
``rollback.py`` and ``budget_loop.py``; here they are carried out, logged and recorded.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mct.persistence.checkpoint import load_engine_state
from mct.persistence.resume import rewind_metrics
from mct.persistence.run_dir import checkpoints, is_trusted, set_aside_newer, step_dir
from mct.reporting.events import append_event
from mct.run.budget_loop import record_config_change
from mct.run.rollback import Action, TrainingStopped, Verdict
from mct.run.signals import Preempted

if TYPE_CHECKING:  # the attributes ``Trainer`` provides (same room: run/)
    from mct.config import EngineConfig
    from mct.data.sampler import DataPosition
    from mct.dist import DistContext
    from mct.engine import Engine
    from mct.reporting.metrics import MetricsWriter
    from mct.run.budget_loop import BudgetLoop
    from mct.run.components import LoopCounters, Progress
    from mct.persistence.run_checkpoint import RunCheckpointer
    from mct.run.rollback import DivergenceDetector, RollbackController
    from mct.run.schedule import LRSchedule


class Feedback:
    """The Trainer's feedback actions (a part of ``Trainer``, kept in its own file)."""

    cfg: EngineConfig
    ctx: DistContext
    run_dir: Path
    engine: Engine
    counters: LoopCounters
    data: DataPosition
    schedule: LRSchedule
    detector: DivergenceDetector
    rollback: RollbackController
    budget: BudgetLoop | None
    checkpointer: RunCheckpointer
    writer: MetricsWriter
    bar: Progress
    stop: Any

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
                self.restore(good.engine, good.loop)
            append_event(self.run_dir, step=step, kind="stop", action="exit 3", reason=detail, is_main=main)
            raise TrainingStopped(f"{e}; the model state is that of the last good step ({good.step if good else step}). "
                                  f"{_last_good_checkpoint(self.run_dir)} Try: lower train.lr, precision.mode = "
                                  f"'bf16', or look at the data of steps near {step}") from None
        self.restore(d.restore.engine, d.restore.loop)
        if d.action is Action.SKIP:
            self.data.skip(*d.window)
        elif d.action is Action.LR_CUT:
            self.schedule.cut(self.cfg.train.lr_cut_factor)
        self.writer.flush()
        rewind_metrics(self.run_dir, d.restore.step, [self.writer.path])  # the history stays one clean series
        self.checkpointer.unconfirmed = None
        if main:
            set_aside_newer(self.run_dir, d.restore.step, why="diverged")
        window = f"steps {d.window[0]}-{d.window[1]}"
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
                  f"{self.cfg.train.max_rollbacks} ({d.action.value}), restored the state of step {d.restore.step}",
                  file=sys.stderr)

    def preempt(self, signum: int) -> None:
        """Save the last completed step, log, print one line; raises Preempted."""
        name = signal.Signals(signum).name
        step = self.counters.step
        self.bar.close()
        if step > 0:
            self.save_checkpoint()
        append_event(self.run_dir, step=step, kind="signal", action=f"checkpoint step {step}, exit {128 + signum}",
                     reason=name, is_main=self.ctx.is_main)
        self.stop.cancel_watchdog()
        raise Preempted(signum, f"stopped by {name} at step {step}; resume with mct train --resume {self.run_dir}")

    def budget_fallback(self, step: int) -> None:
        """MemoryBudgetExceeded at ``step`` under ``auto``: checkpoint the last completed
        step, rebuild the engine with the planner's next, more frugal configuration, load
        the checkpoint (resharded), record the change. Raises ValueError when none is left."""
        assert self.budget is not None
        new_cfg, change = self.budget.next_config(self.cfg, self.detector.detail)
        done = self.counters.step
        if done > 0:
            self.save_checkpoint()
        self.engine.close()  # offload files and the I/O thread
        self.engine = None  # type: ignore[assignment]  # free the old engine before the new one allocates
        engine = self.build_engine(new_cfg)
        if done > 0:
            load_engine_state(engine, step_dir(self.run_dir, done))
        self.engine, self.cfg = engine, new_cfg
        self.rollback.good = self.rollback.pending = None  # in-memory states have the old layout
        change = {"step": step, **change}
        to = change["to"]
        action = f"zero.stage={to['zero.stage']} checkpointing.policy={to['checkpointing.policy']}"
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
