"""Collective latency and bandwidth of this machine at a world size: ``world``
processes spawned here (gloo over a file rendezvous on CPU, NCCL on CUDA devices), each
timing the three collectives the engine issues, at a tiny size (latency) and a large one
(bandwidth). A few seconds, mostly the processes' start; the time model
(``mct.planner.steptime``) caches the result per backend and world in the machine profile.

A collective's bytes are counted as the engine's ``Comm`` counts them: the
reduce-scatter's input, the all-gather's output, the all-reduced tensor; the time of one
call is ``latency + bytes / bandwidth``.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
from typing import Any

import torch

KINDS = ("all_reduce", "reduce_scatter", "all_gather")
LARGE_BYTES = 8 * 2**20
"""The size bandwidth is timed at: large enough that latency is a small part."""


def measure_collectives(world: int, device: str = "cpu", timeout_s: float = 120.0) -> dict[str, list[float]]:
    """{kind: [latency s, bytes/s]} for ``world`` ranks on this machine ('cpu': gloo,
    'cuda': NCCL, one device per rank). Raises ValueError for a world below 2 or more
    CUDA ranks than devices, RuntimeError when the processes fail or time out."""
    if world < 2:
        raise ValueError(f"collectives are measured for 2 or more ranks, got world {world}")
    if device == "cuda" and world > torch.cuda.device_count():
        raise ValueError(f"{world} CUDA ranks need {world} devices, this machine has {torch.cuda.device_count()}")
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_rank, args=(r, world, init, device, queue), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        got: Any = None
        while got is None and time.monotonic() < deadline:
            if not queue.empty():
                got = queue.get()
            elif any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(0.2)
                got = queue.get() if not queue.empty() else "a rank died: exit codes " + str(
                    [p.exitcode for p in procs])
            else:
                time.sleep(0.02)
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if not isinstance(got, dict):
        raise RuntimeError(f"measuring collectives on {world} ranks failed: {got or 'timed out'}")
    return got


def _rank(rank: int, world: int, init: str, device: str, queue: Any) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{init}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
        if device == "cuda":
            torch.cuda.set_device(dev)
        out = {kind: _time_kind(kind, world, dev) for kind in KINDS}
        if rank == 0:
            queue.put(out)
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        queue.put(f"rank {rank}: {type(e).__name__}: {e}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _time_kind(kind: str, world: int, dev: torch.device) -> list[float]:
    """[latency, bytes/s] of ``kind``: the fastest of several calls at world x 1 and at
    ``LARGE_BYTES`` (float32), every rank starting together (a barrier before each)."""
    import torch.distributed as dist

    def once(numel: int) -> float:
        full = torch.ones(numel - numel % world, device=dev)
        part = torch.empty(full.numel() // world, device=dev)
        best = float("inf")
        for _ in range(10 if numel < 4096 else 4):
            dist.barrier()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            if kind == "all_reduce":
                dist.all_reduce(full)
            elif kind == "reduce_scatter":
                (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(part, full)
            else:
                (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(full, part)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            best = min(best, time.perf_counter() - t0)
        return best
    latency = once(world)
    big = once(LARGE_BYTES // 4)
    return [latency, LARGE_BYTES / max(big - latency, 1e-9)]
