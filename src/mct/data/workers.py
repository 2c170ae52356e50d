"""Worker processes that map a function over a stream, in order, and stop at once.

``mct prepare --workers N`` encodes chunks in N processes. ``multiprocessing.Pool`` did
this until a Ctrl-C met it with results in flight: ``Pool.terminate`` puts a sentinel on
the result queue under a lock that a worker holds while it writes a large result into a
pipe nobody reads any more, so the parent waited for ever (seen as a hung ``mct prepare``
after SIGINT). Its handler threads share locks and pipes with every worker, so a worker
killed at the wrong moment, by the user or the OOM killer, can hang it too.

``OrderedWorkers`` shares nothing: each worker has its own task pipe and result pipe,
and the parent alone holds the other ends (a forked worker closes the ends it inherited).
Item ``i`` goes to worker ``i mod N``, so reading results worker by worker in that order
gives them in input order. A worker reads its tasks on a thread of its own, so the
parent's send never waits on a worker that is busy writing a result, and the parent
keeps at most two items per worker in flight. Stopping is ``SIGKILL`` and ``join``: no
lock, no pipe and no handler can hold it up. A worker that dies mid-run is named in a
one-line ``ValueError`` (the exit code, and the signal that killed it) instead of a wait.

Signals: Ctrl-C reaches the whole process group, and only the parent acts on it. Each
worker ignores SIGINT and dies by SIGTERM; while workers are forked the parent holds both
signals back (delivered once they are up), and each forked child is set up before any of
its code runs (``os.register_at_fork``), so a signal in that window neither prints a stray
traceback from a half-born worker nor is lost.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import threading
from collections import deque
from multiprocessing.connection import Connection
from typing import Any, Callable, Iterable, Iterator

_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}

_forking_workers = False
"""True while ``OrderedWorkers`` forks: ``_forked_worker_signals`` then runs in each child."""


def _worker_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _forked_worker_signals() -> None:
    """In a forked child, before anything else runs: SIGINT ignored, SIGTERM fatal and both
    unblocked (the parent held them back while forking)."""
    if _forking_workers:
        _worker_signals()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


if hasattr(os, "register_at_fork") and hasattr(signal, "pthread_sigmask"):
    os.register_at_fork(after_in_child=_forked_worker_signals)


@contextlib.contextmanager
def _forking_window() -> Iterator[None]:
    """While workers are forked: Ctrl-C and SIGTERM held back in this process (delivered,
    never lost, on leaving) and the children set up by ``_forked_worker_signals``."""
    global _forking_workers
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    _forking_workers = True
    try:
        yield
    finally:
        _forking_workers = False
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _read_tasks(tasks: Connection, inbox: queue.SimpleQueue) -> None:
    """A worker's reader thread: every task into ``inbox``, then None (the parent's None,
    or its end closed: the parent finished or died)."""
    while True:
        try:
            item = tasks.recv()
        except (EOFError, OSError):
            item = None
        inbox.put(item)
        if item is None:
            return


def _serve(tasks: Connection, results: Connection, setup: Callable[[Any], Any], setup_arg: Any,
           work: Callable[[Any, Any], Any], inherited: list[Connection]) -> None:
    """A worker's main: ``state = setup(setup_arg)``, then ``(True, work(state, item))`` or
    ``(False, exception)`` sent back for each item, in order (``setup``'s exception, when it
    raised, for every item)."""
    _worker_signals()
    for conn in inherited:  # the parent's ends, copied by fork: only the parent may hold them
        conn.close()
    try:
        state, failed = setup(setup_arg), None
    except Exception as e:  # the answer to every item: the parent raises it, not a worker's traceback
        state, failed = None, e
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read_tasks, args=(tasks, inbox), daemon=True).start()
    while (item := inbox.get()) is not None:
        try:
            if failed is not None:
                raise failed
            out: tuple[bool, Any] = (True, work(state, item))
        except Exception as e:  # re-raised in the parent, type and message kept
            out = (False, e)
        try:
            results.send(out)
        except OSError:  # the parent is gone or stopping
            return
        except Exception as e:  # the result or the exception would not pickle (nothing was written)
            with contextlib.suppress(OSError):
                results.send((False, RuntimeError(f"a worker's result could not be sent back: "
                                                  f"{type(e).__name__}: {e}")))


def _exit_text(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (the out-of-memory killer sends SIGKILL: fewer --workers need less memory)" \
            if -code == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {code}"


class OrderedWorkers:
    """``n`` worker processes; ``map(items)`` yields ``work(state, item)`` for each item in
    input order, where each worker built ``state = setup(setup_arg)`` once. ``setup``,
    ``work`` and the items must pickle where processes are spawned (not forked). Use as a
    context manager: leaving it stops every worker (SIGKILL) and joins it."""

    def __init__(self, n: int, setup: Callable[[Any], Any], setup_arg: Any, work: Callable[[Any, Any], Any]):
        if n < 1:
            raise ValueError(f"OrderedWorkers needs n >= 1, got {n}")
        forking = "fork" in mp.get_all_start_methods()
        ctx = mp.get_context("fork" if forking else "spawn")  # fork: starts in milliseconds, shares imports
        self._procs: list[Any] = []
        self._tasks: list[Connection] = []
        self._results: list[Connection] = []
        try:
            with _forking_window():
                for i in range(n):
                    task_r, task_w = ctx.Pipe(duplex=False)
                    self._tasks.append(task_w)
                    res_r, res_w = ctx.Pipe(duplex=False)
                    self._results.append(res_r)
                    inherited = [*self._tasks, *self._results] if forking else []
                    proc = ctx.Process(target=_serve, args=(task_r, res_w, setup, setup_arg, work, inherited),
                                       name=f"mct-worker-{i}", daemon=True)
                    try:
                        proc.start()
                    finally:
                        task_r.close()
                        res_w.close()
                    self._procs.append(proc)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "OrderedWorkers":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def map(self, items: Iterable[Any]) -> Iterator[Any]:
        n = len(self._procs)
        pending: deque[int] = deque()
        for i, item in enumerate(items):
            self._send(i % n, item)
            pending.append(i % n)
            while len(pending) >= 2 * n:
                yield self._receive(pending.popleft())
        while pending:
            yield self._receive(pending.popleft())
        self.finish()

    def _send(self, w: int, item: Any) -> None:
        try:
            self._tasks[w].send(item)
        except (BrokenPipeError, ConnectionResetError):
            raise self._died(w) from None

    def _receive(self, w: int) -> Any:
        try:
            ok, value = self._results[w].recv()
        except (EOFError, ConnectionResetError):
            raise self._died(w) from None
        if not ok:
            raise value
        return value

    def _died(self, w: int) -> ValueError:
        proc = self._procs[w]
        proc.join(timeout=5)
        return ValueError(f"worker {w} of {len(self._procs)} (pid {proc.pid}) {_exit_text(proc.exitcode)} "
                          f"mid-run; nothing was written: run the command again")

    def finish(self, timeout: float = 10.0) -> None:
        """Tell each worker there is no more work and wait for it (then stop it anyway)."""
        for conn in self._tasks:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self._procs:
            proc.join(timeout)
        self.close()

    def close(self) -> None:
        """Stop every worker now (SIGKILL: nothing it holds can keep it) and join it. Idempotent."""
        for conn in self._tasks:
            conn.close()
        for proc in self._procs:
            if proc.exitcode is None:
                proc.kill()
        for proc in self._procs:
            proc.join()
        for conn in self._results:
            conn.close()
