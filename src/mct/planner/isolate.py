"""Fake-tensor work in a forked child, so what it imports stays out of this process.

torch's ``FakeTensorMode`` imports ``torch._dynamo`` (``import torch._dynamo.config`` in
its constructor; about 70 MiB resident with sympy), and a training process never needs
it otherwise (``mct.optim.eager``, the tracker's dispatch mode). A training rank that
counts its step's FLOPs or predicts its step time on fake tensors does that in a child
forked for it (``run_forked``): the child inherits the task and the model code, imports
what the fake tensors need, sends the (small, picklable) result back and exits; this
process keeps its resident set. Where forking is not safe (``pool.can_fork``: not Linux,
a CUDA context), this process is a daemonic one (multiprocessing forbids it children) or
``torch._dynamo`` is loaded already (nothing left to keep out), the function runs here.

The child runs one intra-op thread: GNU OpenMP's thread pool does not survive ``fork``
(a parallel region in the child waits for the parent's threads forever), and fake tensors
compute nothing. So only fake-tensor work belongs here; measurements stay in the parent.
"""

from __future__ import annotations

import multiprocessing
import sys
from multiprocessing.connection import Connection
from typing import Any, Callable, TypeVar

import torch

from mct.planner.pool import can_fork

Result = TypeVar("Result")


def keeps_dynamo_out() -> bool:
    """Would ``run_forked`` fork: forking is safe here and ``torch._dynamo`` is not loaded?"""
    return "torch._dynamo" not in sys.modules and can_fork()


def run_forked(fn: Callable[[], Result]) -> Result:
    """``fn()``, computed in a forked child where ``keeps_dynamo_out()`` (else here) and
    returned here (pickled through a pipe). An exception ``fn`` raises is raised here; a
    child that ends without an answer (killed, out of memory, an unpicklable result)
    makes ``fn()`` run here instead. Mutates nothing of this process's but what ``fn``
    would when it runs here."""
    if not keeps_dynamo_out() or multiprocessing.current_process().daemon:
        return fn()  # (a daemonic process, e.g. a pool's worker, may not start children)
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(fn, send), daemon=True)
    child.start()  # the fork start method: nothing is pickled on the way in
    send.close()
    try:
        ok, value = receive.recv()
    except EOFError:
        ok, value = None, None
    finally:
        receive.close()
        child.join()
    if ok is None:
        return fn()
    if not ok:
        raise value
    return value


def _child(fn: Callable[[], Any], send: Connection) -> None:
    torch.set_num_threads(1)
    try:
        answer: tuple[bool, Any] = (True, fn())
    except Exception as e:  # noqa: BLE001 - raised again in the parent
        answer = (False, e)
    try:
        send.send(answer)
    except Exception:  # noqa: BLE001 - an unpicklable result or error: the parent runs fn itself
        pass
    send.close()
