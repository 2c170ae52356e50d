"""What the launcher says when workers die without a line of their own: a worker killed from
outside (``lost_worker_line``: SIGKILL, the out-of-memory killer, named from the local agent's
log or torchrun's report) and a worker that died in native code (``crash_report``: its
``faulthandler`` file, the Python stack and one line naming it)."""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

RUN_DIR_FILE = "run_dir"
"""In the launch directory: the run's directory, as rank 0's command line names it."""

_REPORTED = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")
"""A failure in torchrun's report (its ChildFailedError block): the global rank, then its exit code."""


_AGENT_KILLED = re.compile(r"worker rank (\d+) \(restart (\d+)\) was killed by (SIG[A-Z0-9]+)")
"""A worker the local agent (``mct.run.agent``) saw killed by a signal: rank, restart, signal name."""


def _killed_ranks(d: Path, last: int) -> list[tuple[int, int]]:
    """(rank, signal) of the workers killed by a signal in the last attempt: from the local
    agent's ``agent.log`` (one machine) or torchrun's report (several; the root cause first)."""
    found: list[tuple[int, int]] = []
    try:
        for rank, restart, name in _AGENT_KILLED.findall((d / "agent.log").read_text(errors="replace")):
            if int(restart) == last and hasattr(signal, name):
                found.append((int(rank), int(getattr(signal, name))))
    except OSError:
        pass
    try:
        text = (d / "torchrun.log").read_text(errors="replace")
    except OSError:
        return found
    return found + [(int(r), -int(c)) for r, c in _REPORTED.findall(text[text.find("Root Cause"):] + text)
                    if int(c) < 0]


def lost_worker_line(d: Path, records: list[dict[str, Any]]) -> str:
    """One line for a worker that the agent (or torchrun) reports killed by a signal that it
    did not handle and left no exit record (SIGKILL: ``kill -9``, the out-of-memory killer),
    naming its rank, the checkpoint a resume starts from and the resume command. Empty
    when no such worker is reported. A SIGTERM is the agent's own stop of the survivors,
    so another signal is named first."""
    last = max((r["restart"] for r in records), default=0)
    spoke = {r["rank"] for r in records if r["restart"] == last}
    found = [(rank, sig) for rank, sig in _killed_ranks(d, last) if rank not in spoke]
    found.sort(key=lambda f: f[1] == signal.SIGTERM)  # stable: the root cause first among equals
    if not found:
        return ""
    rank, signum = found[0]
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    try:
        run_dir = (d / RUN_DIR_FILE).read_text()
    except OSError:
        return (f"mct: error: worker rank {rank} was killed by {name} (it printed nothing: kill -9 or the "
                f"out-of-memory killer) before the run began; the other ranks stopped")
    from mct.persistence.run_dir import resume_candidate
    pick = resume_candidate(run_dir)
    where = (f"the last good checkpoint is {pick}; continue with: mct train --resume {run_dir}" if pick else
             "no checkpoint was written yet (train.checkpoint_every); start the run again in a new --run-dir")
    return (f"mct: error: worker rank {rank} was killed by {name} (it printed nothing: kill -9 or the "
            f"out-of-memory killer); the other ranks stopped; {where}")


def crash_report(d: Path) -> str:
    """What the workers that died in native code left (``fault.RESTART.RANK``, written by
    faulthandler): for each, the crashing thread's Python stack (and, when that thread runs
    no Python, e.g. a library's own thread, every other thread's), then one line naming the
    rank, the error and the innermost frame. Empty when no worker crashed."""
    out = []
    for f in sorted(d.glob("fault.*"), key=lambda f: tuple(int(x) for x in f.name.split(".")[1:3])):
        try:
            text = f.read_text(errors="replace")
        except OSError:
            continue
        if not text.strip():
            continue
        restart, rank = f.name.split(".")[1:3]
        lines = text.splitlines()
        error = next((x.strip() for x in lines if x.startswith("Fatal Python error")), "a fatal signal")
        blocks = _thread_blocks(lines)
        current = next((b for b in blocks if b[0].startswith(("Current thread", "Stack (most recent"))), [])
        frames = [x for x in current[1:] if x.strip().startswith("File ")]
        if frames:
            where, shown = frames[0].strip(), [current]
        else:
            where = "a thread that runs no Python (another library's own thread)"
            shown = [b for b in blocks if any(x.strip().startswith("File ") for x in b[1:])] + [current]
        attempt = f" (restart {restart})" if restart != "0" else ""
        out.extend("\n".join(b) + "\n" for b in shown if b)
        out.append(f"mct: worker rank {rank}{attempt} died in native code ({error}) at {where}; "
                   f"its Python stack is above\n")
    return "".join(out)


def _thread_blocks(lines: list[str]) -> list[list[str]]:
    """faulthandler's blocks, one per thread: a header line, then its indented frames."""
    blocks: list[list[str]] = []
    open_block: list[str] | None = None
    for x in lines:
        if x.startswith(("Current thread", "Thread 0x", "Stack (most recent")):
            open_block = [x]
            blocks.append(open_block)
        elif open_block is not None and x.startswith("  "):
            open_block.append(x)
        else:  # a blank line or the next section ends the block
            open_block = None
    return blocks
