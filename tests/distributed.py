"""Start N gloo processes on CPU with a file rendezvous; propagate failures and
timeouts to the test, so no multi-rank test can hang CI.

The processes are forked from a ``forkserver`` that imported torch and mct once (per
pytest worker), not spawned: a spawned rank spends 1.5-3 s importing them, and the suite
starts a few hundred ranks. A forked rank starts from a process that has only imported
modules (no threads, no tensors), gets the test's own environment (``os.environ`` at the
call, as a spawned one would), and imports the test's module like a spawned rank."""

from __future__ import annotations

import datetime
import os
import tempfile
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.checkpoint", "mct.engine", "mct.task",
           "mct.planner", "tests.helpers"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _worker(rank: int, world: int, init_file: str, env: dict, fn: Callable, args: tuple, queue) -> None:
    import torch
    import torch.distributed as dist
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        result = fn(rank, world, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - the parent reports it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` new processes; return the
    results by rank. Raises AssertionError with the first failing rank's traceback,
    or on timeout (after killing every process)."""
    ctx = _context()
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(r, world, init_file, dict(os.environ), fn, args, queue), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors: list[str] = []
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        import time
        while len(results) + len(errors) < world:
            if not queue.empty():
                rank, status, payload = queue.get()
                (results.__setitem__(rank, payload) if status == "ok" else errors.append(f"rank {rank}:\n{payload}"))
                continue
            if datetime.datetime.now() > deadline:
                errors.append(f"timed out after {timeout}s")
                break
            if any(p.exitcode not in (None, 0) for p in procs) and queue.empty():
                time.sleep(0.5)
                if queue.empty():
                    errors.append("a worker died: exit codes " + str([p.exitcode for p in procs]))
                    break
            time.sleep(0.02)
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if errors:
            raise AssertionError("\n".join(errors))
        return [results[r] for r in range(world)]
