"""The launcher's own agent for one machine: ``mct train --nproc N`` starts its N workers
itself, with torchrun's environment, instead of running ``torch.distributed.run``.

torchrun's agent imports torch (about 220 MiB resident) to wait for its workers; this one
is standard library only, inside the launcher, so the launcher and its agent together hold
what the CLI's imports hold (about 22 MiB) while the workers train. Several machines
(``--nnodes``) still go through torchrun: its c10d rendezvous is what finds the peers.

What it keeps of torchrun's contract (``torchrun --standalone``): each worker gets RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT (rank 0 hosts the
store, a fresh port per attempt), TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT and
TORCHELASTIC_MAX_RESTARTS; once a worker fails, the others get SIGTERM (SIGKILL after
``STOP_GRACE_S``); the group is started again, the restart count one higher, while
``--max-restarts`` allows and no signal or final exit code (2, 3) stopped it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from mct.run.launch import (FINAL, FORCE_KILL_AFTER_S, _forward_signals, _result, die_with_parent, launch_env,
                            read_exits)

STOP_GRACE_S = 30.0
"""How long failed group's survivors have to exit after SIGTERM (torchrun's default)."""
POLL_S = 0.2


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (rank 0 binds it for the group's store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(base: dict[str, str], *, rank: int, nproc: int, restart: int, max_restarts: int,
               port: int, run_id: str) -> dict[str, str]:
    """``base`` plus the variables torchrun gives local rank ``rank`` of ``nproc`` on one machine."""
    return dict(base, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                ROLE_NAME="default", WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_RESTART_COUNT=str(restart),
                TORCHELASTIC_MAX_RESTARTS=str(max_restarts))


class LocalGroup:
    """The workers of the current attempt; ``pids`` is what the launcher forwards signals to."""

    def __init__(self, cmd: list[str], nproc: int, max_restarts: int, env: dict[str, str], d: Path):
        self.cmd, self.nproc, self.max_restarts, self.env, self.dir = cmd, nproc, max_restarts, env, d
        self.procs: list[subprocess.Popen] = []
        self.run_id = uuid.uuid4().hex[:12]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.poll() is None]

    def start(self, restart: int) -> None:
        port = free_port()
        self.procs = [subprocess.Popen(self.cmd, start_new_session=True, preexec_fn=die_with_parent,
                                       env=worker_env(self.env, rank=r, nproc=self.nproc, restart=restart,
                                                      max_restarts=self.max_restarts, port=port,
                                                      run_id=self.run_id))
                      for r in range(self.nproc)]

    def run(self, stopped: dict) -> int:
        """Run attempts until one succeeds (0), or fails with no restart left, a final
        exit code, or a signal in ``stopped["signum"]`` (1, torchrun's code for a failed
        group). Each failure is described in ``dir/agent.log``."""
        for restart in range(self.max_restarts + 1):
            self.start(restart)
            codes = self.wait(stopped)
            if all(c == 0 for c in codes):
                return 0
            self._log(restart, codes)
            final = any(r["code"] in FINAL for r in read_exits(self.dir) if r["restart"] == restart)
            if stopped["signum"] or final:
                break
        return 1

    def wait(self, stopped: dict) -> list[int]:
        """Every worker's exit code (negative: killed by that signal). Once one fails,
        the others get SIGTERM, then SIGKILL after STOP_GRACE_S."""
        failed_at = None
        while True:
            codes = [p.poll() for p in self.procs]
            if all(c is not None for c in codes):
                return codes  # type: ignore[return-value]
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = time.monotonic()
                self.signal(signal.SIGTERM)
            elif failed_at is not None and time.monotonic() - failed_at > STOP_GRACE_S:
                self.signal(signal.SIGKILL)
            if stopped["signum"] and time.monotonic() - stopped["at"] > FORCE_KILL_AFTER_S:
                self.signal(signal.SIGKILL)
            time.sleep(POLL_S)

    def signal(self, sig: int) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _log(self, restart: int, codes: list[int]) -> None:
        """One line per failed worker, for the launcher to show when no worker explains."""
        lines = []
        for rank, c in enumerate(codes):
            if c < 0:
                lines.append(f"mct: worker rank {rank} (restart {restart}) was killed by {signal.Signals(-c).name}\n")
            elif c:
                lines.append(f"mct: worker rank {rank} (restart {restart}) exited with code {c}\n")
        with open(self.dir / "agent.log", "a") as f:
            f.writelines(lines)


def local_command(argv: list[str]) -> list[str]:
    """The command each worker runs: ``python -m mct <argv>``."""
    return [sys.executable, "-m", "mct", *argv]


def launch_local(argv: list[str], nproc: int, max_restarts: int = 0) -> int:
    """Run ``mct <argv>`` in ``nproc`` workers on this machine, started by the launcher's
    own agent (``mct.run.agent``: no torchrun process, nothing heavy imported here);
    forward SIGTERM and SIGINT; return the workers' exit code, their one line printed once."""
    with tempfile.TemporaryDirectory(prefix="mct-launch-") as tmp:
        d = Path(tmp)
        sys.stdout.flush()
        sys.stderr.flush()
        group = LocalGroup(local_command(argv), nproc, max_restarts, launch_env(tmp, nproc), d)
        got = _forward_signals(group.signal)
        try:
            rc = group.run(got)
        finally:
            for sig, prev in got["previous"].items():
                signal.signal(sig, prev)
        return _result(d, rc, got["signum"])
