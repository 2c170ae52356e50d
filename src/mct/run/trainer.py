"""The training run: ``Trainer`` builds what a run needs (task, data, engine, the
Stateful components) and ``fit`` steps it to ``train.steps``; ``train(...)`` is the
one-call form every rank's process runs (launched by torchrun or ``mct train --nproc N``).

The loop only calls components in order; each decides for itself (``should_*``) and
owns its state. The feedback paths (rollback, budget fallback, stop on a signal) live
in ``recovery.py``. Rank 0 prints and writes ``metrics.jsonl``. With ``resume=True`` the
run in ``run_dir`` continues from its newest usable checkpoint (``mct.persistence``).
"""

from __future__ import annotations

import gc
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from mct.adapters import adapter_summary
from mct.config import EngineConfig
from mct.data import build_data, copy_tokenizer
from mct.context import data_parallel
from mct.data.sampler import DataPosition
from mct.dist import DistContext, agree, broadcast_from_main, error_of
from mct.engine import Engine
from mct.machine.load import LoadWatch
from mct.memory import host
from mct.memory.process import job_resident, resident_peak
from mct.memory.tracker import MemoryBudgetExceeded
from mct.persistence.checkpoint import load_engine_state, set_rng_state
from mct.persistence.export import export_engine
from mct.persistence.files import read_json
from mct.persistence.resume import check_corpus, record_resume, resume_changes, rewind_metrics
from mct.persistence.run_checkpoint import RunCheckpointer, upgrade_trainer_state
from mct.persistence.run_dir import check_new_run_dir, checkpoints, newest_usable, set_aside_newer
from mct.planner.grid import resized_batch
from mct.precision import LossScaleFloorError
from mct.reporting.events import append_event
from mct.reporting.metrics import MetricsWriter, record_metadata, write_metadata
from mct.reporting.report import TrainSummary, solver_pick
from mct.run.budget_loop import BudgetLoop
from mct.run.components import LoopCounters, Progress, StepLog, Validator, worst_verdict
from mct.run.faults import FaultPlan
from mct.run.recovery import Recovery, StepOutcome
from mct.run.recipe import recipe_line
from mct.run.resolve import resolve_once
from mct.run.rollback import DivergenceDetector, RollbackController, Verdict
from mct.run.schedule import LRSchedule
from mct.run.signals import StopRequest
from mct.run.utilization import Utilization, tracks_every_step
from mct.persistence.hf_export import copy_hf_assets, write_run_hf
from mct.persistence.init_from import load_pretrained
from mct.task import (Task, build_model as build_task_model, builds_on_meta, check_tokens, seeded, task_for,
                      with_loss_chunk)
# build_gpt and seeded_gpt_loss: re-exported for tests/run/test_trainer.py
from mct.task.gpt import build_gpt, make_optimizer, seeded_gpt_loss, step_batches  # noqa: F401


class Trainer:
    """One rank's run. Stateful: ``state_dict()`` is ``{key: component.state_dict()}``
    of the components below, what a run checkpoint saves and a resume restores.

    - ``counters`` (``loop``): steps done, optimizer steps, skips, validation losses;
    - ``data`` (``data``): the data position and the windows a rollback skipped;
    - ``schedule`` (``schedule``): the LR scale the rollback's LR cuts change;
    - ``detector`` (``detector``): the divergence statistics;
    - ``rollback`` (``rollback``): the rollback policy's counters.
    """

    def __init__(self, cfg: EngineConfig, run_dir: str | Path, ctx: DistContext | None = None, *,
                 progress: bool = True, resume: bool = False, stop: StopRequest | None = None,
                 task: Task | None = None) -> None:
        """Raises ValueError (every rank alike) for a run dir that holds a run (new
        runs), a changed corpus or no usable checkpoint (resumes), a config the engine
        or planner rejects. A process started by a torchrun restart resumes by itself
        (from scratch when the group died before its first checkpoint)."""
        self.ctx = ctx = ctx or DistContext.current()
        self.run_dir = Path(run_dir)
        self.stop = stop or StopRequest()
        self.progress_enabled = progress and ctx.is_main
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if restart and not resume:
            resume = self._resumes_after_restart(restart)
        elif not resume:
            agree(error_of(check_new_run_dir, self.run_dir) if ctx.is_main else None)
        self.task = task if task is not None else task_for(cfg)  # the CLI hands on the one it checked
        self.cfg, self.choice = resolve_once(cfg, self.task, ctx)  # the launcher's answer, or rank 0's
        self.task = with_loss_chunk(self.task, self.cfg.train.loss_chunk_tokens)  # auto may choose chunking
        if self.cfg.data.micro_batch_size != cfg.data.micro_batch_size:  # and the micro-batch (memory.solver_allow)
            self.task = replace(self.task, batch=resized_batch(self.task.batch, self.cfg.data.micro_batch_size))
        # context groups share their windows: the data is split over world / parallel.context ranks
        self.data_rank, self.data_world = data_parallel(ctx.rank, ctx.world_size, self.cfg.parallel.context)
        self.corpus, self.sampler = build_data(self.cfg, self.data_world)
        check_tokens(self.task, self.corpus)
        if resume:
            agree(error_of(check_corpus, self.run_dir, self.corpus.fingerprint) if ctx.is_main else None)
            agree(error_of(self.corpus.verify_contents) if ctx.is_main else None)  # a prepared DIR's sha256
        self.loss_fn = seeded(self.task.loss_fn)
        self.engine = self.build_engine(self.cfg)
        if self.cfg.train.init_from:  # on resume too: the frozen base is rebuilt as at the start
            load_pretrained(self.engine, self.cfg.train.init_from)
        tcfg = self.cfg.train
        self.counters = LoopCounters()
        self.data = DataPosition()
        self.schedule = LRSchedule(tcfg)
        self.detector = DivergenceDetector(tcfg)
        self.rollback = RollbackController(tcfg)
        self.checkpointer = RunCheckpointer(self.run_dir, tcfg, self.stateful(), is_main=ctx.is_main)
        self.validator = Validator(tcfg, self.sampler, self.task.loss_fn)
        predicted = self.choice["predicted_peak_bytes"] if self.choice else None
        self.utilization = self._utilization()
        self.log = StepLog(self.cfg, self.data_world, ctx.rank, predicted, self.utilization)
        self.budget = BudgetLoop.maybe(cfg, self.choice, ctx.world_size, self.task)
        self.faults = FaultPlan.from_env()
        if resume:
            self._resume()
        self.writer = MetricsWriter(self.run_dir, ctx.rank, tensorboard=tcfg.tensorboard)
        if ctx.is_main and not resume:
            write_metadata(self.run_dir, config=self.cfg.to_dict(), world_size=ctx.world_size, backend=ctx.backend,
                           device=str(ctx.device), extra={**self._metadata_extra(), "plan": self.choice,
                                                          "utilization": self.utilization.metadata()})
            trained_with = copy_tokenizer(self.corpus, self.run_dir)
            if self.task.hf_dir:  # the config and tokenizer stay with the run (export, sample)
                note = copy_hf_assets(self.task.hf_dir, self.run_dir / "hf", tokenizer=trained_with)
                if note:
                    print(f"mct: warning: {note}", file=sys.stderr)
        self.bar = Progress(False, tcfg.steps, 0)  # fit() draws the real one; run_step() alone draws none
        self.recovery = Recovery(self, ctx=ctx, run_dir=self.run_dir, counters=self.counters, data=self.data,
                                 schedule=self.schedule, detector=self.detector, rollback=self.rollback,
                                 budget=self.budget, checkpointer=self.checkpointer, writer=self.writer, stop=self.stop)

    # ---- Stateful ----
    def stateful(self) -> dict[str, Any]:
        return {"loop": self.counters, "data": self.data, "schedule": self.schedule, "detector": self.detector,
                "rollback": self.rollback}

    def state_dict(self) -> dict[str, Any]:
        return {k: c.state_dict() for k, c in self.stateful().items()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for k, c in self.stateful().items():
            c.load_state_dict(sd[k])

    def header(self) -> dict[str, Any]:
        """The run's fixed facts a checkpoint records beside the components."""
        return {"config": self.cfg.to_dict(), "world_size": self.ctx.world_size,
                "global_micro_batches": self.cfg.data.grad_accum * self.data_world}

    # ---- building ----
    def build_engine(self, cfg: EngineConfig) -> Engine:
        """A fresh model and engine for ``cfg``. Stage 3 and offload never hold the whole
        model: it is built on meta and materialized a unit at a time."""
        host.for_building(host.mode_of(cfg, self.ctx.device.type))  # before the model is built
        task = self.task  # the model does not depend on the stage, policy or offload a config picks
        model, program = build_task_model(task, cfg, on_meta=builds_on_meta(cfg))
        optimizer = task.optimizer or make_optimizer(cfg)
        groups = task.param_groups(model) if task.param_groups else None
        engine = Engine(model, optimizer, cfg, param_groups=groups, ctx=self.ctx, init_program=program)
        if engine.shared_note and self.ctx.is_main:
            print(f"mct: warning: {engine.shared_note} (where /dev/shm is too small, a container's --shm-size "
                  f"enlarges it; distributed.shared_memory = false keeps messages without this notice)",
                  file=sys.stderr)
        return engine

    def replace_engine(self, cfg: EngineConfig, state_from: Path | None) -> None:
        """Swap the run's engine for one built for ``cfg`` (the budget fallback's one
        door). Call between steps only, on every rank (collective). The old engine is
        closed (offload files, I/O thread) and dropped before the new one allocates;
        the new one loads the engine state of the checkpoint directory ``state_from``
        when given (resharded to the new layout), else keeps its fresh initialization.
        Afterwards ``engine`` and ``cfg`` are the new ones; the loop's components are
        untouched, and in-memory rollback snapshots of the old engine must not be
        restored into it (the caller drops them)."""
        self.engine.close()
        self.engine = None  # type: ignore[assignment]  # free the old engine before the new one allocates
        gc.collect()  # its hooks and wrapped forwards hold it in reference cycles
        engine = self.build_engine(cfg)
        if cfg.train.init_from:  # the frozen base as the run built it (checked against the checkpoint's)
            load_pretrained(engine, cfg.train.init_from)
        if state_from is not None:
            load_engine_state(engine, state_from)
        self.engine, self.cfg = engine, cfg

    def _utilization(self) -> Utilization:
        """The step's FLOPs and this machine's matmul peak (rank 0 counts, and measures
        the machine the first time; every rank gets its answer)."""
        found = None
        if self.ctx.is_main:
            # auto's plan has it (of an untracked step); else, or when every step tracks memory, a dry run now
            planned = None if tracks_every_step(self.cfg, self.ctx.device.type) else \
                (self.choice or {}).get("predicted_step_s")
            found, warning = Utilization.for_run(self.task, self.cfg, self.ctx.world_size, self.ctx.device.type,
                                                 predicted_step_s=planned)
            if warning:
                print(f"mct: warning: {warning}", file=sys.stderr)
        return broadcast_from_main(found)

    def _metadata_extra(self) -> dict[str, Any]:
        return {"corpus": self.corpus.metadata(), "recipe": recipe_line(self.cfg),
                "adapters": adapter_summary(self.engine.model, self.cfg.adapter),
                "n_params": sum(p.numel() for p in self.engine.model.parameters()),
                "rng": {"init_seed": "seed", "data": "numpy default_rng([seed, 0, step])",
                        "val_data": "numpy default_rng([seed, 1, i])",
                        "dropout": "torch.manual_seed(sha256('mct-dropout:seed:step:micro:rank'))"},
                "model_state_bytes": self.engine.model_state_bytes()}

    # ---- the loop ----
    def fit(self) -> TrainSummary:
        """Steps from ``counters.step`` to ``train.steps``; a checkpoint every
        ``train.checkpoint_every`` steps and after the last; then the consolidated
        weights to RUN_DIR/model.safetensors. Raises TrainingStopped (exit 3) or
        Preempted (128 + signal). Closes the engine (offload files) either way."""
        try:
            summary = self._loop()
            self._trim()
            export_engine(self.engine, self.run_dir / "model.safetensors")
            if self.task.hf_dir and self.ctx.is_main:  # an adapter run's merged (as --merge)
                write_run_hf(self.run_dir)
        finally:
            self.writer.close()
            self.engine.close()
        return summary

    def _loop(self) -> TrainSummary:
        tcfg, c = self.cfg.train, self.counters
        self.bar = Progress(self.progress_enabled, tcfg.steps, c.step)
        first, loss, t_start = c.step, float("nan"), time.perf_counter()
        with LoadWatch() as watch:  # what else ran meanwhile: says whether the steps can judge the profile
            while c.step < tcfg.steps:
                passed = self.run_step()
                loss = loss if passed is None else passed
        self.bar.close()
        if self.ctx.is_main:
            # the run's other ranks are other processes to /proc/stat: its load is known alone only
            line = self.utilization.check_profile(self.log.median_step_time(), len(self.log.step_times),
                                                  self.log.mfu_warned, watch.load() if self.ctx.world_size == 1 else None)
            if line:
                print(f"mct: warning: {line}", file=sys.stderr)
        if first >= tcfg.steps:  # resumed at or past the last step: nothing to run, keep its checkpoint
            self.save_checkpoint()
        self.stop.cancel_watchdog()
        elapsed = time.perf_counter() - t_start
        return TrainSummary(steps=tcfg.steps, final_loss=loss, final_val_loss=c.last_val, first_val_loss=c.first_val,
                            tokens_per_s=self.log.tokens_per_step * (tcfg.steps - first) / elapsed if elapsed > 0 else 0.0,
                            skipped_steps=c.skipped, peaks=self.log.peaks, run_dir=str(self.run_dir),
                            utilization=self.utilization.summary(self.log.median_step_time()),
                            page_faults=self.log.median_faults(),
                            host_malloc=host.mode_of(self.cfg, self.ctx.device.type), recipe=recipe_line(self.cfg),
                            resident=self.resident_peaks(), auto=solver_pick(self.choice),
                            adapters=adapter_summary(self.engine.model, self.cfg.adapter))

    def resident_peaks(self) -> dict[str, Any]:
        """Each process's peak resident set (VmHWM) so far: every rank's, gathered
        (collective), with the launcher's and an agent's on this machine
        (``mct.memory.process.job_resident``); rank 0 records it as metadata.json's ``resident``."""
        job = job_resident(self.engine.comm.all_gather_object(resident_peak()))
        if self.ctx.is_main:
            record_metadata(self.run_dir, "resident", job)
        return job

    def run_step(self) -> float | None:
        """One turn of the loop at step ``counters.step``: the step, the ranks' agreed
        verdict, then what it calls for (the passed step's metrics, validation and
        checkpoint; a rollback; the budget fallback; a preemption). Returns the loss of a
        passed step, else None. Collective. ``fit`` calls it; so can a caller that times steps."""
        outcome = self._step(self.counters.step)
        code, signum = worst_verdict(outcome.verdict.code, self.stop.signum, self.engine.comm, self.engine.device)
        agreed = list(Verdict)[code]
        if agreed is not outcome.verdict:
            self.detector.detail = f"{agreed.value} on another rank"
        passed = None
        if agreed is Verdict.BUDGET:
            self.recovery.budget_fallback(outcome.step)
        elif agreed is not Verdict.PASSED:
            self.recovery.roll_back(outcome.step, agreed)
            self.bar.jump(self.counters.step)
        else:
            passed = outcome.result.loss
            self._passed(outcome)
        if signum:  # the step that made the state to save passed and updated: its checkpoint is trusted
            self.recovery.preempt(signum, self.bar, trusted=agreed is Verdict.PASSED
                                   and outcome.result is not None and not outcome.result.skipped)
        return passed

    def _step(self, step: int) -> StepOutcome:
        """One training step with the faults of ``MCT_FAULT``."""
        rank, started = self.ctx.rank, time.perf_counter()
        self.rollback.maybe_snapshot(step, self.recovery.capture)
        self.faults.before_step(step, rank)
        t0 = time.perf_counter()
        lr = self.schedule.lr(self.counters.opt_step)
        for g in self.engine.optimizer.param_groups:
            g["lr"] = lr
        batches = step_batches(self.sampler, self.cfg, self.data.position(step), self.data_rank)
        t_data = time.perf_counter() - t0
        last = step == self.cfg.train.steps - 1
        logged = self.log.should_log(step, last, self.validator.should_validate(step, last))
        loss_fn = self.faults.wrap_loss(self.loss_fn, step, rank)
        try:  # only a logged row shows memory: the steps between skip the tracker's per-op cost
            out = self.engine.train_step(batches, loss_fn, track_memory=logged)
        except LossScaleFloorError as e:
            self.detector.detail = str(e).split(";")[0]
            return StepOutcome(step, None, Verdict.SCALE_FLOOR, lr, t_data, started)
        except MemoryBudgetExceeded as e:
            if self.budget is None:
                raise
            self.detector.detail = str(e)
            return StepOutcome(step, None, Verdict.BUDGET, lr, t_data, started)
        self.faults.after_update(step, self.engine, out.skipped)
        return StepOutcome(step, out, self.detector.observe(out.loss, out.grad_norm, out.skipped), lr, t_data, started)

    def _passed(self, outcome: StepOutcome) -> None:
        """A step every rank judged passed: count it, trust what it confirms, then let
        validation, metrics and the checkpointer each decide whether to act."""
        step_time = time.perf_counter() - outcome.started
        step, out, lr, t_data = outcome.step, outcome.result, outcome.lr, outcome.t_data
        assert out is not None, "a passed step has a result"
        c, last, updated = self.counters, step == self.cfg.train.steps - 1, not out.skipped
        self.rollback.passed(step, updated)
        if updated:
            self.checkpointer.confirm()  # the newest checkpoint's state just stepped cleanly
        c.skipped += out.skipped
        c.opt_step += updated
        c.step = step + 1
        record = self.log.record(step, out, lr, t_data, step_time, rollbacks=self.rollback.total)
        if self.validator.should_validate(step, last):
            c.validated(self.validator.run(self.engine, self.data_rank, self.data_world))
            self._trim()
            record["val_loss"] = c.last_val
        if self.log.should_log(step, last, "val_loss" in record):
            if self.cfg.data.packing == "documents":  # what the step's global batch held (docs/data.md)
                record.update(self.sampler.step_stats(self.data.position(step)))
            self.log.complete(record, out, {"skipped_steps": c.skipped,
                                            "consecutive_skips": self.detector.consecutive_skips})
            self.writer.log(record)
        if self.checkpointer.should_save(c.step, last):
            self.save_checkpoint(trusted=last and updated)
        self.bar.advance(out.loss, c.last_val)

    def _trim(self) -> None:
        """``host.trim_between`` under the run's resolved ``memory.host_malloc``."""
        host.trim_between(host.mode_of(self.cfg, self.ctx.device.type))

    def save_checkpoint(self, trusted: bool = False) -> None:
        """The checkpoint of ``counters.step`` completed steps (collective); the heap trimmed
        first (``host.trim_between``)."""
        self._trim()
        self.checkpointer.save(self.engine, self.counters.step, self.header(), trusted=trusted)

    # ---- resume ----
    def _resume(self) -> None:
        """Load the newest usable checkpoint (rank 0 picks it, warning about the newer
        ones it skipped), the components (and RNG streams when the world size is
        unchanged), set aside what is newer, rewind metrics past it and record the
        resume in metadata.json."""
        ctx, pick = self.ctx, None
        if ctx.is_main:
            try:
                path, _, warning = newest_usable(self.run_dir, self.engine.layout()["units"])
                pick = (str(path), warning)
            except ValueError as e:
                pick = str(e)
        pick = broadcast_from_main(pick)
        if isinstance(pick, str):
            raise ValueError(pick)
        path, warning = Path(pick[0]), pick[1]
        if warning and ctx.is_main:
            print(f"mct: warning: {warning}", file=sys.stderr)
        trainer = upgrade_trainer_state(read_json(path / "trainer.json"))
        meta = self.checkpointer.load(self.engine, path, trainer)
        if meta["world_size"] == ctx.world_size:
            set_rng_state(read_json(path / f"rank{ctx.rank}.json")["rng"])
        step = self.counters.step
        if ctx.is_main:
            set_aside_newer(self.run_dir, step)
            rewind_metrics(self.run_dir, step)
            record_resume(self.run_dir, from_step=step, world_size=ctx.world_size, zero_stage=self.engine.stage,
                          checkpoint=path.name, reason=warning,
                          changed=resume_changes(trainer["config"], self.cfg.to_dict(), refuse=False))
        self.engine.comm.barrier()  # no rank opens its metrics file before rank 0 has rewound it

    def _resumes_after_restart(self, restart: int) -> bool:
        """A restarted group: resume when the run has a complete checkpoint, else start
        over in the same run dir (its metrics rows dropped first: the other ranks wait in
        the broadcast). Returns whether to resume."""
        has = None
        if self.ctx.is_main:
            found = checkpoints(self.run_dir)
            has = bool(found)
            if not has:
                rewind_metrics(self.run_dir, 0)
            append_event(self.run_dir, step=found[-1][0] if has else 0, kind="restart",
                         action="resume from the newest checkpoint" if has else "start over (no checkpoint yet)",
                         reason=f"torchrun restart {restart} after a worker died")
        return bool(broadcast_from_main(has))


def train(cfg: EngineConfig, run_dir: str | Path, ctx: DistContext | None = None,
          progress: bool = True, resume: bool = False, stop: StopRequest | None = None,
          task: Task | None = None) -> TrainSummary:
    """Train (every rank calls it): ``Trainer(...).fit()``. A new run refuses a
    ``run_dir`` that holds a run (ValueError, checked by rank 0 before anything is
    written); ``resume`` continues the run there from its newest usable checkpoint
    (``cfg`` from ``resume_config``). ``stop``: the signal flag the loop looks at.
    ``task``: ``task_for(cfg)`` when the caller has built it already (``mct train``)."""
    return Trainer(cfg, run_dir, ctx, progress=progress, resume=resume, stop=stop, task=task).fit()
