"""The runtime baseline: what a training process holds resident before its first tensor.

A worker's peak resident set is this baseline, plus its tensor peak, plus what the
allocator holds beyond live bytes (docs/memory.md). The baseline is measured in a fresh
interpreter that does what every training process does before it allocates a model: import
torch and mct's trainer, import the model's library (``modules``: e.g. the module of a
transformers model class), take one step of mct's AdamW on a one-element parameter (torch's
AdamW without the wrappers that import ``torch._dynamo``, about 70 MiB: ``mct.optim.eager``;
a training rank loads it no more), and join a one-rank gloo process group.
Its VmHWM is the baseline.

Measured once per key (the Python, torch and model library versions, the modules, the
machine's architecture) by ``mct calibrate`` or on first use, and cached beside the machine
profile (``$MCT_CACHE_DIR/baseline.json``; ``mct.machine.cache``). A cache that cannot be
read counts as absent; one that cannot be written costs the next caller a measurement.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from mct.machine.cache import cache_file

NO_WRITER = "--no-writer"
"""The probe's argument that leaves the checkpoint writer out (``writer=False``)."""
PROBE = """
import os, sys
names = [a for a in sys.argv[1:] if a != "--no-writer"]
for name in names:  # first: a missing library fails before torch's import
    __import__(name)
import torch
import torch.distributed as dist
import mct.run.trainer
if "--no-writer" not in sys.argv:
    import mct.persistence.shards  # torch.distributed.checkpoint: every mct train saves (about 47 MiB, sympy)
from mct.optim import AdamW
p = torch.nn.Parameter(torch.zeros(1))
opt = AdamW([p], lr=1e-3)
p.grad = torch.zeros(1)
opt.step()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
dist.all_reduce(torch.zeros(1))
dist.destroy_process_group()
status = open("/proc/self/status").read()
print(int(status.split("VmHWM:")[1].split()[0]) * 1024)
"""
PROBE_VERSION = 3
"""In the key: 2 since the probe's optimizer stopped importing torch._dynamo (1 counted it); 3
since it imports the checkpoint writer (torch.distributed.checkpoint), as every run that saves."""


def baseline_key(modules: tuple[str, ...] = (), writer: bool = True) -> str:
    """What the baseline depends on: Python, torch and the modules' packages' versions,
    the modules, the architecture, the probe's version, and whether the checkpoint writer is in."""
    packages = sorted({"torch", *(m.split(".")[0] for m in modules)})
    versions = []
    for name in packages:
        try:
            versions.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{name} ?")
    return " | ".join([f"python {platform.python_version()}", *versions, platform.machine(), f"probe {PROBE_VERSION}",
                       "modules " + (",".join(sorted(modules)) or "-"), *([] if writer else ["no writer"])])


def measure_baseline(modules: tuple[str, ...] = (), timeout_s: float = 300.0, writer: bool = True) -> int:
    """The baseline in bytes, measured now in a fresh interpreter (a few seconds); ``writer``:
    with the checkpoint writer's import (False: what a process holds before its first save). Raises
    ValueError naming the module when one cannot be imported, RuntimeError when the probe
    fails otherwise or there is no /proc (not Linux)."""
    if not Path("/proc/self/status").exists():
        raise RuntimeError("the runtime baseline is read from /proc/self/status (Linux); none here")
    src = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p))
    out = subprocess.run([sys.executable, "-c", PROBE, *modules, *([] if writer else [NO_WRITER])], env=env, capture_output=True, text=True,
                         timeout=timeout_s)
    if out.returncode != 0:
        missing = [m for m in modules if f"No module named '{m.split('.')[0]}" in out.stderr]
        if missing:
            raise ValueError(f"the model library {missing[0]!r} cannot be imported; install it or drop it")
        raise RuntimeError(f"the runtime baseline probe failed: {out.stderr.strip().splitlines()[-1:]}")
    return int(out.stdout.split()[-1])


def baseline_file() -> Path:
    """Where baselines are cached: beside the machine profile."""
    return cache_file().parent / "baseline.json"


def runtime_baseline(modules: tuple[str, ...] = (), *, force: bool = False,
                     path: Path | None = None, writer: bool = True) -> tuple[int, str]:
    """(bytes, 'cache' | 'measured'): the runtime baseline for ``modules`` (the model's
    library modules beyond torch and mct), from the cache unless ``force``, else measured and
    cached. The figure the planner adds to a tensor peak for a process peak (docs/memory.md).
    ``writer=False``: without the checkpoint writer's import. Raises as ``measure_baseline``."""
    path = path or baseline_file()
    key = baseline_key(tuple(modules), writer)
    entries = _entries(path)
    cached = entries.get(key)
    if not force and _valid(cached):
        return cached, "cache"
    value = measure_baseline(tuple(modules), writer=writer)
    entries[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=2, sort_keys=True) + "\n")
        tmp.replace(path)
    except OSError:
        pass  # measured again next time
    return value, "measured"


def cached_baseline(modules: tuple[str, ...] = (), *, path: Path | None = None, writer: bool = True) -> int | None:
    """The cached runtime baseline for ``modules`` in bytes, or None when none is cached
    (nothing is measured: what a training rank may call)."""
    cached = _entries(path or baseline_file()).get(baseline_key(tuple(modules), writer))
    return cached if _valid(cached) else None


def _entries(path: Path) -> dict:
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def _valid(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def baseline_line(nbytes: int, source: str) -> str:
    """``mct calibrate``'s line for the baseline, saying what it counts and where it came from."""
    return (f"runtime baseline: {nbytes / 2**20:.1f} MiB resident (VmHWM of python + torch + mct + torch.optim's "
            f"imports + a gloo group, before any model tensor; {'from the cache' if source == 'cache' else 'measured now'})")
