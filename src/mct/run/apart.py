"""The launcher's checks in a forked child, so the launcher itself never imports torch.

``mct train --nproc N`` checks what it can before any worker starts (the model source,
the host memory, an impossible budget, the run dir): those checks build the task and run
the planner, which import torch and the model library (about 220-400 MiB resident). The
launcher then waits for its workers for the whole run; had it made the checks itself, it
would hold all of that for nothing. ``apart(fn)`` forks, runs ``fn`` in the child (which
prints its warnings to the same stderr), hands the result back through a pipe, and the
child exits: the parent stays as lean as the CLI's own imports (about 22 MiB).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any, Callable


def apart(fn: Callable[[], Any]) -> Any:
    """``fn()``'s JSON-able result, computed in a forked child. A ValueError or OSError in
    the child (a user mistake: its message as ``mct.errors.describe`` words it) is raised
    here as ValueError with that message; a KeyboardInterrupt as KeyboardInterrupt; anything
    else as RuntimeError after the child printed its traceback. Where ``os.fork`` is
    missing, or the caller already imported torch (nothing to save), ``fn`` runs here."""
    if not hasattr(os, "fork") or "torch" in sys.modules:
        return fn()
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's stack
        os.close(read)
        _child(fn, write)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        payload = f.read()
    _, status = os.waitpid(pid, 0)
    if not payload:
        raise RuntimeError(f"the launch checks' process ended without an answer (wait status {status})")
    answer = json.loads(payload)
    if "error" in answer:
        raise ValueError(answer["error"])
    if answer.get("interrupted"):
        raise KeyboardInterrupt
    if "crash" in answer:
        raise RuntimeError(answer["crash"])
    return answer["result"]


def _child(fn: Callable[[], Any], fd: int) -> None:
    code = 0
    try:
        from mct.run.launch import die_with_parent
        die_with_parent()  # a launcher stopped while it checks leaves no check running
        try:
            answer: dict[str, Any] = {"result": fn()}
        except ValueError as e:
            answer = {"error": str(e)}
        except OSError as e:  # a path the user named (mct.errors)
            from mct.errors import describe
            answer = {"error": describe(e)}
        except KeyboardInterrupt:
            answer = {"interrupted": True}
        except BaseException as e:  # a bug: the traceback here, one line for the caller
            traceback.print_exc()
            answer, code = {"crash": f"{type(e).__name__}: {e}"}, 1
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(answer).encode())
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)
