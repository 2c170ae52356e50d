"""The training loop: schedule, evaluation, logging, checkpoints, stop conditions.

``train(cfg, run_dir)`` runs in every rank's process (launched by torchrun or
``mct train --nproc N``); rank 0 prints and writes ``metrics.jsonl``. With
``resume=True`` it continues the run in ``run_dir`` from its newest usable checkpoint
(see ``mct.persistence``).
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from mct.config import EngineConfig
from mct.data import BatchSampler, Corpus, build_data, copy_tokenizer
from mct.dist import DistContext
from mct.engine import Engine
from mct.reporting.events import append_event
from mct.run.budget_loop import BudgetLoop
from mct.run.feedback import Loop, agree_verdict, budget_fallback, preempt, roll_back, run_step
from mct.planner import peak_check, resolve_auto
from mct.reporting.metrics import MetricsWriter, flatten_peaks, fmt_bytes, write_metadata
from mct.models.gpt import gpt_loss
from mct.memory import host
from mct.persistence import load_engine_state, save_checkpoint
from mct.persistence.checkpoint import rng_state, set_rng_state
from mct.persistence.files import read_json
from mct.persistence.resume import check_corpus, record_resume, rewind_metrics
from mct.persistence.run_dir import check_new_run_dir, newest_usable, prune, set_aside_newer, step_dir
from mct.run.rollback import TrainingStopped  # noqa: F401 - re-exported: the CLI catches it from here
from mct.task.gpt import build_model, build_model_on_meta, gpt_task, make_optimizer, param_groups, seeded_gpt_loss, step_batches  # noqa: F401 - re-exported
from mct.run.signals import StopRequest


@dataclass
class LoopState:
    """What the loop carries from step to step; saved in every checkpoint."""
    step: int = 0
    """Steps completed (skipped ones included), = the next step to run."""
    opt_step: int = 0
    """Optimizer updates applied: the LR schedule's position."""
    skipped: int = 0
    consecutive_skips: int = 0
    first_val: float | None = None
    last_val: float | None = None
    rollbacks: int = 0

    def to_json(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "LoopState":
        return cls(**{k: d[k] for k in asdict(cls()) if k in d})


@dataclass
class TrainSummary:
    steps: int
    final_loss: float
    final_val_loss: float | None
    first_val_loss: float | None
    tokens_per_s: float
    skipped_steps: int
    peaks: dict[str, dict[str, int]] = field(default_factory=dict)
    run_dir: str = ""


def evaluate(engine: Engine, sampler: BatchSampler, cfg: EngineConfig, rank: int) -> float:
    losses = [engine.eval_loss(sampler.val_batch(i, rank), gpt_loss) for i in range(cfg.train.eval_batches)]
    return sum(losses) / len(losses)


def train(cfg: EngineConfig, run_dir: str | Path, ctx: DistContext | None = None,
          progress: bool = True, resume: bool = False, stop: StopRequest | None = None) -> TrainSummary:
    """Train (every rank calls it). A new run refuses a ``run_dir`` that holds a run
    (ValueError, checked by rank 0 before anything is written); ``resume`` continues the
    run there from its newest usable checkpoint (``cfg`` from ``resume_config``). A
    process started by a torchrun restart resumes by itself (from scratch when the group
    died before its first checkpoint). ``stop``: the signal flag the loop looks at."""
    ctx = ctx or DistContext.current()
    run_dir = Path(run_dir)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart and not resume:
        resume = _agree_restart(ctx, run_dir, restart)
    elif not resume:
        _agree(ctx, _error_of(check_new_run_dir, run_dir) if ctx.is_main else None)
    auto_cfg = cfg
    cfg, choice = resolve_auto(cfg, ctx.world_size, gpt_task(cfg),  # before anything is allocated
                               device=ctx.device.type)
    corpus, sampler = build_data(cfg, ctx.world_size)
    if resume:
        _agree(ctx, _error_of(check_corpus, run_dir, corpus.fingerprint) if ctx.is_main else None)

    def rebuild(c: EngineConfig) -> Engine:
        # the host allocator before the model is built (the engine sets it too, later)
        host.for_building(host.mode_of(c, ctx.device.type))
        # Stage 3 and offload never hold the whole model: it is built on meta, a unit at a time.
        model, program = (build_model_on_meta(c) if c.zero.stage == 3 or c.offload.enabled
                          else (build_model(c), None))
        return Engine(model, make_optimizer(c), c, param_groups=param_groups(model, c),
                      ctx=ctx, init_program=program)
    engine = rebuild(cfg)
    model = engine.model
    state, saved = _resume(engine, run_dir, ctx) if resume else (LoopState(), {})
    writer = MetricsWriter(run_dir, ctx.rank, tensorboard=cfg.train.tensorboard)
    if ctx.is_main and not resume:
        write_metadata(run_dir, config=cfg.to_dict(), world_size=ctx.world_size, backend=ctx.backend,
                       device=str(ctx.device), extra={**_metadata_extra(corpus, model, engine), "plan": choice})
        copy_tokenizer(corpus, run_dir)
    lp = Loop(cfg, engine, sampler, writer, ctx, run_dir, stop or StopRequest(), state, save=_save_checkpoint,
              batches=lambda position, rank: step_batches(sampler, cfg, position, rank), loss_fn=seeded_gpt_loss,
              rebuild=rebuild, budget=BudgetLoop.maybe(auto_cfg, choice, ctx.world_size, gpt_task(auto_cfg)))
    lp.load_feedback_state(saved)
    try:
        summary = _loop(lp, progress, predicted=choice["predicted_peak_bytes"] if choice else None)
        export_weights(lp.engine, run_dir / "model.safetensors", ctx)
    finally:
        writer.close()
        lp.engine.close()  # offload files and the I/O thread
    return summary


def _error_of(check, *args) -> str | None:
    try:
        check(*args)
    except ValueError as e:
        return str(e)
    return None


def _agree(ctx: DistContext, error: str | None) -> None:
    """Raise rank 0's ``error`` as ValueError on every rank (so no rank goes on alone)."""
    from mct.dist import broadcast_from_main
    error = broadcast_from_main(error)
    if error is not None:
        raise ValueError(error)


def _resume(engine: Engine, run_dir: Path, ctx: DistContext) -> tuple[LoopState, dict[str, Any]]:
    """Load the newest usable checkpoint (rank 0 picks it, warning about damaged newer
    ones), restore the loop state (and RNG streams when the world size is unchanged),
    rewind metrics past it and record the resume in metadata.json."""
    from mct.dist import broadcast_from_main
    pick: tuple[str, str | None] | str | None = None
    if ctx.is_main:
        try:
            path, _, warning = newest_usable(run_dir, engine.state_dict()["units"])
            pick = (str(path), warning)
        except ValueError as e:
            pick = str(e)
    pick = broadcast_from_main(pick)
    if isinstance(pick, str):
        raise ValueError(pick)
    path, warning = Path(pick[0]), pick[1]
    if warning and ctx.is_main:
        print(f"mct: warning: {warning}", file=sys.stderr)
    meta = load_engine_state(engine, path, verified=True)
    saved = read_json(path / "trainer.json")
    state = LoopState.from_json(saved)
    if meta["world_size"] == ctx.world_size:
        set_rng_state(read_json(path / f"rank{ctx.rank}.json")["rng"])
    if ctx.is_main:
        set_aside_newer(run_dir, state.step)
        rewind_metrics(run_dir, state.step)
        record_resume(run_dir, from_step=state.step, world_size=ctx.world_size, zero_stage=engine.stage,
                      checkpoint=path.name, reason=warning)
    engine.comm.barrier()  # no rank opens its metrics file before rank 0 has rewound it
    return state, saved


def _agree_restart(ctx: DistContext, run_dir: Path, restart: int) -> bool:
    """A restarted group: resume when the run has a complete checkpoint, else start
    over in the same run dir (its metrics rows dropped first: the other ranks wait in
    the broadcast). Returns whether to resume."""
    from mct.dist import broadcast_from_main
    from mct.persistence.run_dir import checkpoints
    has = None
    if ctx.is_main:
        found = checkpoints(run_dir)
        has = bool(found)
        if not has:
            rewind_metrics(run_dir, 0)
        append_event(run_dir, step=found[-1][0] if has else 0, kind="restart",
                     action="resume from the newest checkpoint" if has else "start over (no checkpoint yet)",
                     reason=f"torchrun restart {restart} after a worker died")
    return bool(broadcast_from_main(has))


def save_run_checkpoint(engine: Engine, run_dir: Path, cfg: EngineConfig, state: LoopState,
                        ctx: DistContext, extra: dict[str, Any] | None = None) -> None:
    """Checkpoint the loop after ``state.step`` steps into RUN_DIR/checkpoints, then keep
    the newest ``train.keep_checkpoints``. Collective; a complete one already there
    (the run resumed at its last step) is kept as it is."""
    from mct.dist import broadcast_from_main
    path = step_dir(run_dir, state.step)
    if broadcast_from_main((path / "meta.json").exists()):
        return
    trainer = {**state.to_json(), "config": cfg.to_dict(), "world_size": ctx.world_size,
               "global_micro_batches": cfg.data.grad_accum * ctx.world_size, **(extra or {})}
    save_checkpoint(path, engine, step=state.step, trainer=trainer, rank_state={"rng": rng_state()})
    if ctx.is_main:
        prune(run_dir, cfg.train.keep_checkpoints)


def export_weights(engine: Engine, path: Path, ctx: DistContext) -> None:
    """Consolidated fp32 weights (names as ``model.named_parameters()``), written by
    rank 0 to a temporary file and renamed. Collective: every rank must call it."""
    state = engine.full_state_dict()
    if ctx.is_main:
        from safetensors.torch import save_file
        tmp = path.with_suffix(".tmp")
        save_file({k: v.contiguous().cpu() for k, v in state.items()}, str(tmp))
        tmp.replace(path)


def _metadata_extra(corpus: Corpus, model: torch.nn.Module, engine: Engine) -> dict[str, Any]:
    return {"corpus": corpus.metadata(),
            "n_params": sum(p.numel() for p in model.parameters()),
            "rng": {"init_seed": "seed", "data": "numpy default_rng([seed, 0, step])",
                    "val_data": "numpy default_rng([seed, 1, i])",
                    "dropout": "torch.manual_seed(sha256('mct-dropout:seed:step:micro:rank'))"},
            "model_state_bytes": engine.model_state_bytes()}


def _loop(lp: Loop, progress: bool, predicted: int | None = None) -> TrainSummary:
    """Steps from ``lp.state.step`` until ``train.steps``, with the divergence feedback
    loop and the stop signal checked after every step; a checkpoint every
    ``train.checkpoint_every`` steps and after the last. Raises TrainingStopped (exit 3)
    or Preempted."""
    cfg, ctx, state = lp.cfg, lp.ctx, lp.state
    tcfg = cfg.train
    tokens_per_step = cfg.data.micro_batch_size * cfg.model.seq_len * cfg.data.grad_accum * ctx.world_size
    bar = None
    if progress and ctx.is_main:
        from tqdm import tqdm
        bar = tqdm(total=tcfg.steps, initial=min(state.step, tcfg.steps), desc="train", unit="step",
                   dynamic_ncols=True)
    first = state.step
    loss = float("nan")
    t_start = time.perf_counter()
    peaks: dict = {}
    warned = False
    while lp.state.step < tcfg.steps:
        step = lp.state.step
        t0 = time.perf_counter()
        out, reason, lr, t_data = run_step(lp)
        reason, signum = agree_verdict(lp, reason)
        if reason == "budget":
            budget_fallback(lp, step)
        elif reason:
            roll_back(lp, step, reason)
            if bar is not None:
                bar.n = lp.state.step
                bar.refresh()
        else:
            state = lp.state
            lp.rollback.passed(step)
            loss = out.loss
            state.skipped += out.skipped
            state.consecutive_skips = lp.detector.consecutive_skips
            state.opt_step += not out.skipped
            state.rollbacks = lp.rollback.total
            state.step = step + 1
            step_time = time.perf_counter() - t0
            record = {"step": step, "loss": loss, "lr": lr, "step_time_s": step_time,
                      "tokens_per_s": tokens_per_step / step_time, "peak_bytes": out.metrics["peak_bytes"],
                      "grad_norm": out.grad_norm, "skipped": out.skipped, "loss_scale": out.loss_scale,
                      "time_data_s": t_data, "rollbacks": lp.rollback.total}
            last = step == tcfg.steps - 1
            if tcfg.eval_every and (step % tcfg.eval_every == 0 or last):
                state.last_val = evaluate(lp.engine, lp.sampler, cfg, ctx.rank)
                state.first_val = state.last_val if state.first_val is None else state.first_val
                record["val_loss"] = state.last_val
            if step % tcfg.log_every == 0 or last or "val_loss" in record:
                peaks = _add_step_metrics(record, out, lp, predicted, warn=step > 0 and not warned)
                warned = warned or "peak_warning" in record
                lp.writer.log(record)
            if last or (tcfg.checkpoint_every and state.step % tcfg.checkpoint_every == 0):
                _save_checkpoint(lp)
            if bar is not None:
                bar.update(1)
                post = {"loss": f"{loss:.3f}"}
                if state.last_val is not None:
                    post["val"] = f"{state.last_val:.3f}"
                bar.set_postfix(post)
        if signum:
            preempt(lp, signum, bar)
    if bar is not None:
        bar.close()
    if first >= tcfg.steps:  # resumed at or past the last step: nothing to run, keep its checkpoint
        _save_checkpoint(lp)
    lp.stop.cancel_watchdog()
    elapsed = time.perf_counter() - t_start
    state = lp.state
    return TrainSummary(steps=tcfg.steps, final_loss=loss, final_val_loss=state.last_val,
                        first_val_loss=state.first_val,
                        tokens_per_s=tokens_per_step * (tcfg.steps - first) / elapsed if elapsed > 0 else 0.0,
                        skipped_steps=state.skipped, peaks=peaks, run_dir=str(lp.run_dir))


def _add_step_metrics(record: dict, out: Any, lp: Loop, predicted: int | None, warn: bool) -> dict:
    """The engine's per-step metrics and the error counters into ``record``; returns
    the peaks by stage."""
    m = dict(out.metrics)
    peaks = m.pop("peaks")
    m.pop("live")
    record.update(m)
    record.update(flatten_peaks(peaks))
    record["memory"] = peaks
    if predicted is not None:
        record["predicted_peak_bytes"] = predicted
        warning = peak_check(out.metrics["peak_bytes"], predicted)
        if warning and warn:  # step 0 has no optimizer state yet
            record["peak_warning"] = warning
            print(f"mct: warning (rank {lp.ctx.rank}): {warning}", file=sys.stderr)
    record["errors"] = {"skipped_steps": lp.state.skipped, "consecutive_skips": lp.detector.consecutive_skips,
                        "nonfinite_loss": int(not math.isfinite(out.loss))}
    return peaks


def _save_checkpoint(lp: Loop) -> None:
    """The checkpoint of ``lp.state.step`` completed steps (only ever called after a
    step that passed the divergence checks, or from a restored good state)."""
    save_run_checkpoint(lp.engine, lp.run_dir, lp.cfg, lp.state, lp.ctx, extra=lp.feedback_state())


def summary_table(s: TrainSummary) -> str:
    """Human-readable end-of-run summary."""
    lines = [f"run dir       {s.run_dir}",
             f"steps         {s.steps} ({s.skipped_steps} skipped)",
             f"train loss    {s.final_loss:.4f}"]
    if s.final_val_loss is not None:
        lines.append(f"val loss      {s.first_val_loss:.4f} (first eval) -> {s.final_val_loss:.4f} (last)")
    lines.append(f"tokens/s      {s.tokens_per_s:,.0f}")
    if s.peaks:
        cats = sorted({c for v in s.peaks.values() for c in v if c != "total"})
        lines.append("peak memory by phase (this rank, last logged step):")
        lines.append("  " + f"{'phase':<10}" + "".join(f"{c:>13}" for c in [*cats, "total"]))
        for phase, v in s.peaks.items():
            lines.append("  " + f"{phase:<10}" + "".join(f"{fmt_bytes(v.get(c, 0)):>13}" for c in [*cats, "total"]))
    return "\n".join(lines)
