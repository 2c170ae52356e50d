"""``RUN_DIR/events.jsonl``: what the feedback loops and the launcher did, one JSON
object a line, appended by global rank 0 only (a run dir may be shared by machines):

    {"time": "<ISO 8601 UTC>", "step": S, "kind": K, "action": A, "reason": "..."}

K is one of ``rollback``, ``skip_window``, ``lr_cut``, ``stop``, ``budget_fallback``,
``restart``, ``resume``, ``signal``; A says what was done (``replay``, ``skip``,
``restore step 40``, ...).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

EVENT_KINDS = ("rollback", "skip_window", "lr_cut", "stop", "budget_fallback", "restart", "resume", "signal")


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def append_event(run_dir: str | Path, *, step: int, kind: str, action: str, reason: str,
                 is_main: bool = True, **extra: Any) -> dict[str, Any] | None:
    """Append one event (only when ``is_main``); returns the record written, else None.
    The line is flushed and fsynced: events matter most just before a process dies."""
    assert kind in EVENT_KINDS, kind
    if not is_main:
        return None
    record = {"time": utc_now(), "step": int(step), "kind": kind, "action": action, "reason": reason, **extra}
    path = Path(run_dir) / "events.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return record


def read_events(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every event of a run dir, in order ([] when there is none)."""
    path = Path(run_dir) / "events.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
