"""Run a function on N gloo ranks on CPU with a file rendezvous; propagate failures and
timeouts to the test, so no multi-rank test can hang CI.

Ranks are kept warm: the first call for a world size spawns N worker processes that
stay up for the rest of the session, and each call hands them one task. A task gets a
fresh process group (a new rendezvous file), and after it the worker puts back what
a test may change in a process: environment, working directory, signal handlers,
torch's RNG seed, grad mode, default dtype and thread count, so a task sees what a
freshly spawned rank would. Starting a rank (Python, torch, mct, the test module) is
most of a short multi-rank test's time; keeping them saves it once per call.

A failed or timed-out task discards its pool (every worker is killed), so the next call
starts clean. ``MCT_TEST_FRESH_RANKS=1`` spawns new ranks for every call instead.
"""

from __future__ import annotations

import datetime
import gc
import os
import signal
import tempfile
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGUSR1", None)) if s is not None)


def _run_task(rank: int, world: int, init_file: str, fn: Callable, args: tuple) -> tuple[str, Any]:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        return "ok", fn(rank, world, *args)
    except BaseException:  # noqa: BLE001 - the parent reports it
        return "error", traceback.format_exc()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve(rank: int, world: int, tasks, results) -> None:
    """A warm rank: run tasks until told to stop (None), restoring the process after each."""
    import torch
    seed, dtype, cwd = torch.initial_seed(), torch.get_default_dtype(), os.getcwd()
    env = dict(os.environ)
    handlers = {s: signal.getsignal(s) for s in _SIGNALS}
    while True:
        task = tasks.get()
        if task is None:
            return
        init_file, fn, args = task
        torch.manual_seed(seed)
        status, payload = _run_task(rank, world, init_file, fn, args)
        results.put((rank, status, payload))
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        for s, h in handlers.items():
            signal.signal(s, h)
        torch.set_grad_enabled(True)
        torch.set_default_dtype(dtype)
        gc.collect()


def _fresh(rank: int, world: int, init_file: str, fn: Callable, args: tuple, results) -> None:
    status, payload = _run_task(rank, world, init_file, fn, args)
    results.put((rank, status, payload))


class _Pool:
    """``world`` warm ranks, each with its own task queue and one shared result queue."""

    def __init__(self, world: int) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.results = ctx.SimpleQueue()
        self.tasks = [ctx.SimpleQueue() for _ in range(world)]
        self.procs = [ctx.Process(target=_serve, args=(r, world, self.tasks[r], self.results), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def submit(self, init_file: str, fn: Callable, args: tuple) -> None:
        for q in self.tasks:
            q.put((init_file, fn, args))

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)


_POOLS: dict[int, _Pool] = {}


def _collect(results, procs: list, world: int, deadline: datetime.datetime, timeout: float,
             warm: bool) -> tuple[dict, list]:
    got: dict[int, Any] = {}
    errors: list[str] = []
    while len(got) + len(errors) < world:
        if not results.empty():
            rank, status, payload = results.get()
            (got.__setitem__(rank, payload) if status == "ok" else errors.append(f"rank {rank}:\n{payload}"))
            continue
        if datetime.datetime.now() > deadline:
            errors.append(f"timed out after {timeout}s")
            break
        # a warm rank never exits; a fresh one exits 0 once it has put its result
        if any(p.exitcode is not None and (warm or p.exitcode != 0) for p in procs) and results.empty():
            time.sleep(0.5)
            if results.empty():
                errors.append("a worker died: exit codes " + str([p.exitcode for p in procs]))
                break
        time.sleep(0.02)
    return got, errors


def _fresh_mode() -> bool:
    return os.environ.get("MCT_TEST_FRESH_RANKS") == "1"


def run_distributed(fn: Callable, world: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return the results by rank.
    Raises AssertionError with the failing ranks' tracebacks, or on timeout (after
    killing every rank)."""
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        if _fresh_mode():
            ctx = mp.get_context("spawn")
            results = ctx.SimpleQueue()
            procs = [ctx.Process(target=_fresh, args=(r, world, init_file, fn, args, results), daemon=True)
                     for r in range(world)]
            for p in procs:
                p.start()
            got, errors = _collect(results, procs, world, deadline, timeout, warm=False)
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
        else:
            pool = _POOLS.get(world)
            if pool is None or not all(p.is_alive() for p in pool.procs):
                if pool is not None:
                    pool.kill()
                pool = _POOLS[world] = _Pool(world)
            clean = False
            try:
                pool.submit(init_file, fn, args)
                got, errors = _collect(pool.results, pool.procs, world, deadline, timeout, warm=True)
                clean = not errors
            finally:  # an error, a timeout or an interrupt (pytest-timeout): a rank may be stuck in a
                if not clean:  # collective or left in any state, so the next call starts over
                    _POOLS.pop(world, None)
                    pool.kill()
        if errors:
            raise AssertionError("\n".join(errors))
        return [got[r] for r in range(world)]
