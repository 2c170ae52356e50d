"""The machine measured aside: what a training rank would otherwise measure inside itself
(the machine profile the first time, the per-op overhead at its thread count), measured in a
short-lived child interpreter instead and cached as usual, so none of it counts in the
rank's peak resident set.

A measurement inside a rank runs real matmuls and steps of a small model: it raised rank 0's
VmHWM by about 95 MiB, in some runs and not others (whether the shared cache held a sound
profile just then), the largest source of the pass-to-pass variance of a worker's peak
(docs/memory.md, "How close it comes"). The child writes the cache; the rank then reads it.
Where the child fails (or the cache cannot be written) the rank measures as before: slower
and larger, never wrong.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mct.machine.cache import cached
from mct.machine.load import quiet_now

CHILD = """
import sys
import torch
from mct.planner.overhead import machine_rates
device, world, threads, overhead = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
torch.set_num_threads(threads)
if overhead:
    machine_rates(world, device, threads, spawn=False)
else:
    from mct.machine import calibrate
    calibrate(device)
"""
TIMEOUT_S = 1800.0
"""A busy machine's profile takes up to three passes of about 15 s, the overhead a few more
seconds: the child is ended well after that."""


def missing(device: str, overhead_key: str | None) -> str | None:
    """What a training rank of ``device`` would measure now: 'profile' (none cached, or one
    suspect, or one measured under load on a machine quiet now: what ``calibrate`` measures
    again), 'overhead' (the per-op overhead under ``overhead_key``, the planner's
    ``overhead_key`` of the rank's threads, what ``machine_rates(spawn=False)`` adds; None:
    not needed), or None (the cache holds all of it). Reads the cache; watches the load half
    a second at most."""
    profile = cached(device)
    if profile is None or not profile.pinned and (profile.suspect or (profile.load_busy and quiet_now())):
        return "profile"
    if overhead_key is not None and not all(overhead_key in profile.extra.get(k, {})
                                            for k in ("op_overhead_s", "byte_overhead_s")):
        return "overhead"
    return None


def measure_aside(device: str, world: int, threads: int, *, overhead_key: str | None,
                  timeout_s: float = TIMEOUT_S) -> bool:
    """Measure what ``missing`` names in a child interpreter (its progress lines on this
    process's stderr) and let it cache the result. Returns whether the cache now holds what
    the rank needs (nothing was missing, or the child succeeded): then the rank reads the cache
    and measures nothing itself, even where the child's profile was measured under load (a
    second measurement in the rank would only repeat it, inside the rank's peak). False: the
    child failed or timed out; the caller measures in-process as before. Never raises for a
    failed child."""
    if missing(device, overhead_key) is None:
        return True
    src = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, OMP_NUM_THREADS=str(threads),
               PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p))
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)  # the child is no rank of the run
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, device, str(world), str(threads),
                              "0" if overhead_key is None else "1"],
                             env=env, stdout=subprocess.DEVNULL, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0
