"""What a process holds resident, as the kernel counts it: the figure a container's or a
job's memory limit compares with, beside the tracker's tensor bytes.

``resident_peak`` reads VmHWM (the peak resident set, "high water mark") of a process from
``/proc/PID/status``; ``job_resident`` adds up a ``mct train --nproc N`` job on this
machine: each worker's peak, the launcher's (``MCT_LAUNCHER_PID``, set by the launcher)
and torchrun's agent's where one runs between them (several machines). Standard library
only: the launcher imports it too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

LAUNCHER_PID_ENV = "MCT_LAUNCHER_PID"
"""The launcher's pid, in its workers' environment (``mct.run.launch.launch_env``)."""


def status_bytes(field: str, pid: int | str = "self") -> int | None:
    """The ``field`` line (VmHWM, VmRSS, ...) of ``/proc/PID/status`` in bytes; None where
    there is no such file (not Linux, a process gone) or no such field."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key == field:
            parts = rest.split()
            return int(parts[0]) * 1024 if parts and parts[0].isdigit() else None
    return None


def resident_peak(pid: int | str = "self") -> int | None:
    """Peak resident bytes (VmHWM) of ``pid`` so far; None where not readable."""
    return status_bytes("VmHWM", pid)


def job_resident(worker_peaks: list[int | None]) -> dict[str, Any]:
    """The job's resident peaks on this machine: ``workers`` (``worker_peaks``, by rank),
    ``launcher`` and ``agent`` (None when there is none or it cannot be read) and ``total``
    (the sum of what was read). Reads /proc of the launcher and of this process's parent."""
    launcher_pid = os.environ.get(LAUNCHER_PID_ENV, "")
    launcher = resident_peak(int(launcher_pid)) if launcher_pid.isdigit() else None
    parent = os.getppid()
    agent = resident_peak(parent) if launcher_pid.isdigit() and parent != int(launcher_pid) else None
    total = sum(v for v in [*worker_peaks, launcher, agent] if v is not None)
    return {"workers": list(worker_peaks), "launcher": launcher, "agent": agent, "total": total}
