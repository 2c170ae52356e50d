"""``auto`` solved once per run: the launcher of ``mct train --nproc N`` on one machine
solves it (its check that the budget can be met at all) and hands the answer to its
workers in the environment (``RESOLVED_ENV``); a run with no such launcher (one process),
or with one per machine (``--nnodes``: each checks alone, and their answers could differ),
has rank 0 solve and broadcast. No other rank solves: every rank trains the one
answer, recorded in metadata.json's ``plan`` with who solved it (``solved_by``) and why.
"""

from __future__ import annotations

import json
import os
from typing import Any

from mct.config import EngineConfig
from mct.dist import DistContext, agree, broadcast_from_main, error_of
from mct.planner import resolve_auto
from mct.task import Task

RESOLVED_ENV = "MCT_RESOLVED"
"""The launcher's answer for its workers: JSON {"asked": config, "world": N, "config":
resolved config, "plan": the choice record} (set by the launcher, never by a user)."""


def solve_in_launcher(cfg: EngineConfig, world: int, task: Task, device: str) -> dict[str, str]:
    """Solve ``auto`` of ``cfg`` for ``world`` ranks (ValueError, one line, when nothing
    fits: before any worker starts) and return the environment that hands the answer to
    the workers ({} when nothing is 'auto')."""
    if cfg.zero.stage != "auto" and cfg.checkpointing.policy != "auto":
        return {}
    resolved, choice = resolve_auto(cfg, world, task, device=device)
    assert choice is not None
    choice = {**choice, "solved_by": "launcher"}
    return {RESOLVED_ENV: json.dumps({"asked": cfg.to_dict(), "world": world, "device": device,
                                      "config": resolved.to_dict(), "plan": choice})}


def _from_launcher(cfg: EngineConfig, world: int, device: str) -> tuple[EngineConfig, dict[str, Any]] | None:
    """The launcher's answer for ``cfg`` on ``world`` ranks of ``device``, or None when there
    is none or it was for another config, world size or device (a stale variable is never
    trusted)."""
    text = os.environ.get(RESOLVED_ENV)
    if not text:
        return None
    try:
        got = json.loads(text)
        if got.get("asked") != json.loads(json.dumps(cfg.to_dict())) or got.get("world") != world \
                or got.get("device") != device:
            return None
        return EngineConfig.from_dict(got["config"]), dict(got["plan"])
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def resolve_once(cfg: EngineConfig, task: Task, ctx: DistContext) -> tuple[EngineConfig, dict[str, Any] | None]:
    """(``cfg`` with 'auto' resolved, the choice record or None when nothing was 'auto') on
    every rank alike: the launcher's answer when it gave one, else rank 0 solves and
    broadcasts it. Collective (every rank calls it). Raises ValueError on every rank when
    rank 0's solve fails (no budget, nothing fits)."""
    if cfg.zero.stage != "auto" and cfg.checkpointing.policy != "auto":
        return cfg, None
    handed = _from_launcher(cfg, ctx.world_size, ctx.device.type)
    if handed is not None:
        return handed
    answer: list[Any] = [None]

    def solve() -> None:
        resolved, choice = resolve_auto(cfg, ctx.world_size, task, device=ctx.device.type)
        answer[0] = (resolved.to_dict(), {**(choice or {}), "solved_by": "rank 0"})
    agree(error_of(solve) if ctx.is_main else None)
    config, choice = broadcast_from_main(answer[0])
    return EngineConfig.from_dict(config), choice
