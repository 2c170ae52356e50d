"""ZeRO stages 0-3 of mct beside torch DDP, ZeroRedundancyOptimizer and FSDP2.

    PYTHONPATH=src:. python benchmarks/zero.py [--steps 8] [--layers 4] [--json PATH]

Two spawned gloo ranks on CPU train the default GPT (``ModelConfig()``; micro-batch
16 x 128 tokens of synthetic data) with AdamW (decay / no-decay groups) and gradient
clipping at 1.0, in fp32, for each variant:

  mct0..mct3   Engine at zero.stage 0..3
  ddp          DistributedDataParallel (gradient_as_bucket_view) + AdamW
  zero_redund  DDP + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)
  fsdp2_rs     fully_shard per block and root, reshard_after_forward=True
  fsdp2_keep   the same with reshard_after_forward=False

Timing: untracked instances (engines with memory.track = false), round-robin over
variants every step so load bursts hit all alike; the step time is the slower
rank's. Memory: separate tracked instances, one at a time, two steps each, the
second measured with ``MemoryTracker`` (baselines: parameters, gradients and
optimizer state registered by category, forward/backward/step in tracker stages).
Model-state bytes: the engine's ``model_state_bytes()``; for baselines the unique
storages behind parameters, gradients (after backward) and optimizer state.
Ratios are against DDP and against ``mct.zero.partition.model_state_bytes`` at the
matching stage (DDP: 0, ZeroRedundancyOptimizer: 1, FSDP2: 3).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks` and `tests` importable
from benchmarks.common import (MFU_COLUMNS, add_mfu, format_table, interleave, mfu_line, mib,  # noqa: E402
                               step_utilization, summarize, write_json)
from mct.config import EngineConfig, ModelConfig  # noqa: E402
from mct.engine import Engine  # noqa: E402
from mct.memory.tracker import MemoryTracker  # noqa: E402
from mct.models.gpt import GPT, gpt_loss, optimizer_groups  # noqa: E402
from mct.zero.partition import model_state_bytes  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

VARIANTS = ("ddp", "zero_redund", "fsdp2_rs", "fsdp2_keep", "mct0", "mct1", "mct2", "mct3")
FORMULA_STAGE = {"ddp": 0, "zero_redund": 1, "fsdp2_rs": 3, "fsdp2_keep": 3,
                 "mct0": 0, "mct1": 1, "mct2": 2, "mct3": 3}
LR, WD, CLIP, SEED = 1e-3, 0.1, 1.0, 1337
MICRO_BATCH = 16


def adamw(groups: list[dict]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=LR, weight_decay=WD)


def synthetic_batch(step: int, rank: int, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randint(0, cfg.vocab_size, (MICRO_BATCH, cfg.seq_len + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: the local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        t = getattr(t, "_local_tensor", t)
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


@contextlib.contextmanager
def fsdp_storage_tracking(tracker: MemoryTracker):
    """FSDP2 frees and re-allocates unsharded parameters with ``storage.resize_``,
    which bypasses the dispatcher, so the CPU tracker would keep counting their
    first size. Re-read their size at every resize (what the engine does for its
    own units), only while this context is open."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def tracked_alloc(t: torch.Tensor) -> None:
        alloc(t)
        tracker.refresh(t)

    def tracked_free(t: torch.Tensor) -> None:
        free(t)
        tracker.refresh(t)
    _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = tracked_alloc
    _fsdp_param.free_storage = tracked_free
    try:
        yield
    finally:
        _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = alloc
        _fsdp_param.free_storage = free


class Baseline:
    """A torch-native data-parallel training step, optionally memory-tracked."""

    def __init__(self, kind: str, cfg: ModelConfig, tracker: MemoryTracker) -> None:
        torch.manual_seed(SEED)
        model: nn.Module = GPT(cfg)
        self.tracker = tracker
        for p in model.parameters():
            tracker.register(p, "params")
        if kind in ("ddp", "zero_redund"):
            from torch.nn.parallel import DistributedDataParallel as DDP
            self.model = DDP(model, gradient_as_bucket_view=True)
            groups = optimizer_groups(model, WD)
            if kind == "ddp":
                self.opt = adamw(groups)
            else:
                from torch.distributed.optim import ZeroRedundancyOptimizer
                self.opt = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=LR)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            reshard = kind == "fsdp2_rs"
            for block in model.blocks:
                fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
            self.model = fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
            for p in model.parameters():  # now sharded DTensors: count the local shards
                tracker.register(p, "params")
            self.opt = adamw(optimizer_groups(model, WD))
        self.fsdp = kind.startswith("fsdp2")
        self.state_bytes: dict[str, int] = {}

    def _optimizer_state(self) -> list[torch.Tensor]:
        inner = getattr(self.opt, "optim", self.opt)  # ZeroRedundancyOptimizer keeps the local one here
        return [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]

    def step(self, batch) -> None:
        t = self.tracker
        with fsdp_storage_tracking(t) if self.fsdp and t.enabled else contextlib.nullcontext():
            with t.phase("forward", "activations"):
                loss = gpt_loss(self.model, batch)
            with t.phase("backward", "other"):
                loss.backward()
            params = list(self.model.parameters())
            grads = [p.grad for p in params if p.grad is not None]
            for g in grads:
                t.register(g, "grads")
            with t.phase("optimizer", "other"):
                torch.nn.utils.clip_grad_norm_(params, CLIP)
                self.opt.step()
                for v in self._optimizer_state():
                    t.register(v, "optimizer")
                self.state_bytes = {"params": _storage_bytes(params), "grads": _storage_bytes(grads),
                                    "optimizer": _storage_bytes(self._optimizer_state())}
                self.opt.zero_grad(set_to_none=True)


def build(kind: str, cfg: ModelConfig, track: bool) -> tuple[Callable[[Any], dict], Callable[[], dict], Any]:
    """-> (step(batch) -> engine metrics or {}, model_state_bytes() -> dict, tracker)."""
    if kind.startswith("mct"):
        ecfg = EngineConfig.from_dict({"seed": SEED, "model": vars(cfg).copy(), "train": {"grad_clip": CLIP},
                                       "zero": {"stage": int(kind[3:])}, "memory": {"track": track}})
        torch.manual_seed(SEED)
        model = GPT(ecfg.model)
        engine = Engine(model, adamw, ecfg, param_groups=optimizer_groups(model, WD))
        return (lambda b: engine.train_step(b, gpt_loss).metrics), engine.model_state_bytes, engine.tracker
    base = Baseline(kind, cfg, MemoryTracker("cpu", enabled=track))

    def step(b) -> dict:
        base.step(b)
        return {}
    return step, (lambda: dict(base.state_bytes)), base.tracker


def measure_memory(kind: str, cfg: ModelConfig, rank: int) -> dict[str, Any]:
    """Two tracked steps; the second one's peaks and the model state after it."""
    step, state_fn, tracker = build(kind, cfg, track=True)
    step(synthetic_batch(0, rank, cfg))
    tracker.reset_peaks()
    step(synthetic_batch(1, rank, cfg))
    return {"peak_bytes": tracker.peak_total(), "peaks": tracker.peaks(), "model_state": state_fn()}


def rank_main(rank: int, world: int, cfg: ModelConfig, steps: int) -> dict[str, Any]:
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)  # c10d's renamed collectives, once per call site
    memory = {kind: measure_memory(kind, cfg, rank) for kind in VARIANTS}
    built = {kind: build(kind, cfg, track=False) for kind in VARIANTS}
    engine_metrics: dict[str, list[dict]] = {k: [] for k in VARIANTS if k.startswith("mct")}

    def runner(kind: str):
        step = built[kind][0]

        def run(i: int) -> None:
            m = step(synthetic_batch(2 + i, rank, cfg))
            if kind in engine_metrics:
                engine_metrics[kind].append(m)
        return run
    times = interleave({k: runner(k) for k in VARIANTS}, steps, warmup=1, before_each=dist.barrier)
    phases = {k: {f: statistics.median(m[f] for m in ms[1:]) for f in
                  ("time_forward_s", "time_backward_s", "time_step_s", "time_comm_s")}
              | {"comm_bytes": ms[-1]["comm_bytes"]} for k, ms in engine_metrics.items()}
    return {"times": times, "memory": memory, "engine_phases": phases}


def n_trainable(cfg: ModelConfig) -> int:
    torch.manual_seed(SEED)
    return sum(p.numel() for p in GPT(cfg).parameters() if p.requires_grad)  # tied weight once


def utilization(cfg: ModelConfig, world: int):
    """Model FLOPs per step (every variant trains the same GPT on the same batches, fp32)
    and the fp32 matmul peak of ``world`` one-thread ranks."""
    ecfg = EngineConfig.from_dict({"model": vars(cfg).copy()})
    return step_utilization(lambda: GPT(ecfg.model), gpt_loss, synthetic_batch(0, 0, cfg), ecfg, ranks=world,
                            threads=1)  # run_distributed's ranks run one thread each


def summarize_runs(results: list[dict], cfg: ModelConfig, world: int, util=None) -> list[dict[str, Any]]:
    n = n_trainable(cfg)
    tokens = world * MICRO_BATCH * cfg.seq_len
    rows = []
    for kind in VARIANTS:
        per_step = [max(ts) for ts in zip(*(r["times"][kind] for r in results))]  # the slower rank
        t = summarize(per_step)
        peak = max(r["memory"][kind]["peak_bytes"] for r in results)
        state = max(sum(r["memory"][kind]["model_state"].values()) for r in results)
        formula = sum(model_state_bytes(n, world, FORMULA_STAGE[kind], param_bytes=4, grad_bytes=4,
                                        master_bytes=0, optim_bytes_per_param=8).values())
        rows.append({"variant": kind, "step_ms": 1e3 * t["median"], "iqr_ms": 1e3 * t["iqr"],
                     "tokens_per_s": tokens / t["median"], "peak_bytes": peak, "model_state_bytes": state,
                     "formula_bytes": formula, "state_vs_formula": state / formula,
                     "model_state_by_rank": [r["memory"][kind]["model_state"] for r in results],
                     "peaks_by_rank": [r["memory"][kind]["peaks"] for r in results],
                     "engine_phases_rank0": results[0]["engine_phases"].get(kind)})
        if util is not None:
            add_mfu(rows[-1], util, t["median"])
    ddp = next(r for r in rows if r["variant"] == "ddp")
    for r in rows:
        r["time_vs_ddp"] = r["step_ms"] / ddp["step_ms"]
        r["peak_vs_ddp"] = r["peak_bytes"] / ddp["peak_bytes"]
        r["state_vs_ddp"] = r["model_state_bytes"] / ddp["model_state_bytes"]
        r["peak_mib"], r["state_mib"], r["formula_mib"] = (mib(r["peak_bytes"]), mib(r["model_state_bytes"]),
                                                           mib(r["formula_bytes"]))
    return rows


COLUMNS = [("variant", "variant"), ("step_ms", "step ms"), ("iqr_ms", "IQR ms"), ("tokens_per_s", "tok/s"),
           ("time_vs_ddp", "t/DDP"), ("peak_mib", "peak MiB"), ("peak_vs_ddp", "peak/DDP"),
           ("state_mib", "state MiB"), ("formula_mib", "formula MiB"), ("state_vs_formula", "state/formula"),
           ("state_vs_ddp", "state/DDP"), *MFU_COLUMNS]


def targets(rows: list[dict]) -> list[str]:
    """The issue's targets, each as a 'PASS'/'MISS' line with its numbers."""
    by = {r["variant"]: r for r in rows}
    out = []
    for k in ("mct0", "mct1", "mct2", "mct3"):
        ok = abs(by[k]["state_vs_formula"] - 1) <= 0.05
        out.append(f"{'PASS' if ok else 'MISS'} {k} model state within 5% of the formula: "
                   f"{by[k]['state_vs_formula']:.3f}x")
    s3, f = by["mct3"], by["fsdp2_rs"]
    out.append(f"{'PASS' if s3['peak_bytes'] <= f['peak_bytes'] else 'MISS'} mct3 peak <= FSDP2 (reshard): "
               f"{mib(s3['peak_bytes'])} vs {mib(f['peak_bytes'])} MiB")
    ratio = s3["step_ms"] / f["step_ms"]
    out.append(f"{'PASS' if ratio <= 1.2 else 'MISS'} mct3 step time <= 1.2x FSDP2 (reshard): {ratio:.2f}x")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="timed steps per variant (after 1 warm-up)")
    ap.add_argument("--layers", type=int, default=None, help="model.n_layer (default: ModelConfig's)")
    ap.add_argument("--world", type=int, default=2, help="ranks (spawned gloo processes)")
    ap.add_argument("--json", default="zero", help="result name (benchmarks/results/NAME.json) or a .json path")
    args = ap.parse_args(argv)
    cfg = ModelConfig() if args.layers is None else ModelConfig(n_layer=args.layers)
    results = run_distributed(rank_main, args.world, cfg, args.steps, timeout=1800.0)
    util = utilization(cfg, args.world)
    rows = summarize_runs(results, cfg, args.world, util)
    print(f"GPT {vars(cfg)}, {n_trainable(cfg):,} trainable params, {args.world} ranks, "
          f"micro-batch {MICRO_BATCH}x{cfg.seq_len}, fp32 AdamW, {args.steps} timed steps (median)")
    print(format_table(rows, COLUMNS))
    print(mfu_line(util))
    for k in ("mct0", "mct1", "mct2", "mct3"):
        ph = next(r for r in rows if r["variant"] == k)["engine_phases_rank0"]
        print(f"{k}: forward {1e3 * ph['time_forward_s']:.1f} ms, backward {1e3 * ph['time_backward_s']:.1f} ms, "
              f"step {1e3 * ph['time_step_s']:.1f} ms, comm wait {1e3 * ph['time_comm_s']:.1f} ms, "
              f"comm {mib(ph['comm_bytes'])} MiB/step")
    checks = targets(rows)
    print("\n".join(checks))
    path = write_json(args.json, {"model": vars(cfg), "world": args.world, "steps": args.steps,
                                  "micro_batch": MICRO_BATCH, "rows": rows, "targets": checks})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
