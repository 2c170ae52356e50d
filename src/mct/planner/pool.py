"""The grid's dry runs on several CPU cores: one forked worker process per core.

A dry run is single-threaded Python (fake-tensor dispatch, about 0.1 ms per op), so a
plan of many configurations of a large model is bound by one core. ``run_jobs`` runs
the first job in this process and, when the rest would take long enough to pay for it,
forks worker processes (``fork``: they inherit the prepared model; nothing is pickled
but the results) for the others, longest first. Results come back in job order and
equal those of a sequential run (each job is independent and deterministic).

Forking is used only where it is safe: a platform with ``fork`` (Linux), and no CUDA
context in this process. Otherwise, or with ``workers=1``, the jobs run here, in order.
"""

from __future__ import annotations

import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Sequence

import torch

from mct.machine.profile import usable_cores

_JOB: Callable[[int], Any] | None = None  # set in the parent before forking; the workers inherit it
MAX_PLAN_WORKERS = 8
MIN_PARALLEL_S = 2.0
"""Fork only when the remaining jobs are predicted to take at least this long in one process."""


class WorkerDied(RuntimeError):
    """A worker process ended before its job did (killed, out of memory)."""


def plan_workers(workers: int | None) -> int:
    """The worker count of a plan: ``workers``, or None for one per usable core (at
    most ``MAX_PLAN_WORKERS``). Raises ValueError for a count below 1."""
    if workers is None:
        return max(1, min(usable_cores(), MAX_PLAN_WORKERS))
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers (mct plan --workers) must be an integer >= 1 (default: one per CPU core), "
                         f"got {workers!r}")
    return workers


def can_fork() -> bool:
    """Forking a worker is safe here: Linux and no CUDA context (a forked child cannot use it)."""
    if not sys.platform.startswith("linux") or "fork" not in multiprocessing.get_all_start_methods():
        return False
    torch = sys.modules.get("torch")
    return not (torch is not None and torch.cuda.is_initialized())


def _stop(pool: ProcessPoolExecutor, others: set) -> None:
    """Drop the queued jobs and end the pool's workers now (a running dry run is not
    finished); ``others``: this process's children from before the pool, left alone."""
    pool.shutdown(wait=False, cancel_futures=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # again: the executor's thread may be starting one as we go
        workers = [c for c in multiprocessing.active_children() if c not in others]
        if not workers:
            return
        for child in workers:
            child.terminate()
        for child in workers:
            child.join(1)


def _worker_init() -> None:
    torch.set_num_threads(1)  # a dry run computes nothing: no intra-op thread pool per worker


def _call(i: int) -> tuple[int, bool, Any]:
    assert _JOB is not None
    try:
        return i, True, _JOB(i)
    except Exception as e:  # noqa: BLE001 - sent back and raised in the parent, as the sequential run would
        return i, False, (type(e).__name__, str(e))


def run_jobs(job: Callable[[int], Any], n: int, *, workers: int = 1, cost: Sequence[float] | None = None
             ) -> list[Any]:
    """``[job(0), ..., job(n - 1)]``. ``workers`` > 1: after the first job, the rest run in
    up to ``workers`` forked processes when they would take ``MIN_PARALLEL_S`` or more
    here (``cost``: relative cost per job, the longest dispatched first). A job's
    exception is raised here: ValueError with its message (the first failing job in
    order), anything else as RuntimeError naming it; ``WorkerDied`` when a worker process
    ends before its job (killed, out of memory)."""
    global _JOB
    if n == 0:
        return []
    t0 = time.perf_counter()
    out: list[Any] = [None] * n
    out[0] = job(0)
    first_s = time.perf_counter() - t0
    rest = list(range(1, n))
    weights = list(cost) if cost is not None else [1.0] * n
    predicted = first_s * sum(weights[i] for i in rest) / max(weights[0], 1e-9)
    workers = min(workers, len(rest))
    if workers <= 1 or predicted < MIN_PARALLEL_S or not can_fork():
        for i in rest:
            out[i] = job(i)
        return out
    rest.sort(key=lambda i: -weights[i])
    _JOB = job
    failed: dict[int, tuple[str, str]] = {}
    # an executor, not multiprocessing.Pool: a worker that dies (killed, out of memory)
    # breaks it with an error instead of leaving its job waited for forever
    others = set(multiprocessing.active_children())
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"), initializer=_worker_init)
    try:
        for future in as_completed([pool.submit(_call, i) for i in rest]):
            i, ok, value = future.result()
            if ok:
                out[i] = value
            else:
                failed[i] = value
    except BrokenProcessPool:
        _stop(pool, others)
        raise WorkerDied("a planner worker process died (killed, or out of memory) before its dry run "
                         "finished; plan in one process with --workers 1 (mct.plan(workers=1))") from None
    except BaseException:  # Ctrl-C, an error here: the queued dry runs are not waited for
        _stop(pool, others)
        raise
    else:
        pool.shutdown()
    finally:
        _JOB = None
    if failed:
        name, msg = failed[min(failed)]
        raise ValueError(msg) if name == "ValueError" else RuntimeError(f"a planner worker failed: {name}: {msg}")
    return out
