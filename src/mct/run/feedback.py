"""The training loop's feedback and stop paths, one step at a time: the faults of
``MCT_FAULT``, the divergence verdict agreed by all ranks, the rollback (replay, skip,
LR cut, stop) and the stop on SIGTERM/SIGINT. ``mct.run.trainer`` runs the loop; the
policy (what to detect, what to restore) is ``mct.run.rollback``.
"""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from mct.run.budget_loop import BudgetLoop, record_config_change
from mct.config import EngineConfig
from mct.data import BatchSampler
from mct.dist import DistContext
from mct.engine import Engine
from mct.reporting.events import append_event
from mct.run.faults import FaultPlan
from mct.memory.tracker import MemoryBudgetExceeded
from mct.reporting.metrics import MetricsWriter
from mct.precision import LossScaleFloorError
from mct.run.rollback import (REASON_CODES, DivergenceDetector, RollbackController, TrainingStopped, engine_state,
                          load_engine_state as restore_engine_state, truncate_jsonl)
from mct.run.schedule import lr_at
from mct.run.signals import Preempted, StopRequest


@dataclass
class Loop:
    """What one training loop works with (one object, so the helpers stay small).

    ``state`` is restored by a rollback together with the engine and the detector's
    statistics; ``rollback`` (counters, data offset, LR scale) persists across rollbacks."""
    cfg: EngineConfig
    engine: Engine
    sampler: BatchSampler
    writer: MetricsWriter
    ctx: DistContext
    run_dir: Path
    stop: StopRequest
    state: Any
    """The trainer's LoopState (``to_json`` / ``from_json``)."""
    save: Callable[["Loop"], None]
    """Writes the checkpoint of ``state.step`` completed steps (collective)."""
    batches: Callable[[int, int], list]
    """(data position, rank) -> this rank's micro-batches of that step."""
    loss_fn: Callable
    eval_loss_fn: Callable | None = None
    """(model, (input_ids, targets)) -> loss, for evaluation; None: the built-in GPT's."""
    rebuild: Callable[[EngineConfig], Engine] | None = None
    """A fresh engine (and model) for another configuration: the budget loop's fallback."""
    budget: BudgetLoop | None = None
    faults: FaultPlan = field(default_factory=FaultPlan.from_env)
    detector: DivergenceDetector = field(init=False)
    rollback: RollbackController = field(init=False)

    def __post_init__(self) -> None:
        self.detector = DivergenceDetector(self.cfg.train)
        self.rollback = RollbackController(self.cfg.train)

    def capture(self) -> tuple[dict, dict]:
        good = self.rollback.good
        held = good.engine.get("offload_snapshot", {}).get("tag") if good is not None else None
        tag = "snapshot1" if held == "snapshot0" else "snapshot0"  # offload: never over the good state
        return engine_state(self.engine, tag), {"state": self.state.to_json(), "detector": self.detector.state_dict()}

    def restore(self, engine_sd: dict, loop_sd: dict) -> None:
        restore_engine_state(self.engine, engine_sd)
        self.state = type(self.state).from_json(loop_sd["state"])
        self.detector.load_state_dict(loop_sd["detector"])

    def feedback_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the feedback loop."""
        return {"rollback": self.rollback.state_dict(), "detector": self.detector.state_dict()}

    def load_feedback_state(self, saved: dict[str, Any]) -> None:
        if "rollback" in saved:
            self.rollback.load_state_dict(saved["rollback"])
        if "detector" in saved:
            self.detector.load_state_dict(saved["detector"])


def run_step(lp: Loop) -> tuple[Any, str, float, float]:
    """One training step at ``lp.state.step``, with the faults of ``MCT_FAULT``.
    Returns (StepResult or None, divergence reason code or '', lr, data time)."""
    step, rank, rb = lp.state.step, lp.ctx.rank, lp.rollback
    rb.maybe_snapshot(step, lp.capture)
    lp.faults.before_step(step, rank)
    t0 = time.perf_counter()
    lr = lr_at(lp.state.opt_step, lp.cfg.train) * rb.lr_scale
    for g in lp.engine.optimizer.param_groups:
        g["lr"] = lr
    batches = lp.batches(step + rb.data_offset, rank)
    t_data = time.perf_counter() - t0
    try:
        out = lp.engine.train_step(batches, lp.faults.wrap_loss(lp.loss_fn, step, rank))
    except LossScaleFloorError as e:
        lp.detector.detail = str(e).split(";")[0]
        return None, "scale_floor", lr, t_data
    except MemoryBudgetExceeded as e:
        if lp.budget is None:
            raise
        lp.detector.detail = str(e)
        return None, "budget", lr, t_data
    lp.faults.after_update(step, lp.engine, out.skipped)
    return out, lp.detector.observe(out.loss, out.grad_norm, out.skipped), lr, t_data


def agree_verdict(lp: Loop, reason: str) -> tuple[str, int]:
    """Every rank's verdict and stop signal, MAX-reduced: all ranks act alike."""
    flags = torch.tensor([REASON_CODES.index(reason), lp.stop.signum], dtype=torch.float64,
                         device=lp.engine.device)
    lp.engine.comm.all_reduce_(flags, "max")
    agreed = REASON_CODES[int(flags[0])]
    if agreed and agreed != reason:
        lp.detector.detail = f"{agreed} on another rank"
    return agreed, int(flags[1])


def roll_back(lp: Loop, step: int, reason: str) -> None:
    """Restore the newest good state and apply the rollback's decision (replay, skip,
    LR cut); log it. Raises TrainingStopped when no rollback is left."""
    detail, run_dir, main = lp.detector.detail or reason, lp.run_dir, lp.ctx.is_main
    try:
        d = lp.rollback.decide(step, detail)
    except TrainingStopped as e:
        good = lp.rollback.good
        if good is not None:  # what is left in memory is a good state, never the diverged one
            lp.restore(good.engine, good.loop)
        append_event(run_dir, step=step, kind="stop", action="exit 3", reason=detail, is_main=main)
        raise TrainingStopped(f"{e}; the model state is that of the last good step ({good.step if good else step}). "
                              f"{last_good_checkpoint(run_dir)} Try: lower train.lr, precision.mode = 'bf16', "
                              f"or look at the data of steps near {step}") from None
    lp.restore(d.restore.engine, d.restore.loop)
    lp.writer.flush()
    truncate_jsonl(lp.writer.path, d.restore.step - 1)  # the history stays one clean series
    window = f"steps {d.window[0]}-{d.window[1]}"
    append_event(run_dir, step=step, kind="rollback", action=f"{d.action}: restore step {d.restore.step}",
                 reason=detail, is_main=main, rollbacks=lp.rollback.total)
    if d.action == "skip":
        append_event(run_dir, step=step, kind="skip_window", action=f"skip the batches of {window}",
                     reason=detail, is_main=main, data_offset=lp.rollback.data_offset)
    if d.action == "lr_cut":
        append_event(run_dir, step=step, kind="lr_cut", action=f"lr x {lp.rollback.lr_scale:g}",
                     reason=detail, is_main=main)
    if main:
        print(f"mct: warning: {detail} at step {step}: rollback {lp.rollback.total}/"
              f"{lp.cfg.train.max_rollbacks} ({d.action}), restored the state of step {d.restore.step}",
              file=sys.stderr)


def last_good_checkpoint(run_dir: Path) -> str:
    from mct.persistence.run_dir import checkpoints
    found = checkpoints(run_dir)
    if found:
        return f"The last good checkpoint is {found[-1][1]} (continue with mct train --resume {run_dir})."
    return "No checkpoint was written yet (train.checkpoint_every)."


def preempt(lp: Loop, signum: int, bar: Any) -> None:
    """Save the last completed step, log, print one line; raises Preempted."""
    name = signal.Signals(signum).name
    step = lp.state.step
    if bar is not None:
        bar.close()
    if step > 0:
        lp.save(lp)
    append_event(lp.run_dir, step=step, kind="signal", action=f"checkpoint step {step}, exit {128 + signum}",
                 reason=name, is_main=lp.ctx.is_main)
    lp.stop.cancel_watchdog()
    raise Preempted(signum, f"stopped by {name} at step {step}; resume with mct train --resume {lp.run_dir}")


def budget_fallback(lp: Loop, step: int) -> None:
    """MemoryBudgetExceeded at ``step`` under ``auto``: checkpoint the last completed
    step, rebuild the engine with the planner's next, more frugal configuration, load
    the checkpoint (resharded), record the change. Raises ValueError when none is left."""
    assert lp.budget is not None and lp.rebuild is not None
    new_cfg, change = lp.budget.next_config(lp.cfg, lp.detector.detail)
    from mct.persistence.checkpoint import load_engine_state
    from mct.persistence.run_dir import step_dir
    if lp.state.step > 0:
        lp.save(lp)
    lp.engine.close()  # offload files and the I/O thread
    lp.engine = None  # type: ignore[assignment]  # free the old engine before the new one allocates
    engine = lp.rebuild(new_cfg)
    if lp.state.step > 0:
        load_engine_state(engine, step_dir(lp.run_dir, lp.state.step))
    lp.engine, lp.cfg = engine, new_cfg
    lp.rollback.good = lp.rollback.pending = None  # in-memory states have the old layout
    change = {"step": step, **change}
    to = change["to"]
    action = f"zero.stage={to['zero.stage']} checkpointing.policy={to['checkpointing.policy']}"
    if lp.ctx.is_main:
        record_config_change(lp.run_dir, change)
        print(f"mct: warning: memory budget exceeded at step {step}; continuing with {action}", file=sys.stderr)
    append_event(lp.run_dir, step=step, kind="budget_fallback", action=action, reason=lp.detector.detail,
                 is_main=lp.ctx.is_main)
