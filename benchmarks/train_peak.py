"""End-to-end resident memory of `mct train --nproc 2` with everything offloaded to disk:
the training steps, the final checkpoint and the model.safetensors export, as a user
runs it. Polls every worker's resident set (RSS, and VmHWM at exit) every 0.2 s and
reports the peak per phase per worker: the training steps, and checkpoint + export (while
a checkpoint directory is being written, and after the last step).

    PYTHONPATH=src:. python benchmarks/train_peak.py [--layers 27] [--steps 3]
        [--checkpoint-every 0] [--json PATH]

The model is the offload benchmark's: d_model 1024, 16 heads, seq 128, vocab 256, bf16,
ZeRO-3, checkpointing all, optimizer and parameters offloaded to disk, micro-batch 1.
The run's own metrics rows give the median step time and MFU (``mct train`` records
``mfu`` per step: model FLOPs over the step time, against the measured bf16 matmul peak
per core x threads x ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import cpu_info, cpu_line


def rss_of(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def workers(root: int) -> list[int]:
    """Python processes below ``root`` that run mct as a worker (torchrun's children)."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    kids: dict[int, list[tuple[int, str]]] = {}
    for line in out.splitlines():
        pid, ppid, args = line.split(None, 2)
        kids.setdefault(int(ppid), []).append((int(pid), args))
    found, todo = [], [root]
    while todo:
        for pid, args in kids.get(todo.pop(), []):
            todo.append(pid)
            if "-m mct" in args and "torch.distributed.run" not in args:
                found.append(pid)
    return found


def step_speed(metrics: Path) -> dict:
    """Median step time, achieved FLOP/s and MFU of a run's metrics rows, its first
    (warm-up) step left out when there are more; {} when the run logged none."""
    try:
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError):
        return {}
    rows = [r for r in rows if isinstance(r.get("step_time_s"), (int, float))]
    rows = rows[1:] if len(rows) > 1 else rows
    if not rows:
        return {}
    med = lambda k: statistics.median(r[k] for r in rows) if all(isinstance(r.get(k), (int, float)) for r in rows) else None
    return {"step_s": med("step_time_s"), "model_flops_per_step": rows[-1].get("model_flops_per_step"),
            "achieved_flops_per_s": med("achieved_flops_per_s"), "mfu": med("mfu")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--checkpoint-every", type=int, default=0)
    ap.add_argument("--json", default="benchmarks/results/train_peak.json")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="mct-train-peak-"))
    run = tmp / "run"
    sets = {"model.n_layer": args.layers, "model.n_head": 16, "model.d_model": 1024, "model.seq_len": 128,
            "model.vocab_size": 256, "data.micro_batch_size": 1, "data.grad_accum": 1, "precision.mode": "bf16",
            "zero.stage": 3, "checkpointing.policy": "all", "offload.optimizer": "disk", "offload.params": "disk",
            "offload.dir": str(tmp / "offload"), "train.steps": args.steps, "train.eval_every": 0,
            "train.log_every": 1, "train.checkpoint_every": args.checkpoint_every, "train.warmup_steps": 1}
    cmd = [sys.executable, "-m", "mct", "train", "--nproc", "2", "--run-dir", str(run), "--no-progress"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[int, dict[str, int]] = {}
    while proc.poll() is None:
        done = 0
        if (run / "metrics.jsonl").exists():
            done = len((run / "metrics.jsonl").read_text().splitlines())
        ckpts = run / "checkpoints"
        saving = ckpts.is_dir() and any(not (d / "meta.json").exists() for d in ckpts.glob("step_*"))
        phase = "steps" if done < args.steps and not saving else "checkpoint+export"
        for pid in workers(proc.pid):
            p = peaks.setdefault(pid, {"steps": 0, "checkpoint+export": 0})
            p[phase] = max(p[phase], rss_of(pid))
        time.sleep(0.2)
    out = proc.stdout.read() if proc.stdout else ""
    wall = time.time() - t0
    rows = [{"worker": i, "steps_gib": round(p["steps"] / 2**30, 3), "save_gib": round(p["checkpoint+export"] / 2**30, 3)}
            for i, p in enumerate(peaks.values())]
    print(f"cpu: {cpu_line()}; layers {args.layers}, steps {args.steps}, checkpoint_every {args.checkpoint_every}; "
          f"exit {proc.returncode}, {wall:.0f} s")
    print("| worker | peak RSS during steps GiB | peak RSS during checkpoint + export GiB |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['worker']} | {r['steps_gib']:.2f} | {r['save_gib']:.2f} |")
    speed = step_speed(run / "metrics.jsonl")
    if speed:
        mfu = f"{100 * speed['mfu']:.2f}%" if speed.get("mfu") is not None else "-"
        gflops = f"{speed['achieved_flops_per_s'] / 1e9:.3g}" if speed.get("achieved_flops_per_s") else "-"
        print(f"step time (median) {speed['step_s']:.2f} s, {gflops} GFLOP/s achieved, MFU {mfu}")
    if proc.returncode:
        print(out[-3000:])
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"cpu": cpu_info(), "layers": args.layers, "steps": args.steps,
                                           "exit": proc.returncode, "wall_s": wall, "workers": rows,
                                           "speed": speed}, indent=2))


if __name__ == "__main__":
    main()
