"""A measurement that load cannot fool: whole passes over every quantity, watched.

``measure_watched`` measures the machine once while ``LoadWatch`` watches what other
processes use of its cores. A quiet pass is the profile. A pass under load is followed by
another (at most ``MAX_PASSES``), each measuring every quantity again, so each quantity's
samples are spread over the whole span, interleaved with the others' (A B C ... A B C),
rather than taken back to back where one burst of load hits all of them; each rate is then
the best of its passes (a loaded machine only ever slows a kernel down), and what is not a
rate (a cost beyond a plain dispatch, a speed-up of every core over one) is the quietest
pass's. The profile records the load (``MachineProfile.load``): the quietest pass's, with the
number of passes; still busy after the last pass, it is recorded as measured under load, and
one line says so.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from mct.machine.load import BUSY_CORES, Load, LoadWatch
from mct.machine.profile import MachineProfile

MAX_PASSES = 3
"""Passes at most (a quiet machine: one). On the 2-core machine a pass takes about 14 s."""

RATES = {"matmul_one", "matmul_all", "memcpy_bytes_per_s", "matmul_by_dim", "elementwise_curve",
         "elementwise_by_dtype", "elementwise_by_kind", "attention_by_dim", "copy_all_bytes_per_s",
         "disk_bytes_per_s", "host_bytes_per_s", "random_elements_per_s"}
"""The profile's fields (top level or in ``extra``) that are rates, higher when nothing
competes: the best of the passes. Every other measured field is the quietest pass's."""


def measure_watched(measure: Callable[[], MachineProfile], say: Callable[[str], None] | None = None,
                    passes: int | None = None) -> MachineProfile:
    """``measure()`` (one whole pass) under a ``LoadWatch``, again while a pass was made
    under load, up to ``passes`` (default ``MAX_PASSES``); the passes combined
    (``combine``) with ``load`` recorded. ``say`` gets one line before each extra pass and
    one when the last is still under load. Raises what ``measure`` raises."""
    done: list[tuple[MachineProfile, Load]] = []
    limit = max(1, passes or MAX_PASSES)
    for i in range(limit):
        with LoadWatch() as watch:
            profile = measure()
        done.append((profile, watch.load()))
        if not done[-1][1].busy:
            break
        if say and i + 1 < limit:
            load = done[-1][1]
            say(f"warning: the machine was busy while it was measured (other processes used {load.other_cores:.2f} of "
                f"{load.cores} cores): measuring again, pass {i + 2} of {limit}, each rate the best of the passes")
    profile = combine(done)
    if profile.load_busy and say:
        say(f"warning: the machine profile was measured under load ({profile.load['other_cores']:.2f} of "
            f"{profile.load['cores']} cores used by other processes in the quietest of {len(done)} pass(es)): "
            f"its rates may be slow; recorded as such (mct calibrate --force on a quiet machine measures again)")
    return dataclasses.replace(profile, seconds=round(sum(p.seconds for p, _ in done), 3))  # every pass's


def combine(done: list[tuple[MachineProfile, Load]]) -> MachineProfile:
    """One profile from passes over the same machine: each rate (``RATES``) the best of the
    passes, everything else the quietest pass's, ``load`` the quietest pass's with
    ``passes`` the number of passes. ``done``: at least one (profile, load)."""
    assert done, "combine() of no passes"
    quiet_profile, quiet_load = min(done, key=lambda pl: pl[1].other_cores or 0.0)
    base = quiet_profile.to_dict()
    others = [p.to_dict() for p, _ in done]
    for name in RATES:
        if name in base:
            base[name] = _best(base[name], [o.get(name) for o in others])
        elif name in base["extra"]:
            base["extra"][name] = _best(base["extra"][name], [o["extra"].get(name) for o in others])
    base["load"] = {**quiet_load.to_dict(), "passes": len(done)}
    return MachineProfile.from_dict(base)


def _best(mine: Any, theirs: list[Any]) -> Any:
    """``mine`` with each rate raised to the best of ``theirs`` at the same place: numbers the
    largest, ``[[size, rate], ...]`` curves pointwise at equal sizes, objects key by key.
    A place another pass lacks or shapes differently keeps ``mine``."""
    if isinstance(mine, bool):
        return mine
    if isinstance(mine, (int, float)):
        return max([mine, *(t for t in theirs if isinstance(t, (int, float)) and not isinstance(t, bool))])
    if isinstance(mine, dict):
        return {k: _best(v, [t.get(k) for t in theirs if isinstance(t, dict)]) for k, v in mine.items()}
    if isinstance(mine, list) and all(isinstance(pt, list) and len(pt) == 2 for pt in mine):
        return [[size, _best(rate, [dict(map(tuple, t)).get(size) for t in theirs if _is_curve(t)])]
                for size, rate in mine]
    return mine


def _is_curve(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(pt, list) and len(pt) == 2 for pt in x)


def measured_line(profile: MachineProfile) -> str:
    """When and under what load ``profile`` was measured, in one line: 'measured
    2026-12-04T23:01:12Z in 14.4 s, quiet (other processes used 0.04 of 2 cores), 1 pass';
    '; suspect: WHY' when a run marked it, '; pinned' when it is pinned."""
    when = f"measured {profile.measured_at or '(time not recorded)'}"
    if profile.seconds:
        when += f" in {profile.seconds:.1f} s"
    if profile.load:
        load = Load.from_dict(profile.load)
        passes = profile.load.get("passes", 1)
        when += f", {load.describe()}, {passes} pass{'es' if passes != 1 else ''}"
    else:
        when += ", load not recorded"
    busy = sorted(k for k, v in (profile.extra.get("overhead_load") or {}).items()
                  if isinstance(v, dict) and isinstance(v.get("other_cores"), (int, float))
                  and v["other_cores"] > BUSY_CORES)
    if busy:
        when += f"; per-op overheads at {', '.join(busy)} measured under load"
    if profile.pinned:
        when += "; pinned"
    if profile.suspect:
        when += f"; suspect: {profile.suspect}"
    return when
