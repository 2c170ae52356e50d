"""The training loop: schedule, evaluation, logging, stop conditions.

``train(cfg, run_dir)`` runs in every rank's process (launched by torchrun or
``mct train --nproc N``); rank 0 prints and writes ``metrics.jsonl``.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
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
from mct.offload import InitProgram, record_init
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
    """AdamW, with torch's fused kernel where every tensor it is given sits on a device
    that has one (CPU and CUDA): one pass over memory per step, about 7x faster than
    the default single-tensor loop on CPU (docs/stages.md, "offload")."""
    def factory(groups: list[dict]) -> torch.optim.Optimizer:
        params = [p for g in groups for p in g["params"]]
        fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
        return torch.optim.AdamW(groups, lr=cfg.train.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused or None)
    return factory


def build_model(cfg: EngineConfig) -> GPT:
    """The GPT, initialized from ``cfg.seed`` (identical on every rank)."""
    seed_everything(cfg.seed)
    return GPT(cfg.model)


def build_model_on_meta(cfg: EngineConfig) -> tuple[GPT, InitProgram]:
    """The GPT of ``build_model`` on the meta device, with the program that gives each
    parameter exactly ``build_model``'s values when the engine packs its unit."""
    seed_everything(cfg.seed)
    return record_init(lambda: GPT(cfg.model))


def step_batches(sampler: BatchSampler, cfg: EngineConfig, step: int, rank: int,
                 device: torch.device | str = "cpu") -> list[tuple]:
    return [(x, y, micro_seed(cfg.seed, step, m, rank))
            for m, (x, y) in enumerate(sampler.micro_batches(step, rank, device))]


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
          progress: bool = True) -> TrainSummary:
    ctx = ctx or DistContext.current()
    run_dir = Path(run_dir)
    cfg, choice = resolve_auto(cfg, ctx.world_size, device=ctx.device.type)  # before anything is allocated
    corpus, sampler = build_data(cfg, ctx.world_size)
    # Stage 3 and offload never hold the whole model: it is built on meta, a unit at a time.
    model, program = (build_model_on_meta(cfg) if cfg.zero.stage == 3 or cfg.offload.enabled
                      else (build_model(cfg), None))
    engine = Engine(model, make_optimizer(cfg), cfg,
                    param_groups=optimizer_groups(model, cfg.train.weight_decay), ctx=ctx, init_program=program)
    writer = MetricsWriter(run_dir, ctx.rank, tensorboard=cfg.train.tensorboard)
    if ctx.is_main:
        write_metadata(run_dir, config=cfg.to_dict(), world_size=ctx.world_size, backend=ctx.backend,
                       device=str(ctx.device), extra={**_metadata_extra(corpus, model, engine), "plan": choice})
    try:
        summary = _loop(cfg, engine, sampler, writer, ctx, run_dir, progress,
                        predicted=choice["predicted_peak_bytes"] if choice else None)
    finally:
        writer.close()
    export_weights(engine, run_dir / "model.safetensors", ctx)
    return summary


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
          ctx: DistContext, run_dir: Path, progress: bool, predicted: int | None = None) -> TrainSummary:
    tcfg = cfg.train
    tokens_per_step = cfg.data.micro_batch_size * cfg.model.seq_len * cfg.data.grad_accum * ctx.world_size
    bar = None
    if progress and ctx.is_main:
        from tqdm import tqdm
        bar = tqdm(total=tcfg.steps, desc="train", unit="step", dynamic_ncols=True)
    opt_step, consecutive_skips, skipped = 0, 0, 0
    first_val = last_val = None
    loss = float("nan")
    t_start = time.perf_counter()
    peaks: dict = {}
    warned = False
    for step in range(tcfg.steps):
        t0 = time.perf_counter()
        lr = lr_at(opt_step, tcfg)
        for g in engine.optimizer.param_groups:
            g["lr"] = lr
        batches = step_batches(sampler, cfg, step, ctx.rank)
        t_data = time.perf_counter() - t0
        try:
            out = engine.train_step(batches, seeded_gpt_loss)
        except LossScaleFloorError as e:
            raise TrainingStopped(f"{e} The parameters and optimizer state are those of the last good step "
                                  f"({opt_step}); nothing was updated by the failing step.") from None
        loss = out.loss
        skipped += out.skipped
        consecutive_skips = consecutive_skips + 1 if out.skipped else 0
        opt_step += not out.skipped
        if consecutive_skips >= MAX_CONSECUTIVE_SKIPS:
            raise TrainingStopped(f"{consecutive_skips} consecutive steps had non-finite gradients (last loss "
                                  f"{loss}); lower train.lr, use precision.mode='bf16', or check the data.")
        step_time = time.perf_counter() - t0
        record = {"step": step, "loss": loss, "lr": lr, "step_time_s": step_time,
                  "tokens_per_s": tokens_per_step / step_time, "peak_bytes": out.metrics["peak_bytes"],
                  "grad_norm": out.grad_norm, "skipped": out.skipped, "loss_scale": out.loss_scale,
                  "time_data_s": t_data}
        last = step == tcfg.steps - 1
        if tcfg.eval_every and (step % tcfg.eval_every == 0 or last):
            last_val = evaluate(engine, sampler, cfg, ctx.rank)
            first_val = last_val if first_val is None else first_val
            record["val_loss"] = last_val
        if step % tcfg.log_every == 0 or last or "val_loss" in record:
            m = dict(out.metrics)
            peaks = m.pop("peaks")
            m.pop("live")
            record.update(m)
            record.update(flatten_peaks(peaks))
            record["memory"] = peaks
            if predicted is not None:
                record["predicted_peak_bytes"] = predicted
                warning = peak_check(out.metrics["peak_bytes"], predicted)
                if warning and step > 0 and not warned:  # step 0 has no optimizer state yet
                    warned = True
                    record["peak_warning"] = warning
                    print(f"mct: warning (rank {ctx.rank}): {warning}", file=sys.stderr)
            record["errors"] = {"skipped_steps": skipped, "consecutive_skips": consecutive_skips,
                                "nonfinite_loss": int(not math.isfinite(loss))}
            writer.log(record)
        if tcfg.checkpoint_every and (step + 1) % tcfg.checkpoint_every == 0:
            engine.save(str(run_dir / "checkpoint"))
        if bar is not None:
            bar.update(1)
            post = {"loss": f"{loss:.3f}"}
            if last_val is not None:
                post["val"] = f"{last_val:.3f}"
            bar.set_postfix(post)
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - t_start
    return TrainSummary(steps=tcfg.steps, final_loss=loss, final_val_loss=last_val, first_val_loss=first_val,
                        tokens_per_s=tokens_per_step * tcfg.steps / elapsed, skipped_steps=skipped,
                        peaks=peaks, run_dir=str(run_dir))


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
