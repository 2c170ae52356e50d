"""Offload: peak resident memory (VmHWM, as the OS sees it) and step time of the 200M
GPT with offload none / optimizer=disk / optimizer+params=disk, the optimizer step in
GB/s against the machine's memory-copy speed, and the capacity table.

    PYTHONPATH=src:. python benchmarks/offload.py [--layers 16] [--warmup 2] [--steps 2]
        [--capacity 27,54] [--skip-table] [--json PATH]

Every configuration runs in a fresh process (which spawns the 2 gloo ranks), so each
rank's VmHWM is its own and the allocator setting (MALLOC_MMAP_THRESHOLD_) applies
from the start. The model is the issue's: d_model 1024, 16 heads, seq 128, vocab 256,
micro-batch 1, bf16 (``--precision``), ZeRO stage 3, activation checkpointing 'all', built on the meta
device (as ``mct train`` does at stage 3), AdamW from the training recipe (fused),
grad clip 1.0. Ranks run one thread each (as every multi-rank test and benchmark here).
Step time: median of the measured steps (after the warm-up steps), slower rank.

- optimizer step GB/s = (fp32 master + Adam m, v + fp32 gradient) bytes of the local
  shard / the step phase's wall time (``time_step_s``), against a single-thread
  ``copy_`` of 256 MiB (bytes copied per second; each is read once and written once).
- I/O s: the I/O thread's busy time per step and rank; waited s: the time the training
  thread blocked on it (reads of the step, gradient read-backs, parameter reads);
  I/O hidden = 1 - waited / I/O (0 when waiting took longer than the I/O itself, as
  thread scheduling on a loaded machine can make it).
- Capacity: for each n_layer given, does every rank's VmHWM stay <= 2 GiB over 2+2
  steps with optimizer+params=disk, under glibc's defaults and with
  MALLOC_MMAP_THRESHOLD_=65536 in the environment (``memory.host_malloc = auto``: mct
  sets its own allocator in the first case and leaves the user's setting in the second).
- Table rows: ``memory.host_malloc`` 'auto' (what ``mct train`` does), and the other
  allocator setting for none and optimizer=disk, to show its share of the peak and its
  time cost.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks` and `tests` importable
from benchmarks.common import environment, format_table, write_json  # noqa: E402

GIB = 2**30
VARIANTS = {"none": {}, "optimizer=disk": {"optimizer": "disk"},
            "optimizer+params=disk": {"optimizer": "disk", "params": "disk"}}
# (label, offload, memory.host_malloc): 'auto' is what `mct train` does (lean with offload
# on a CPU device); the other two rows show the allocator's share of the peak and its time.
TABLE = [("none", "none", "auto"), ("none, lean malloc", "none", "lean"),
         ("optimizer=disk", "optimizer=disk", "auto"), ("optimizer=disk, default malloc", "optimizer=disk", "default"),
         ("optimizer=disk, frugal malloc", "optimizer=disk", "frugal"),
         ("optimizer+params=disk", "optimizer+params=disk", "auto")]


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmHWM, VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def rank_main(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    from mct.config import EngineConfig
    from mct.engine import Engine
    from mct.models.gpt import gpt_loss, optimizer_groups
    from mct.memory import host
    from mct.task.gpt import build_gpt_on_meta, make_optimizer
    cfg = EngineConfig.from_dict({
        "model": {"n_layer": spec["layers"], "n_head": 16, "d_model": 1024, "seq_len": 128, "vocab_size": 256},
        "data": {"micro_batch_size": 1}, "precision": {"mode": spec["precision"]}, "zero": {"stage": 3},
        "checkpointing": {"policy": "all"}, "memory": {"track": False, "host_malloc": spec.get("host_malloc", "auto")},
        "offload": {**spec["offload"], "dir": spec["dir"]}})
    t0 = time.perf_counter()
    # as `mct train` does: the allocator setting before the model is built
    host.for_building(host.mode_of(cfg, "cpu"))
    model, program = build_gpt_on_meta(cfg)
    engine = Engine(model, make_optimizer(cfg), cfg, param_groups=optimizer_groups(model, cfg.train.weight_decay),
                    init_program=program)
    init_s, hwm_init = time.perf_counter() - t0, _status("VmHWM")
    g = torch.Generator().manual_seed(rank)
    steps, metrics = [], []
    for i in range(spec["warmup"] + spec["steps"]):
        x = torch.randint(0, 256, (1, 128), generator=g)
        t = time.perf_counter()
        out = engine.train_step((x, torch.roll(x, -1, 1)), gpt_loss)
        if i >= spec["warmup"]:
            steps.append(time.perf_counter() - t)
            metrics.append(out.metrics)
    n_local = sum(u.layout.shard_numel for u in engine.sharded.units)
    result = {"hwm": _status("VmHWM"), "hwm_init": hwm_init, "init_s": init_s, "steps": steps,
              "time_step_s": [m["time_step_s"] for m in metrics],
              "wait_s": [m.get("time_offload_wait_s", 0.0) for m in metrics],
              "io_s": [m.get("time_offload_io_s", 0.0) for m in metrics],
              "offloaded": engine.tracker.offloaded(), "n_local": n_local, "loss": out.loss}
    engine.close()
    return result


def run_config(layers: int, offload: dict, *, warmup: int, steps: int, mmap_threshold: bool,
               precision: str, host_malloc: str = "auto") -> dict[str, Any]:
    """One configuration in a fresh process; returns its ranks' results."""
    spec = {"layers": layers, "offload": offload, "warmup": warmup, "steps": steps, "precision": precision,
            "host_malloc": host_malloc}
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    with tempfile.TemporaryDirectory(prefix="mct-offload-bench-") as d:
        spec["dir"] = d
        proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], env=env,
                              capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout)[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _one(spec: dict[str, Any]) -> None:
    from tests.distributed import run_distributed
    print(json.dumps({"ranks": run_distributed(rank_main, 2, spec, timeout=3000)}))


def copy_speed() -> float:
    """Single-thread memory-copy speed, bytes per second (best of 5)."""
    torch.set_num_threads(1)
    a, b = torch.ones(2**26), torch.empty(2**26)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return a.numel() * 4 / best


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def table_row(name: str, res: dict[str, Any], copy_bps: float) -> dict[str, Any]:
    if "error" in res:
        return {"variant": name, "error": res["error"].strip().splitlines()[-1][:120]}
    ranks = res["ranks"]
    step = max(_median(r["steps"]) for r in ranks)
    opt = max(_median(r["time_step_s"]) for r in ranks)
    state_bytes = ranks[0]["n_local"] * 16  # fp32 master + Adam m, v + fp32 gradient
    io, wait = sum(sum(r["io_s"]) for r in ranks), sum(sum(r["wait_s"]) for r in ranks)
    return {"variant": name, "peak_gib": max(r["hwm"] for r in ranks) / GIB,
            "init_peak_gib": max(r["hwm_init"] for r in ranks) / GIB, "step_s": step, "opt_step_s": opt,
            "opt_gbps": state_bytes / opt / 1e9, "copy_gbps": copy_bps / 1e9,
            "io_s": io / len(ranks) / len(ranks[0]["io_s"]), "wait_s": wait / len(ranks) / len(ranks[0]["io_s"]),
            "io_hidden": max(0.0, 1 - wait / io) if io else None, "init_s": max(r["init_s"] for r in ranks),
            "disk_gib": sum(r["offloaded"]["disk"] for r in ranks) / GIB, "loss": ranks[0]["loss"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--capacity", default="27,54", help="n_layer values to check at 2 GiB ('' = skip)")
    ap.add_argument("--skip-table", action="store_true")
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp32"),
                    help="bf16 is the issue's setting; CPUs without bf16 units run its matmuls ~10-25x slower")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        return _one(json.loads(args.one))
    out: dict[str, Any] = {"environment": environment(), "copy_bytes_per_s": copy_speed()}
    if not args.skip_table:
        rows = []
        for name, variant, malloc in TABLE:
            res = run_config(args.layers, VARIANTS[variant], warmup=args.warmup, steps=args.steps,
                             mmap_threshold=False, precision=args.precision, host_malloc=malloc)
            out[name] = res
            rows.append(table_row(name, res, out["copy_bytes_per_s"]))
            print(rows[-1], flush=True)
        base = rows[0]
        for r in rows:
            if "peak_gib" in r and "peak_gib" in base:
                r["peak_x"], r["step_x"] = r["peak_gib"] / base["peak_gib"], r["step_s"] / base["step_s"]
        out["table"] = rows
        print(format_table(rows, [("variant", "offload"), ("peak_gib", "VmHWM GiB"), ("peak_x", "x none"),
                                  ("init_peak_gib", "after init GiB"), ("step_s", "step s"), ("step_x", "x none"),
                                  ("opt_step_s", "opt step s"), ("opt_gbps", "opt GB/s"), ("copy_gbps", "copy GB/s"),
                                  ("io_s", "I/O s"), ("wait_s", "waited s"), ("io_hidden", "I/O hidden"), ("disk_gib", "on disk GiB"), ("init_s", "init s")]))
    cap = []
    for layers in [int(x) for x in args.capacity.split(",") if x.strip()]:
        for thr in (False, True):
            res = run_config(layers, VARIANTS["optimizer+params=disk"], warmup=2, steps=2, mmap_threshold=thr,
                             precision=args.precision)
            peak = max(r["hwm"] for r in res["ranks"]) / GIB if "ranks" in res else None
            cap.append({"n_layer": layers, "allocator": "MALLOC_MMAP_THRESHOLD_=65536" if thr else "glibc default",
                        "peak_gib": peak, "fits_2gib": peak is not None and peak <= 2.0,
                        "step_s": max(_median(r["steps"]) for r in res["ranks"]) if "ranks" in res else None,
                        "error": res.get("error", "")[-200:] or None})
            print(cap[-1], flush=True)
    if cap:
        out["capacity"] = cap
        print(format_table(cap, [("n_layer", "n_layer"), ("allocator", "allocator"), ("peak_gib", "VmHWM GiB"),
                                 ("fits_2gib", "<= 2 GiB"), ("step_s", "step s")]))
    print("wrote", write_json(args.json or "offload", out))


if __name__ == "__main__":
    main()
