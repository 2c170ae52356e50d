"""Collective latency and bandwidth of this machine at a world size: ``world``
processes spawned here (gloo over a file rendezvous on CPU, NCCL on CUDA devices), each
timing the three collectives the engine issues (``mct.zero.comm.TorchCollectives``: on
gloo, the all-gather and the 2-rank reduce-scatter are sends and receives), at a tiny
size (latency) and a large one (bandwidth). A few seconds, mostly the processes' start; the time model
(``mct.planner.steptime``) caches the result per backend and world in the machine profile.

A collective's bytes are counted as the engine's ``Comm`` counts them: the
reduce-scatter's input, the all-gather's output, the all-reduced tensor; the time of one
call is ``latency + bytes / bandwidth``.
"""

from __future__ import annotations

import datetime
import functools
import os
import tempfile
import time
from typing import Any, Callable

import torch

KINDS = ("all_reduce", "reduce_scatter", "all_gather")
GROUP_KINDS = ("all_gather", "reduce_scatter", "all_to_all")
"""The collectives a context group issues (``mct.context.comm``: gloo's and NCCL's own
``all_gather_single``, ``reduce_scatter_single``, ``all_to_all_single``), timed by
``measure_group_collectives`` within groups of ranks."""
LARGE_BYTES = 8 * 2**20
"""The size bandwidth is timed at: large enough that latency is a small part."""


def measure_collectives(world: int, device: str = "cpu", timeout_s: float = 120.0) -> dict[str, list[float]]:
    """{kind: [latency s, bytes/s]} for ``world`` ranks on this machine ('cpu': gloo,
    'cuda': NCCL, one device per rank). Raises ValueError for a world below 2 or more
    CUDA ranks than devices, RuntimeError when the processes fail or time out."""
    return spawn_ranks(_time_kinds, world, device, (), timeout_s)


def measure_group_collectives(world: int, groups: tuple[int, ...], device: str = "cpu",
                              timeout_s: float = 120.0) -> dict[int, dict[str, list[float]]]:
    """{group size: {kind: [latency s, bytes/s]}} of the context group's collectives
    (``GROUP_KINDS``, called as ``mct.context.comm`` calls them) for each size in ``groups``
    (each must divide ``world``): ``world`` ranks spawned here, cut into groups of that size
    (``dist.new_subgroups``), every group timing at once, as a run's context groups do. Bytes
    as the context group counts them: the gathered tensor, the reduce-scattered input, the
    all-to-all's input. Raises as ``measure_collectives``."""
    assert all(world % g == 0 and g >= 2 for g in groups), (world, groups)
    return spawn_ranks(_time_groups, world, device, (tuple(groups),), timeout_s)


def _time_groups(rank: int, world: int, dev: torch.device, groups: tuple[int, ...]) -> dict[int, dict]:
    import torch.distributed as dist

    from mct.context.comm import GROUP_COLLECTIVES
    out = {}
    for size in groups:
        group, _ = dist.new_subgroups(group_size=size)
        out[size] = {kind: _time_call(functools.partial(GROUP_COLLECTIVES[kind], group=group), kind, size, dev)
                     for kind in GROUP_KINDS}
    return out


def _time_kinds(rank: int, world: int, dev: torch.device) -> dict[str, list[float]]:
    return {kind: _time_kind(kind, world, dev) for kind in KINDS}


def spawn_ranks(fn: Callable[..., Any], world: int, device: str = "cpu", args: tuple = (),
                timeout_s: float = 120.0, threads: int = 1) -> Any:
    """Rank 0's ``fn(rank, world, dev, *args)``, run in ``world`` processes spawned here,
    all at once, in one process group (gloo over a file rendezvous on CPU, NCCL on CUDA,
    one device per rank), each with ``threads`` torch threads. ``fn`` must be a module's
    top-level function (it is pickled). Raises ValueError for a world below 2 or more
    CUDA ranks than devices, RuntimeError when a process fails or time runs out."""
    if world < 2:
        raise ValueError(f"collectives are measured for 2 or more ranks, got world {world}")
    if device == "cuda" and world > torch.cuda.device_count():
        raise ValueError(f"{world} CUDA ranks need {world} devices, this machine has {torch.cuda.device_count()}")
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_rank, args=(r, world, init, device, queue, fn, args, threads), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        got = _first_answer(queue, procs, timeout_s)
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if not isinstance(got, tuple):
        raise RuntimeError(f"measuring on {world} ranks failed: {got or 'timed out'}")
    return got[0]


def _first_answer(queue: Any, procs: list, timeout_s: float) -> Any:
    """Rank 0's answer (a 1-tuple) or the first error (a string); None on time-out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not queue.empty():
            return queue.get()
        if any(p.exitcode not in (None, 0) for p in procs):
            time.sleep(0.2)
            return queue.get() if not queue.empty() else "a rank died: exit codes " + str(
                [p.exitcode for p in procs])
        time.sleep(0.02)
    return None


def _rank(rank: int, world: int, init: str, device: str, queue: Any, fn: Callable[..., Any], args: tuple,
          threads: int) -> None:
    import torch.distributed as dist
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{init}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
        if device == "cuda":
            torch.cuda.set_device(dev)
        out = fn(rank, world, dev, *args)
        if rank == 0:
            queue.put((out,))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        queue.put(f"rank {rank}: {type(e).__name__}: {e}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _time_kind(kind: str, world: int, dev: torch.device) -> list[float]:
    """[latency, bytes/s] of ``kind``: the fastest of several calls at world x 1 and at
    ``LARGE_BYTES`` (float32), every rank starting together (a barrier before each)."""
    import torch.distributed as dist

    from mct.zero.comm import TorchCollectives
    ops = TorchCollectives()  # the raw collectives the engine issues (on gloo: sends and receives)

    def call(out: torch.Tensor, inp: torch.Tensor) -> None:
        if kind == "all_reduce":
            dist.all_reduce(inp)
        elif kind == "reduce_scatter":
            ops.reduce_scatter(out, inp).wait()
        else:
            ops.all_gather(out, inp).wait()
    return _time_call(call, kind, world, dev)


def _time_call(call: Callable[[torch.Tensor, torch.Tensor], Any], kind: str, ranks: int,
               dev: torch.device) -> list[float]:
    """[latency, bytes/s] of ``call(out, inp)`` for collective ``kind`` over ``ranks`` ranks:
    the fastest of several calls at ``ranks`` x 1 float32 and at ``LARGE_BYTES`` counted
    bytes, every rank of the world starting together (a barrier before each). The counted
    tensor is full size (all-gather's ``out``; reduce-scatter's, all-to-all's and
    all-reduce's ``inp``), the other one 1/``ranks`` of it (all-to-all's: full size too)."""
    import torch.distributed as dist

    def once(numel: int) -> float:
        full = torch.ones(numel - numel % ranks, device=dev)
        part = torch.empty(full.numel() // ranks, device=dev)
        if kind == "all_to_all":
            part = torch.empty_like(full)
        best = float("inf")
        for _ in range(10 if numel < 4096 else 4):
            dist.barrier()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            if kind == "all_gather":
                call(full, part)
            else:
                call(part, full)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            best = min(best, time.perf_counter() - t0)
        return best
    latency = once(ranks)
    big = once(LARGE_BYTES // 4)
    return [latency, LARGE_BYTES / max(big - latency, 1e-9)]
