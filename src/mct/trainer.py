"""The training loop: schedule, evaluation, logging, checkpoints, stop conditions.

``train(cfg, run_dir)`` runs in every rank's process (launched by torchrun or
``mct train --nproc N``); rank 0 prints and writes ``metrics.jsonl``. With
``resume=True`` it continues the run in ``run_dir`` from its newest usable checkpoint
(see ``mct.persistence``).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from mct.config import EngineConfig
from mct.data import BatchSampler, Corpus, build_data
from mct.dist import DistContext
from mct.engine import Engine
from mct.memory.plan import peak_check, resolve_auto
from mct.metrics import MetricsWriter, flatten_peaks, fmt_bytes, write_metadata
from mct.models.gpt import GPT, gpt_loss, optimizer_groups
from mct.persistence import load_engine_state, save_checkpoint
from mct.persistence.checkpoint import rng_state, set_rng_state
from mct.persistence.files import read_json
from mct.persistence.resume import check_corpus, record_resume, rewind_metrics
from mct.persistence.run_dir import check_new_run_dir, newest_usable, prune, set_aside_newer, step_dir
from mct.precision import LossScaleFloorError
from mct.schedule import lr_at
from mct.seeding import micro_seed, seed_everything

MAX_CONSECUTIVE_SKIPS = 20
"""Stop condition: this many skipped steps in a row means training cannot recover."""


class TrainingStopped(RuntimeError):
    """Training hit a stop condition; the message says why and what to do."""


def seeded_gpt_loss(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    """(input_ids, targets, seed): seed the dropout stream, then the GPT loss."""
    x, y, seed = batch
    torch.manual_seed(seed)
    return gpt_loss(model, (x, y))


def make_optimizer(cfg: EngineConfig):
    return lambda groups: torch.optim.AdamW(groups, lr=cfg.train.lr, betas=(0.9, 0.95), eps=1e-8)


def build_model(cfg: EngineConfig) -> GPT:
    """The GPT, initialized from ``cfg.seed`` (identical on every rank)."""
    seed_everything(cfg.seed)
    return GPT(cfg.model)


def step_batches(sampler: BatchSampler, cfg: EngineConfig, step: int, rank: int,
                 device: torch.device | str = "cpu") -> list[tuple]:
    """Rank ``rank``'s micro-batches of ``step`` with their dropout seeds, keyed by the
    global micro-batch index (the same on any world size for the same global batch)."""
    ga = cfg.data.grad_accum
    return [(x, y, micro_seed(cfg.seed, step, rank * ga + m))
            for m, (x, y) in enumerate(sampler.micro_batches(step, rank, device))]


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
          progress: bool = True, resume: bool = False) -> TrainSummary:
    """Train (every rank calls it). A new run refuses a ``run_dir`` that holds a run
    (ValueError, checked by rank 0 before anything is written); ``resume`` continues the
    run there from its newest usable checkpoint (``cfg`` from ``resume_config``)."""
    ctx = ctx or DistContext.current()
    run_dir = Path(run_dir)
    if not resume:
        _agree(ctx, _error_of(check_new_run_dir, run_dir) if ctx.is_main else None)
    cfg, choice = resolve_auto(cfg, ctx.world_size, device=ctx.device.type)  # before anything is allocated
    corpus, sampler = build_data(cfg, ctx.world_size)
    if resume:
        _agree(ctx, _error_of(check_corpus, run_dir, corpus.fingerprint) if ctx.is_main else None)
    model = build_model(cfg)
    engine = Engine(model, make_optimizer(cfg), cfg,
                    param_groups=optimizer_groups(model, cfg.train.weight_decay), ctx=ctx)
    state = _resume(engine, run_dir, ctx) if resume else LoopState()
    writer = MetricsWriter(run_dir, ctx.rank, tensorboard=cfg.train.tensorboard)
    if ctx.is_main and not resume:
        write_metadata(run_dir, config=cfg.to_dict(), world_size=ctx.world_size, backend=ctx.backend,
                       device=str(ctx.device), extra={**_metadata_extra(corpus, model, engine), "plan": choice})
    try:
        summary = _loop(cfg, engine, sampler, writer, ctx, run_dir, progress, state,
                        predicted=choice["predicted_peak_bytes"] if choice else None)
    finally:
        writer.close()
    export_weights(engine, run_dir / "model.safetensors", ctx)
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


def _resume(engine: Engine, run_dir: Path, ctx: DistContext) -> LoopState:
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
    return state


def save_run_checkpoint(engine: Engine, run_dir: Path, cfg: EngineConfig, state: LoopState,
                        ctx: DistContext) -> None:
    """Checkpoint the loop after ``state.step`` steps into RUN_DIR/checkpoints, then keep
    the newest ``train.keep_checkpoints``. Collective; a complete one already there
    (the run resumed at its last step) is kept as it is."""
    from mct.dist import broadcast_from_main
    path = step_dir(run_dir, state.step)
    if broadcast_from_main((path / "meta.json").exists()):
        return
    trainer = {**state.to_json(), "config": cfg.to_dict(), "world_size": ctx.world_size,
               "global_micro_batches": cfg.data.grad_accum * ctx.world_size}
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


def _loop(cfg: EngineConfig, engine: Engine, sampler: BatchSampler, writer: MetricsWriter,
          ctx: DistContext, run_dir: Path, progress: bool, state: LoopState,
          predicted: int | None = None) -> TrainSummary:
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
    for step in range(state.step, tcfg.steps):
        t0 = time.perf_counter()
        lr = lr_at(state.opt_step, tcfg)
        for g in engine.optimizer.param_groups:
            g["lr"] = lr
        batches = step_batches(sampler, cfg, step, ctx.rank)
        t_data = time.perf_counter() - t0
        try:
            out = engine.train_step(batches, seeded_gpt_loss)
        except LossScaleFloorError as e:
            raise TrainingStopped(f"{e} The parameters and optimizer state are those of the last good step "
                                  f"({state.opt_step}); nothing was updated by the failing step.") from None
        loss = out.loss
        state.skipped += out.skipped
        state.consecutive_skips = state.consecutive_skips + 1 if out.skipped else 0
        state.opt_step += not out.skipped
        state.step = step + 1
        if state.consecutive_skips >= MAX_CONSECUTIVE_SKIPS:
            raise TrainingStopped(f"{state.consecutive_skips} consecutive steps had non-finite gradients (last "
                                  f"loss {loss}); lower train.lr, use precision.mode='bf16', or check the data.")
        step_time = time.perf_counter() - t0
        record = {"step": step, "loss": loss, "lr": lr, "step_time_s": step_time,
                  "tokens_per_s": tokens_per_step / step_time, "peak_bytes": out.metrics["peak_bytes"],
                  "grad_norm": out.grad_norm, "skipped": out.skipped, "loss_scale": out.loss_scale,
                  "time_data_s": t_data}
        last = step == tcfg.steps - 1
        if tcfg.eval_every and (step % tcfg.eval_every == 0 or last):
            state.last_val = evaluate(engine, sampler, cfg, ctx.rank)
            state.first_val = state.last_val if state.first_val is None else state.first_val
            record["val_loss"] = state.last_val
        if step % tcfg.log_every == 0 or last or "val_loss" in record:
            peaks, warned = _log_step(writer, record, out, state, ctx, predicted, warned)
        if last or (tcfg.checkpoint_every and state.step % tcfg.checkpoint_every == 0):
            save_run_checkpoint(engine, run_dir, cfg, state, ctx)
        if bar is not None:
            bar.update(1)
            post = {"loss": f"{loss:.3f}"}
            if state.last_val is not None:
                post["val"] = f"{state.last_val:.3f}"
            bar.set_postfix(post)
    if bar is not None:
        bar.close()
    if first >= tcfg.steps:  # resumed at or past the last step: nothing to run, keep its checkpoint
        save_run_checkpoint(engine, run_dir, cfg, state, ctx)
    elapsed = time.perf_counter() - t_start
    return TrainSummary(steps=tcfg.steps, final_loss=loss, final_val_loss=state.last_val,
                        first_val_loss=state.first_val,
                        tokens_per_s=tokens_per_step * (tcfg.steps - first) / elapsed if elapsed > 0 else 0.0,
                        skipped_steps=state.skipped, peaks=peaks, run_dir=str(run_dir))


def _log_step(writer: MetricsWriter, record: dict[str, Any], out: Any, state: LoopState, ctx: DistContext,
              predicted: int | None, warned: bool) -> tuple[dict, bool]:
    """Complete ``record`` with the step's metrics and memory, warn once when the peak
    passes the prediction, and write it. Returns (peaks by stage, warned)."""
    m = dict(out.metrics)
    peaks = m.pop("peaks")
    m.pop("live")
    record.update(m)
    record.update(flatten_peaks(peaks))
    record["memory"] = peaks
    if predicted is not None:
        record["predicted_peak_bytes"] = predicted
        warning = peak_check(out.metrics["peak_bytes"], predicted)
        if warning and record["step"] > 0 and not warned:  # step 0 has no optimizer state yet
            warned = True
            record["peak_warning"] = warning
            print(f"mct: warning (rank {ctx.rank}): {warning}", file=sys.stderr)
    record["errors"] = {"skipped_steps": state.skipped, "consecutive_skips": state.consecutive_skips,
                        "nonfinite_loss": int(not math.isfinite(record["loss"]))}
    writer.log(record)
    return peaks, warned


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
        lines.append("peak memory by stage (this rank, last logged step):")
        lines.append("  " + f"{'stage':<10}" + "".join(f"{c:>13}" for c in [*cats, "total"]))
        for stage, v in s.peaks.items():
            lines.append("  " + f"{stage:<10}" + "".join(f"{fmt_bytes(v.get(c, 0)):>13}" for c in [*cats, "total"]))
    return "\n".join(lines)
