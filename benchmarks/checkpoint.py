"""Checkpoint save, load and weights export of mct (stages 0-3, and offloaded) beside DCP
save of an FSDP2 model.

    PYTHONPATH=src:. python benchmarks/checkpoint.py [--layers 4] [--d-model 256] [--repeats 3]

Two spawned gloo ranks on CPU, fp32 AdamW, a GPT of the given size. For each variant,
after two training steps (so optimizer state exists):

  mct0..mct3   Engine at zero.stage 0..3; ``mct.persistence.save_checkpoint`` (DCP
               with element-range pieces, JSON, manifest with sha256), then load into a
               fresh engine at the same stage (built before the measurement) through
               ``load_engine_state``, then the model.safetensors export (``export_engine``)
  mct3-cpu, mct3-disk   the same at stage 3 in bf16 with optimizer state and parameters
               offloaded (saves read one stored piece at a time, loads stage one unit)
  fsdp2        fully_shard per block and root; ``dcp.save`` of ``get_state_dict(model,
               optimizer)``, then ``dcp.load`` + ``set_state_dict`` on a fresh FSDP2 model

Columns: save and load time (median over repeats, the slower rank), checkpoint size
on disk, and each rank's peak resident memory (Linux VmHWM, reset through
/proc/self/clear_refs before each measured call) during a training step and during a
save, with glibc returning every large free to the system at once
(MALLOC_MMAP_THRESHOLD_), so that resident memory follows live memory; "+MiB" is the
peak's rise over the resident memory just before the call (after one warm-up save and
load, so imports do not count). The target: the rise of a save, a load and an export
stays within the step's rise plus one unit (master + two Adam moments of the largest
unit): nothing is gathered or read whole.
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
from mct.persistence.export import export_engine  # noqa: E402
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


def _mct(variant: str, cfg: ModelConfig, rank: int, root: str):
    """``mct<stage>`` (fp32, resident) or ``mct<stage>-<tier>`` (bf16, optimizer and, at stage
    3, parameters offloaded to the tier, as the 27-layer run of issue 20)."""
    stage, _, tier = variant.removeprefix("mct").partition("-")
    d: dict[str, Any] = {"model": vars(cfg), "zero": {"stage": int(stage)}, "memory": {"track": False}}
    if tier:
        d["precision"] = {"mode": "bf16"}
        d["offload"] = {"optimizer": tier, "params": tier if stage == "3" else "none", "dir": f"{root}/offload"}
    ecfg = EngineConfig.from_dict(d)

    def fresh() -> Engine:
        torch.manual_seed(SEED)
        model = GPT(cfg)
        return Engine(model, adamw, ecfg, param_groups=optimizer_groups(model, WD))
    engine = fresh()
    step = lambda i: engine.train_step(batch(i, rank, cfg), gpt_loss)  # noqa: E731
    save = lambda path: save_checkpoint(path, engine, step=engine.steps_done)  # noqa: E731
    export = lambda path: export_engine(engine, path / "model.safetensors")  # noqa: E731
    unit = max(u.layout.numel for u in engine.sharded.units) * 4 * 3  # master + two Adam moments
    return step, save, (fresh, load_engine_state), export, unit


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

    def load_fresh():
        m, o = build()
        gpt_loss(m, batch(0, rank, cfg)).backward()  # optimizer state must exist to load into
        o.step()
        o.zero_grad(set_to_none=True)
        return m, o

    def load(mo, path: Path) -> None:
        m, o = mo
        msd, osd = get_state_dict(m, o)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=str(path))
        set_state_dict(m, o, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return step, save, (load_fresh, load), None, None


def rank_main(rank: int, world: int, cfg: ModelConfig, repeats: int, root: str,
              variants: list[str]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    rows = []
    for name in variants:
        gc.collect()  # the previous variant's engine (hooks make reference cycles) goes first
        step, save, (fresh, load), export, unit = (_mct(name, cfg, rank, root) if name.startswith("mct")
                                                   else _fsdp2(cfg, rank))
        for i in range(2):
            step(i)
        save(Path(root) / f"{name}_warmup")  # first-call costs (imports, planner caches) excluded
        target = fresh()
        load(target, Path(root) / f"{name}_warmup")
        _, step_peak, step_extra = _measure(lambda: step(2))
        saves, loads, size = [], [], 0
        save_peak = save_extra = load_extra = export_extra = 0
        export_s = []
        for r in range(repeats):
            path = Path(root) / f"{name}_{r}"
            t, peak, extra = _measure(lambda: save(path))
            saves.append(t)
            save_peak, save_extra = max(save_peak, peak), max(save_extra, extra)
            size = _dir_bytes(path)
            t, _, extra = _measure(lambda: load(target, path))
            loads.append(t)
            load_extra = max(load_extra, extra)
            if export is not None:
                t, _, extra = _measure(lambda: export(path))
                export_s.append(t)
                export_extra = max(export_extra, extra)
        if hasattr(target, "close"):
            target.close()  # the trained engine's offload files go with it at the next gc.collect()
        rows.append({"variant": name, "save_s": statistics.median(saves), "load_s": statistics.median(loads),
                     "export_s": statistics.median(export_s) if export_s else None,
                     "size": size, "step_peak": step_peak, "save_peak": save_peak, "step_extra": step_extra,
                     "save_extra": save_extra, "load_extra": load_extra,
                     "export_extra": export_extra if export_s else None, "unit_bytes": unit})
    return rows


COLUMNS = [("variant", "variant"), ("save_s", "save s"), ("load_s", "load s"), ("export_s", "export s"),
           ("size_mib", "size MiB"), ("step_peak_mib", "step peak MiB"), ("save_peak_mib", "save peak MiB"),
           ("step_extra_mib", "step +MiB"), ("save_extra_mib", "save +MiB"), ("load_extra_mib", "load +MiB"),
           ("export_extra_mib", "export +MiB"), ("unit_mib", "unit MiB"), ("check", "<= step + unit")]


def summarize(per_rank: list[list[dict]]) -> list[dict[str, Any]]:
    rows = []
    for i, r0 in enumerate(per_rank[0]):
        all_ranks = [p[i] for p in per_rank]
        unit = r0["unit_bytes"]

        def worst(key: str) -> float | None:
            values = [r[key] for r in all_ranks if r.get(key) is not None]
            return float(mib(max(values))) if values else None
        # the rise during a save, a load and an export, over the rank's resident memory at rest,
        # stays within the step's own rise over rest plus one unit: nothing is gathered or read whole
        ok = None if unit is None else all(
            r[k] is None or r[k] <= r["step_extra"] + unit for r in all_ranks
            for k in ("save_extra", "load_extra", "export_extra"))
        rows.append({"variant": r0["variant"], "save_s": max(r["save_s"] for r in all_ranks),
                     "load_s": max(r["load_s"] for r in all_ranks),
                     "export_s": max((r["export_s"] for r in all_ranks if r["export_s"] is not None), default=None),
                     "size_mib": float(mib(r0["size"])), "step_peak_mib": worst("step_peak"),
                     "save_peak_mib": worst("save_peak"), "step_extra_mib": worst("step_extra"),
                     "save_extra_mib": worst("save_extra"), "load_extra_mib": worst("load_extra"),
                     "export_extra_mib": worst("export_extra"),
                     "unit_mib": None if unit is None else float(mib(unit)),
                     "check": None if ok is None else ("PASS" if ok else "MISS")})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4, help="model.n_layer")
    ap.add_argument("--d-model", type=int, default=256, help="model.d_model")
    ap.add_argument("--repeats", type=int, default=3, help="saves and loads per variant (median)")
    ap.add_argument("--world", type=int, default=2, help="ranks (spawned gloo processes)")
    ap.add_argument("--variants", default="mct0,mct1,mct2,mct3,mct3-cpu,mct3-disk,fsdp2",
                    help="comma-separated: mct<stage> (fp32), mct<stage>-cpu|disk (bf16, offloaded), fsdp2")
    ap.add_argument("--json", default="checkpoint", help="result name (benchmarks/results/NAME.json) or a .json path")
    args = ap.parse_args(argv)
    import os
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # read by the spawned ranks' glibc at start
    cfg = ModelConfig(n_layer=args.layers, d_model=args.d_model, n_head=max(1, args.d_model // 64))
    root = tempfile.mkdtemp(prefix="mct-ckpt-bench-")
    try:
        per_rank = run_distributed(rank_main, args.world, cfg, args.repeats, root, args.variants.split(","),
                                   timeout=1800.0)
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
