"""Checkpoint save and load of mct (stages 0-3) beside DCP save of an FSDP2 model.

    PYTHONPATH=src:. python benchmarks/checkpoint.py [--layers 4] [--d-model 256] [--repeats 3]

Two spawned gloo ranks on CPU, fp32 AdamW, a GPT of the given size. For each variant,
after two training steps (so optimizer state exists):

  mct0..mct3   Engine at zero.stage 0..3; ``mct.persistence.save_checkpoint`` (DCP
               with element-range pieces, JSON, manifest with sha256), then load of a
               fresh engine at the same stage through ``load_engine_state``
  fsdp2        fully_shard per block and root; ``dcp.save`` of ``get_state_dict(model,
               optimizer)``, then ``dcp.load`` + ``set_state_dict`` on a fresh FSDP2 model

Columns: save and load time (median over repeats, the slower rank), checkpoint size
on disk, and each rank's peak resident memory (Linux VmHWM, reset through
/proc/self/clear_refs before each measured call) during a training step and during a
save, with glibc returning every large free to the system at once
(MALLOC_MMAP_THRESHOLD_), so that resident memory follows live memory; "+MiB" is the
peak's rise over the resident memory just before the call (after one warm-up save and
load, so imports do not count). The target: a save's rise stays within the step's rise
plus one unit (master + two Adam moments of the largest unit): nothing is gathered.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks` and `tests` importable
from benchmarks.common import format_table, mib, write_json  # noqa: E402
from mct.config import EngineConfig, ModelConfig  # noqa: E402
from mct.engine import Engine  # noqa: E402
from mct.models.gpt import GPT, gpt_loss, optimizer_groups  # noqa: E402
from mct.persistence import load_engine_state, save_checkpoint  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

LR, WD, SEED, MICRO_BATCH = 1e-3, 0.1, 1337, 8


def adamw(groups: list[dict]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=LR, weight_decay=WD)


def batch(step: int, rank: int, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randint(0, cfg.vocab_size, (MICRO_BATCH, cfg.seq_len + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def _reset_hwm() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def _hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _measure(fn) -> tuple[float, int, int]:
    """(seconds, peak RSS bytes, peak minus the RSS before) of ``fn()``, with every
    rank starting together."""
    gc.collect()
    dist.barrier()
    _reset_hwm()
    before = _rss()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    peak = _hwm()
    return time.perf_counter() - t0, peak, peak - before


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _mct(stage: int, cfg: ModelConfig, rank: int):
    ecfg = EngineConfig.from_dict({"model": vars(cfg), "zero": {"stage": stage}, "memory": {"track": False}})
    torch.manual_seed(SEED)
    model = GPT(cfg)
    engine = Engine(model, adamw, ecfg, param_groups=optimizer_groups(model, WD))
    step = lambda i: engine.train_step(batch(i, rank, cfg), gpt_loss)  # noqa: E731
    save = lambda path: save_checkpoint(path, engine, step=engine.steps_done)  # noqa: E731

    def load(path: Path) -> None:
        torch.manual_seed(SEED)
        m = GPT(cfg)
        load_engine_state(Engine(m, adamw, ecfg, param_groups=optimizer_groups(m, WD)), path)
    unit = max(u.layout.numel for u in engine.sharded.units) * 4 * 3  # master + two Adam moments
    return step, save, load, unit


def _fsdp2(cfg: ModelConfig, rank: int):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def build():
        torch.manual_seed(SEED)
        model = GPT(cfg)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, adamw(optimizer_groups(model, WD))
    model, opt = build()

    def step(i: int) -> None:
        gpt_loss(model, batch(i, rank, cfg)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def save(path: Path) -> None:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))

    def load(path: Path) -> None:
        m, o = build()
        gpt_loss(m, batch(0, rank, cfg)).backward()  # optimizer state must exist to load into
        o.step()
        o.zero_grad(set_to_none=True)
        msd, osd = get_state_dict(m, o)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=str(path))
        set_state_dict(m, o, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return step, save, load, None


def rank_main(rank: int, world: int, cfg: ModelConfig, repeats: int, root: str) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    rows = []
    for name in ("mct0", "mct1", "mct2", "mct3", "fsdp2"):
        step = save = load = None
        gc.collect()  # the previous variant's engine (hooks make reference cycles) goes first
        step, save, load, unit = _mct(int(name[-1]), cfg, rank) if name.startswith("mct") else _fsdp2(cfg, rank)
        for i in range(2):
            step(i)
        save(Path(root) / f"{name}_warmup")  # first-call costs (imports, planner caches) excluded
        load(Path(root) / f"{name}_warmup")
        _, step_peak, step_extra = _measure(lambda: step(2))
        saves, loads, save_peak, save_extra, size = [], [], 0, 0, 0
        for r in range(repeats):
            path = Path(root) / f"{name}_{r}"
            t, peak, extra = _measure(lambda: save(path))
            saves.append(t)
            save_peak, save_extra = max(save_peak, peak), max(save_extra, extra)
            size = _dir_bytes(path)
            loads.append(_measure(lambda: load(path))[0])
        rows.append({"variant": name, "save_s": statistics.median(saves), "load_s": statistics.median(loads),
                     "size": size, "step_peak": step_peak, "save_peak": save_peak, "step_extra": step_extra,
                     "save_extra": save_extra, "unit_bytes": unit})
    return rows


COLUMNS = [("variant", "variant"), ("save_s", "save s"), ("load_s", "load s"), ("size_mib", "size MiB"),
           ("step_peak_mib", "step peak MiB"), ("save_peak_mib", "save peak MiB"),
           ("step_extra_mib", "step +MiB"), ("save_extra_mib", "save +MiB"), ("unit_mib", "unit MiB"),
           ("check", "save <= step + unit")]


def summarize(per_rank: list[list[dict]]) -> list[dict[str, Any]]:
    rows = []
    for i, r0 in enumerate(per_rank[0]):
        all_ranks = [p[i] for p in per_rank]
        step_peak = max(r["step_peak"] for r in all_ranks)
        save_peak = max(r["save_peak"] for r in all_ranks)
        unit = r0["unit_bytes"]
        rows.append({"variant": r0["variant"], "save_s": max(r["save_s"] for r in all_ranks),
                     "load_s": max(r["load_s"] for r in all_ranks), "size_mib": float(mib(r0["size"])),
                     "step_peak_mib": float(mib(step_peak)), "save_peak_mib": float(mib(save_peak)),
                     "step_extra_mib": float(mib(max(r["step_extra"] for r in all_ranks))),
                     "save_extra_mib": float(mib(max(r["save_extra"] for r in all_ranks))),
                     "unit_mib": None if unit is None else float(mib(unit)),
                     # the peak during a save, over the rank's resident memory at rest, stays within
                     # the step's own rise over rest plus one unit: nothing is gathered
                     "check": None if unit is None else ("PASS" if all(
                         r["save_extra"] <= r["step_extra"] + unit for r in all_ranks) else "MISS")})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4, help="model.n_layer")
    ap.add_argument("--d-model", type=int, default=256, help="model.d_model")
    ap.add_argument("--repeats", type=int, default=3, help="saves and loads per variant (median)")
    ap.add_argument("--world", type=int, default=2, help="ranks (spawned gloo processes)")
    ap.add_argument("--json", default="checkpoint", help="result name (benchmarks/results/NAME.json) or a .json path")
    args = ap.parse_args(argv)
    import os
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # read by the spawned ranks' glibc at start
    cfg = ModelConfig(n_layer=args.layers, d_model=args.d_model, n_head=max(1, args.d_model // 64))
    root = tempfile.mkdtemp(prefix="mct-ckpt-bench-")
    try:
        per_rank = run_distributed(rank_main, args.world, cfg, args.repeats, root, timeout=1800.0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = summarize(per_rank)
    n = sum(p.numel() for p in GPT(cfg).parameters())
    print(f"GPT {vars(cfg)}, {n:,} params, {args.world} ranks, fp32 AdamW; times: median of {args.repeats}, "
          f"slower rank; peaks: resident memory, max over ranks")
    print(format_table(rows, COLUMNS))
    path = write_json(args.json, {"model": vars(cfg), "world": args.world, "repeats": args.repeats, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
