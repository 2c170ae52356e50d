"""What a ``mct train --nproc N`` job holds resident, per process: the launcher, an agent
(torchrun's, where one runs) and each worker, sampled from ``/proc/PID/status`` while the
workers train; then the resident cost of each import a worker makes, one fresh interpreter
per row (bare Python, ``import torch``, mct's engine, transformers, matplotlib,
tensorboard).

Printed: the CPU's model and flags; per role, the largest VmRSS seen while every worker
was alive and the VmHWM at the last sample; the launcher and agent together beyond the
workers; then the import table. Written: ``benchmarks/results/job_memory.json``.

    PYTHONPATH=src:. python benchmarks/job_memory.py [--nproc 2] [--steps 30] [--no-imports]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks` importable
from benchmarks.common import cpu_line, format_table, write_json  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
IMPORTS = {
    "python": "pass",
    "mct.cli (the launcher's own imports)": "import mct.cli, mct.run.launch",
    "torch": "import torch",
    "torch.distributed": "import torch, torch.distributed",
    "mct engine + planner + trainer": "import mct.engine, mct.planner, mct.run.trainer",
    "transformers (Llama)": "import torch, transformers.models.llama.modeling_llama",
    "matplotlib (pyplot, Agg)": "import matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot",
    "tensorboard (SummaryWriter)": "import torch.utils.tensorboard",
}
TINY = """seed = 5
[model]
n_layer = 2
n_head = 2
d_model = 32
seq_len = 16
[data]
path = "{corpus}"
micro_batch_size = 2
[train]
steps = {steps}
eval_every = 0
checkpoint_every = 0
[zero]
stage = 2
"""


def status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of ``pid`` in bytes ({} once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def role(pid: int, launcher: int) -> str:
    """launcher | agent (torchrun's) | worker R | other."""
    if pid == launcher:
        return "launcher"
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "other"
    rank = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"RANK=")), None)
    if b"torch.distributed.run" in cmd or b"from torch.distributed.run import" in cmd:
        return "agent"
    if rank is not None and b"mct" in cmd:
        return f"worker {rank}"
    return "other"


def measure_job(nproc: int, steps: int) -> dict[str, dict[str, int]]:
    """Run a tiny ``mct train --nproc nproc``; per role, the largest VmRSS seen while all
    ``nproc`` workers were alive and the last VmHWM read."""
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus"
        corpus.mkdir()
        for i in range(8):
            (corpus / f"f{i}.txt").write_text(f"file {i}: " + "the quick brown fox jumps. " * 80)
        cfg = Path(tmp) / "tiny.toml"
        cfg.write_text(TINY.format(corpus=corpus, steps=steps))
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
        p = subprocess.Popen([sys.executable, "-m", "mct", "train", "--config", str(cfg), "--nproc", str(nproc),
                              "--run-dir", str(Path(tmp) / "run"), "--no-progress"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        seen: dict[str, dict[str, int]] = {}
        while p.poll() is None:
            pids = [p.pid, *descendants(p.pid)]
            roles = {pid: role(pid, p.pid) for pid in pids}
            if sum(r.startswith("worker") for r in roles.values()) == nproc:
                for pid, r in roles.items():
                    s = status(pid)
                    if s:
                        got = seen.setdefault(r, {"VmRSS": 0, "VmHWM": 0})
                        got["VmRSS"] = max(got["VmRSS"], s["VmRSS"])
                        got["VmHWM"] = max(got["VmHWM"], s["VmHWM"])
            time.sleep(0.1)
        err = p.stderr.read()
        if p.returncode != 0:
            raise SystemExit(f"mct train --nproc {nproc} exited {p.returncode}:\n{err}")
    return seen


def measure_import(code: str) -> int:
    """VmHWM of a fresh interpreter that runs ``code``."""
    probe = f"{code}\nprint(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1]) * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--no-imports", action="store_true", help="only the job, not the import table")
    args = ap.parse_args()
    print(cpu_line())
    seen = measure_job(args.nproc, args.steps)
    rows = [{"p": r, "rss": round(v["VmRSS"] / 2**20, 1), "hwm": round(v["VmHWM"] / 2**20, 1)}
            for r, v in sorted(seen.items())]
    print(format_table(rows, [("p", "process"), ("rss", "max VmRSS while training (MiB)"), ("hwm", "VmHWM (MiB)")]))
    beyond = sum(v["VmRSS"] for r, v in seen.items() if r in ("launcher", "agent"))
    print(f"launcher + agent beyond the workers, while they train: {beyond / 2**20:.1f} MiB resident")
    imports = {} if args.no_imports else {name: measure_import(code) for name, code in IMPORTS.items()}
    if imports:
        base = imports["python"]
        rows = [{"i": n, "hwm": round(b / 2**20, 1), "beyond": round((b - base) / 2**20, 1)}
                for n, b in imports.items()]
        print(format_table(rows, [("i", "import (fresh interpreter)"), ("hwm", "VmHWM (MiB)"),
                                  ("beyond", "beyond bare python (MiB)")]))
    write_json("job_memory", {"job": seen, "launcher_and_agent_rss": beyond, "imports": imports,
                              "nproc": args.nproc, "steps": args.steps})


if __name__ == "__main__":
    main()
