"""``mct train --nproc N``: the launcher, and the worker's side of it.

Launcher (``mct.run.agent.launch_local`` on one machine, ``launch`` around torchrun on several): starts
the workers (``mct.run.agent``; several machines: ``torch.distributed.run`` with the
workers' command), forwards SIGTERM/SIGINT to every worker (and to torchrun), and exits
with the workers' exit code (0 done, 2 user error, 3 stopped by a feedback loop, 130/143
signals), not torchrun's 1. The launcher imports nothing heavy: its checks run in a forked
child (``mct.run.apart``), so it holds about 22 MiB while the workers train. Each worker
leaves its exit code and its one-line message in a private directory
(``MCT_LAUNCH_DIR``); the launcher prints that line once. The agent's lines (which worker
failed how) and torchrun's own Python output (its log, its failure report, in a log
file) are shown only when no worker explains the failure; the workers inherit the
launcher's stdout and stderr. Workers and torchrun die with the launcher
(``PR_SET_PDEATHSIG``), so even a SIGKILLed launcher leaves no training behind.

Worker (``WorkerLink``): asks the kernel for SIGTERM when its parent dies (elsewhere
than Linux: watches the parent pid), and records its pid and exit for the launcher.
A worker that dies in native code (an abort, a segfault) leaves no exit record: its
Python stack at that moment goes to a file (``faulthandler``), and the launcher ends
its report with that stack and one line naming the rank, the signal and the frame.
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from mct.run.crash import RUN_DIR_FILE, crash_report, lost_worker_line  # noqa: F401 (callers import them here)

PR_SET_PDEATHSIG = 1
FORCE_KILL_AFTER_S = 55.0
"""After forwarding a signal, the launcher SIGKILLs whatever still runs after this long
(so nothing outlives it by more than a minute); workers save within preempt_timeout_s."""
PRIORITY = (2, 3, 143, 130)
"""Which worker exit code the launcher reports when ranks differ (first match wins)."""
FINAL = (2, 3)
"""Exit codes no restart can change: the worker stops torchrun instead of letting it restart.
(130/143 are not: torchrun itself sends SIGTERM to the survivors when it restarts a group.)"""


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits (Linux).
    Returns False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def watch_parent(sig: int = signal.SIGTERM, interval_s: float = 1.0) -> threading.Thread:
    """Fallback for ``die_with_parent``: a daemon thread sending ``sig`` to this process
    once its parent pid changes (the parent died and the process was re-parented)."""
    parent = os.getppid()

    def run() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os.kill(os.getpid(), sig)
    t = threading.Thread(target=run, name="mct-parent-watch", daemon=True)
    t.start()
    return t


# ---------------------------------------------------------------- worker side
_FAULT_FILE = None
"""The open file faulthandler writes to (kept referenced: faulthandler holds only its fd)."""


@dataclass
class WorkerLink:
    """A worker's link to its launcher; every method is a no-op without one."""

    launch_dir: Path | None
    rank: int
    restart: int

    @classmethod
    def from_env(cls) -> "WorkerLink":
        d = os.environ.get("MCT_LAUNCH_DIR")
        return cls(Path(d) if d and Path(d).is_dir() else None, int(os.environ.get("RANK", "0")),
                   int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0))

    @property
    def active(self) -> bool:
        return self.launch_dir is not None

    def setup(self) -> None:
        """Die with the parent (torchrun); record the pid for the launcher."""
        parent = os.getppid()
        if not die_with_parent():
            watch_parent()
        elif os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)
        if self.active:
            self._write(f"pid.{self.rank}", str(os.getpid()))
            # SIGSEGV, SIGFPE, SIGABRT, SIGBUS, SIGILL: this process's Python stack, every thread,
            # for the launcher's report (the file stays open for the life of the process)
            global _FAULT_FILE
            _FAULT_FILE = open(self.launch_dir / f"fault.{self.restart}.{self.rank}", "w")
            faulthandler.enable(file=_FAULT_FILE, all_threads=True)

    def finish(self, code: int, line: str = "") -> None:
        """Record this worker's exit code and its one-line message for the launcher. A
        final code (user error, stop condition) also stops torchrun, which would
        otherwise restart the group (``--max-restarts``) into the same outcome."""
        name = f"exit.{self.restart}.{self.rank}"
        if self.launch_dir is None or (self.launch_dir / name).exists():  # reported once, by the innermost
            return
        self._write(name,
                    json.dumps({"code": code, "line": line, "restart": self.restart, "rank": self.rank}))
        if self.active and code in FINAL:
            try:
                os.kill(os.getppid(), signal.SIGTERM)
            except ProcessLookupError:
                pass

    def note_run_dir(self, run_dir: str) -> None:
        """Rank 0 tells the launcher the run's directory (named in the lost-worker line)."""
        if self.rank == 0:
            self._write(RUN_DIR_FILE, run_dir)

    def _write(self, name: str, text: str) -> None:
        if self.launch_dir is None:
            return
        tmp = self.launch_dir / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.launch_dir / name)


def leave(code: int) -> None:
    """End a torchrun worker whose work is done and reported: flush, run the ``atexit``
    handlers, then ``os._exit(code)``, without the interpreter's teardown. Now and then a
    finished worker aborted in that teardown ("terminate called without an active
    exception": a library's C++ thread destroyed while joinable, after the run's last file
    was written); torchrun then stopped the other ranks and reported a complete run as
    failed. Never returns."""
    import atexit
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:
        atexit._run_exitfuncs()
    finally:
        os._exit(code)


# ---------------------------------------------------------------- launcher side
def torchrun_command(argv: list[str], *, nproc: int, max_restarts: int = 0, nnodes: int = 1,
                     rdzv_endpoint: str | None = None, rdzv_id: str | None = None) -> list[str]:
    """The torchrun command line for ``mct <argv>`` in ``nproc`` workers per node.
    One node: ``--standalone``. Several: a c10d rendezvous at ``rdzv_endpoint``."""
    if nnodes > 1:
        if not rdzv_endpoint:
            raise ValueError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node)")
        where = [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
                 f"--rdzv-id={rdzv_id or 'mct'}"]
    else:
        where = ["--standalone"]
    return [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "-m", "mct", *argv]


# torchrun's own Python output (its log lines, its ChildFailedError report) goes to a
# file; the file descriptors 1 and 2 that the workers inherit stay the launcher's. Once
# main() is done (its workers have exited or been killed), torchrun's own descriptors 1
# and 2 go to the file too: what its C++ side prints while the interpreter shuts down
# after a signal (e.g. "terminate called without an active exception" from a store
# thread) is torchrun's, not a line for the user.
_QUIET_TORCHRUN = ("import os, sys; log = sys.stderr = sys.stdout = open(sys.argv[1], 'w', buffering=1); "
                   "sys.argv = ['torchrun', *sys.argv[2:]]; "
                   "from torch.distributed.run import main\n"
                   "try:\n    main()\n"
                   "finally:\n    log.flush(); os.dup2(log.fileno(), 1); os.dup2(log.fileno(), 2)")


def launch(cmd: list[str], nproc: int) -> int:
    """Run the torchrun command ``cmd`` (from ``torchrun_command``; several machines); forward
    SIGTERM and SIGINT; return the workers' exit code, their one line printed once to stderr."""
    with tempfile.TemporaryDirectory(prefix="mct-launch-") as tmp:
        d = Path(tmp)
        assert cmd[1:3] == ["-m", "torch.distributed.run"], cmd
        quiet = [cmd[0], "-c", _QUIET_TORCHRUN, str(d / "torchrun.log"), *cmd[3:]]
        sys.stdout.flush()
        sys.stderr.flush()
        proc = subprocess.Popen(quiet, env=launch_env(tmp, nproc), start_new_session=True,
                                preexec_fn=die_with_parent)
        got = _forward_signals(lambda sig: _signal_all(proc, d, sig))
        try:
            rc = _wait(proc, d, got)
        finally:
            for sig, prev in got["previous"].items():
                signal.signal(sig, prev)
        return _result(d, rc, got["signum"])


def launch_env(launch_dir: str, nproc: int) -> dict[str, str]:
    """The workers' environment: this one, the launch dir, the launcher's pid (its resident
    peak is part of the job's, ``mct.memory.process``), and one core's share of threads."""
    env = dict(os.environ, MCT_LAUNCH_DIR=launch_dir, MCT_LAUNCHER_PID=str(os.getpid()))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env


def _forward_signals(send: Callable[[int], None]) -> dict[str, Any]:
    """Install SIGTERM/SIGINT handlers that ``send`` the signal on; the first one received is
    noted (``signum``, ``at``); ``previous`` holds the handlers to restore."""
    got: dict[str, Any] = {"signum": 0, "at": 0.0, "previous": {}}

    def handle(signum: int, frame: Any) -> None:
        if not got["signum"]:
            got["signum"], got["at"] = signum, time.monotonic()
        send(signum)
    for sig in (signal.SIGTERM, signal.SIGINT):
        got["previous"][sig] = signal.signal(sig, handle)
    return got


def _worker_pids(d: Path) -> list[int]:
    pids = []
    for f in d.glob("pid.*"):
        try:
            pids.append(int(f.read_text()))
        except (OSError, ValueError):
            pass
    return pids


def _signal_all(proc: subprocess.Popen, d: Path, sig: int) -> None:
    """``sig`` to torchrun (which stops restarting and forwards it) and to each worker."""
    for pid in [proc.pid, *_worker_pids(d)]:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _wait(proc: subprocess.Popen, d: Path, got: dict[str, Any]) -> int:
    """Wait for torchrun; once a signal was forwarded, SIGKILL everything still alive
    after FORCE_KILL_AFTER_S."""
    while True:
        try:
            return proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            if got["signum"] and time.monotonic() - got["at"] > FORCE_KILL_AFTER_S:
                _signal_all(proc, d, signal.SIGKILL)
                return proc.wait()


def read_exits(d: Path) -> list[dict[str, Any]]:
    records = []
    for f in d.glob("exit.*"):
        try:
            records.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            pass
    return sorted(records, key=lambda r: (r["restart"], r["rank"]))


def _result(d: Path, torchrun_rc: int, signum: int) -> int:
    """The exit code of the launch, its one line printed here, once. A user error or a
    stop condition in any attempt is the answer; otherwise the last attempt's codes.
    130/143 that we did not forward mean torchrun stopped the group because a worker
    died: torchrun's report is then the explanation, and a worker that died in native code
    adds its Python stack and a line naming it (``crash_report``), last. A run that
    completed after such a crash (the group was restarted) prints the report and one warning."""
    records = read_exits(d)
    final = [r for r in records if r["code"] in (2, 3)]
    if records and not final:
        last = max(r["restart"] for r in records)
        final = [r for r in records if r["restart"] == last]
    codes = [r["code"] for r in final]
    code = next((c for c in PRIORITY if c in codes), max(codes, default=0))
    if code in (130, 143) and not signum:
        code = 0 if torchrun_rc == 0 else -1
    crash = crash_report(d)  # a worker that died in native code: the cause, printed last
    lost = "" if signum or torchrun_rc == 0 or code in FINAL or crash else lost_worker_line(d, records)
    if lost:  # killed from outside (kill -9, the OOM killer): one line instead of the peers' and torchrun's
        print(lost, file=sys.stderr, flush=True)
        return 1
    if code > 0:
        line = next((r["line"] for r in final if r["code"] == code and r["line"]), "")
        if line:
            print(line, file=sys.stderr, flush=True)
        sys.stderr.write(crash)
        return code
    if code == 0 and records and torchrun_rc == 0:
        if crash:  # the group was restarted (--max-restarts) and the run completed
            sys.stderr.write(crash)
            print("mct: warning: the run completed after its worker group was restarted (--max-restarts); "
                  "the crash above is what the restart recovered from", file=sys.stderr, flush=True)
        return 0
    if signum:
        return 128 + signum
    if torchrun_rc != 0:  # torchrun's report or the local agent's lines, then the crash
        for log in (d / "torchrun.log", d / "agent.log"):
            if log.is_file():
                sys.stderr.write(log.read_text(errors="replace"))
        sys.stderr.write(crash)
    return torchrun_rc


def check_rdzv_endpoint(endpoint: str, timeout_s: float = 10.0) -> None:
    """Raise ValueError unless ``endpoint`` is HOST:PORT with a port in 1..65535 and a
    host that resolves within ``timeout_s`` (torchrun would raise a traceback, or retry
    an unknown host for minutes)."""
    host, sep, port = endpoint.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--rdzv-endpoint {endpoint!r} must be HOST:PORT with a port in 1..65535, "
                         f"e.g. node0:29400")
    found: list = []
    resolver = threading.Thread(target=lambda: found.append(_resolves(socket, host, int(port))), daemon=True)
    resolver.start()
    resolver.join(timeout_s)
    if not found or not found[0]:
        raise ValueError(f"--rdzv-endpoint {endpoint!r}: host {host!r} does not resolve"
                         f"{'' if found else f' within {timeout_s:.0f} s'}; pass the name or address of the "
                         f"machine that hosts the rendezvous")


def _resolves(socket, host: str, port: int) -> bool:
    try:
        return bool(socket.getaddrinfo(host, port))
    except OSError:
        return False
