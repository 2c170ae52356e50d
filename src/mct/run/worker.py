"""The process that runs ``mct train``: one rank (alone, or under torchrun). It owns the
run dir's lock, the signal handlers, the process group's life, and the rule that every
way a run ends is an exit code and at most one line (the launcher prints it once)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sys
import time
from pathlib import Path

from mct.config import EngineConfig
from mct.dist import broadcast_from_main, init_distributed, teardown
from mct.memory.tracker import MemoryBudgetExceeded
from mct.run.launch import WorkerLink
from mct.run.signals import Preempted, StopRequest
from mct.reporting.report import summary_table
from mct.run.rollback import TrainingStopped
from mct.run.trainer import train
from mct.task import Task


def run_worker(cfg: EngineConfig, run_dir: str | None, *, resume: bool, progress: bool,
               task: Task | None = None) -> int:
    """One training process (alone, or a rank under torchrun): ``train`` under the run
    dir's lock and the signal handlers (``task``: ``task_for(cfg)`` when the caller has
    it already). Every way it ends is an exit code and at most one
    line: 2 user error, 3 stop condition, 128 + signal (1: a peer process is gone)."""
    link = WorkerLink.from_env()
    stop = StopRequest(timeout_s=cfg.train.preempt_timeout_s).install()
    code, line, is_main, every_rank = 0, "", int(os.environ.get("RANK", "0")) == 0, True
    try:
        ctx = init_distributed(cfg.distributed.backend, cfg.distributed.timeout_s)
        run_dir = broadcast_from_main(run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
        existed = Path(run_dir).exists()
        link.note_run_dir(run_dir)
        try:
            with run_dir_lock(run_dir, ctx, new=not resume):
                summary = train(cfg, run_dir, ctx, progress=progress, resume=resume,
                                stop=stop, task=task)
        except (ValueError, MemoryBudgetExceeded, MemoryError, RuntimeError) as e:
            oom = _is_out_of_memory(e)
            if not (oom or isinstance(e, ValueError)):
                raise
            if ctx.is_main and not resume and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                _discard_empty_run(Path(run_dir), existed)  # a failed new run leaves nothing behind
            if oom:
                raise _OutOfMemory(_memory_message(e)) from None
            raise
        if ctx.is_main:
            print(summary_table(summary))
    except _OutOfMemory as e:
        code, line, every_rank = 2, f"mct: error: {e}", False
    except (ValueError, MemoryBudgetExceeded) as e:
        code, line = 2, "mct: error: " + " ".join(str(e).split())
    except TrainingStopped as e:
        code, line = 3, f"mct: training stopped: {e}"
    except Preempted as e:
        code, line = e.exit_code, f"mct: {e}"
    except Exception as e:
        if stop.signum:  # stopping, and a peer is already gone (its collective failed): nothing to save together
            code, line = 128 + stop.signum, f"mct: stopped by {stop.name}; the newest complete checkpoint is unchanged"
        elif _peer_gone(e):  # a worker died; torchrun restarts the group (--max-restarts) or reports it
            code, line = 1, _peer_gone_line(e, run_dir)
        elif _place_failed(e):  # a full disk or an unwritable place outside a checkpoint save
            code, line = 2, f"mct: error: {_place_message(e, run_dir, cfg)}; the newest complete checkpoint is unchanged"
        else:
            raise
    finally:
        stop.uninstall()
        teardown()
    link.finish(code, line)
    if line and not link.active and (is_main or (code == 2 and every_rank)):  # a user error may be one rank's
        print(line, file=sys.stderr)
    return code


class _OutOfMemory(Exception):
    """The host or device ran out of memory (or the budget was crossed): one line, exit 2."""


_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator was aborted")
"""What gloo / NCCL say when another rank's process died under a collective."""


def _peer_gone(e: Exception) -> bool:
    """A collective failed because another rank's process died (gloo / NCCL wording)."""
    text = str(e)
    return isinstance(e, RuntimeError) and any(k in text for k in _PEER_GONE)


def _peer_gone_line(e: Exception, run_dir: str | None) -> str:
    """One line for a collective that failed because another rank's process died: the
    transport's reason (its own words, whole, without its source location), the checkpoint a
    resume starts from and the resume command. (Under ``mct train --nproc`` the launcher
    prints its own line naming the lost rank instead.)"""
    from mct.persistence.run_dir import resume_candidate
    reason = next(k for k in _PEER_GONE if k in str(e))
    pick = resume_candidate(run_dir) if run_dir else None
    where = (f"the last good checkpoint is {pick}; continue with: mct train --resume {run_dir}" if pick else
             "no checkpoint was written yet (train.checkpoint_every)")
    return f"mct: error: a peer process is gone (a collective failed: {reason}); {where}"


def _place_failed(e: BaseException) -> bool:
    """An OSError of the file system refusing a write: full, over quota, read-only,
    not permitted, or a file-size limit."""
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES,
                                                  errno.EPERM, errno.EFBIG)


def _place_message(e: OSError, run_dir: str | None, cfg: EngineConfig) -> str:
    """``mct.errors.describe`` of ``e``, reading or writing: a full, over-quota or read-only
    file system and anything in the run directory or offload.dir are writes; a path
    elsewhere (the corpus, the init-from weights) is a read."""
    from mct.errors import READ, WRITE, describe
    if not e.filename:
        return describe(e, run_dir, WRITE)
    where = Path(os.path.abspath(e.filename))
    ours = [Path(os.path.abspath(d)) for d in (run_dir, cfg.offload.dir) if d]
    writing = e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG) or any(
        d == where or d in where.parents for d in ours)
    return describe(e, where, WRITE if writing else READ)


def _is_out_of_memory(e: BaseException) -> bool:
    """An enforced budget crossed, or the host/device refusing an allocation."""
    if type(e).__name__ == "MemoryBudgetExceeded" or isinstance(e, MemoryError):
        return True
    return isinstance(e, RuntimeError) and ("out of memory" in str(e) or "can't allocate memory" in str(e))


def _memory_message(e: BaseException) -> str:
    """One line for a budget crossed (its own message) or the device/host running out."""
    if type(e).__name__ == "MemoryBudgetExceeded":
        return " ".join(str(e).split())
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return (f"out of memory ({first}); run `mct plan --budget <what this device has>` for a configuration "
            f"predicted to fit, or lower data.micro_batch_size or the model size")


def _discard_empty_run(run_dir: Path, existed: bool) -> None:
    """A run that failed before logging a step leaves nothing behind: remove the
    directory it created (only when this run created it and no metrics row exists)."""
    metrics = run_dir / "metrics.jsonl"
    if existed or (metrics.exists() and metrics.stat().st_size > 0):
        return
    shutil.rmtree(run_dir, ignore_errors=True)


@contextlib.contextmanager
def run_dir_lock(run_dir: str, ctx, new: bool):
    """Rank 0 holds the run dir's lock for the duration (a second run or --resume on it
    is a ValueError on every rank, before anything is written). A new run's directory
    is checked first, so the lock is never taken in a directory that holds a run."""
    from mct.persistence.run_dir import RunLock, check_new_run_dir
    lock, error = None, None
    if ctx.is_main:
        try:
            if new and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                check_new_run_dir(run_dir)
            lock = RunLock(run_dir)
        except ValueError as e:
            error = str(e)
    error = broadcast_from_main(error)
    if error is not None:
        raise ValueError(error)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
