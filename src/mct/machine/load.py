"""What else ran on this machine while it was measured.

A measurement's rates are only this machine's when nothing else competed for its cores:
the profile ``make train`` measured right after another heavy job predicted held-out steps
+12% to +404% off (median +222%), the same profile measured on the quiet machine within
-3% to +35%. ``LoadWatch`` reads the busy CPU time of the cores this process may run on
(``/proc/stat``'s per-CPU lines, user + nice + system + irq + softirq + steal) before and
after, subtracts this process's own CPU time (its threads, and its children that were
waited for: the ranks a measurement spawns), and divides by the wall time: the cores other
processes kept busy on average. Where ``/proc/stat`` cannot be read (not Linux) the load is
unknown, never a failure.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUSY_CORES = 0.25
"""Other processes' average busy cores above which a measurement counts as made under load.
On the 2-core machine an idle desktop session kept 0.02-0.05 cores busy; one `make test`
worker beside a calibration keeps about 1."""

BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
"""The ``/proc/stat`` columns that count a core as busy: user, nice, system, irq, softirq,
steal (a virtual machine's core another guest ran on). Idle and iowait are not busy."""


@dataclass(frozen=True)
class Load:
    """What competed with a measurement: ``other_cores`` the cores other processes kept busy
    on average (None: unknown), ``cores`` the cores this process may use, ``loadavg`` the
    1-minute load average at the end (None: unknown), ``seconds`` the wall time watched."""

    other_cores: float | None
    cores: int
    loadavg: float | None
    seconds: float

    @property
    def busy(self) -> bool:
        """Did other processes keep more than ``BUSY_CORES`` busy (False when unknown)?"""
        return self.other_cores is not None and self.other_cores > BUSY_CORES

    def describe(self) -> str:
        """'quiet (other processes used 0.03 of 2 cores)', 'under load (... 1.21 of 2 cores)',
        or 'load not recorded'."""
        if self.other_cores is None:
            return "load not recorded"
        return (f"{'under load' if self.busy else 'quiet'} (other processes used "
                f"{self.other_cores:.2f} of {self.cores} cores)")

    def to_dict(self) -> dict[str, Any]:
        return {"other_cores": self.other_cores, "cores": self.cores, "loadavg": self.loadavg,
                "seconds": self.seconds}

    @classmethod
    def from_dict(cls, d: Any) -> "Load":
        """The load ``to_dict`` wrote. Raises ValueError naming the field that is not what it
        should be (a damaged cache entry: measured again)."""
        if not isinstance(d, dict):
            raise ValueError(f"load is a {type(d).__name__}, not an object")
        for name in ("other_cores", "loadavg"):
            if d.get(name) is not None and not _number(d[name]):
                raise ValueError(f"load.{name} is {d[name]!r}, not a number >= 0")
        if not (isinstance(d.get("cores"), int) and not isinstance(d["cores"], bool) and d["cores"] >= 1):
            raise ValueError(f"load.cores is {d.get('cores')!r}, not an integer >= 1")
        if not _number(d.get("seconds")):
            raise ValueError(f"load.seconds is {d.get('seconds')!r}, not a number >= 0")
        return cls(d.get("other_cores"), d["cores"], d.get("loadavg"), float(d["seconds"]))


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def busy_cpu_seconds(cpus: set[int] | None = None, stat: Path = Path("/proc/stat")) -> float | None:
    """Seconds of busy CPU time (``BUSY_FIELDS``) since boot summed over ``cpus`` (default the
    cores this process may run on), from ``stat``; None when it cannot be read."""
    try:
        text = stat.read_text()
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    cpus = _allowed_cpus() if cpus is None else cpus
    total, seen = 0, False
    for line in text.splitlines():
        name, *fields = line.split()
        if not (name.startswith("cpu") and name[3:].isdigit()) or int(name[3:]) not in cpus:
            continue
        try:
            total += sum(int(fields[i]) for i in BUSY_FIELDS if i < len(fields))
        except ValueError:
            return None
        seen = True
    return total / tick if seen and tick > 0 else None


def _allowed_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def _own_cpu_seconds() -> float:
    """This process's CPU time (every thread) and its waited-for children's."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class LoadWatch:
    """``with LoadWatch() as w: measure()`` then ``w.load()``: what other processes used of
    this process's cores meanwhile (``Load``). Mutates nothing."""

    def __init__(self, stat: Path = Path("/proc/stat")) -> None:
        self.stat, self.cpus = stat, _allowed_cpus()
        self.start: tuple[float | None, float, float] | None = None
        self.end: tuple[float | None, float, float] | None = None

    def _now(self) -> tuple[float | None, float, float]:
        return busy_cpu_seconds(self.cpus, self.stat), _own_cpu_seconds(), time.perf_counter()

    def __enter__(self) -> "LoadWatch":
        self.start, self.end = self._now(), None
        return self

    def __exit__(self, *exc: Any) -> None:
        self.end = self._now()

    def load(self) -> Load:
        """The load over the watched span (up to now while still inside the ``with``)."""
        assert self.start is not None, "LoadWatch.load() before the watch started"
        (busy0, own0, t0), (busy1, own1, t1) = self.start, self.end or self._now()
        wall = max(t1 - t0, 1e-9)
        other = None if busy0 is None or busy1 is None else max(0.0, (busy1 - busy0 - (own1 - own0)) / wall)
        try:
            avg: float | None = os.getloadavg()[0]
        except (AttributeError, OSError):
            avg = None
        return Load(None if other is None else round(other, 3), len(self.cpus), avg, round(wall, 3))


QUIET_SAMPLE_S = 0.5
"""Seconds ``quiet_now`` watches: long enough for /proc/stat's 10 ms ticks to count a busy core."""


def quiet_now(seconds: float = QUIET_SAMPLE_S) -> bool:
    """Is the machine quiet now: other processes kept at most ``BUSY_CORES`` busy while this
    one slept ``seconds`` (False when unknown)? Mutates nothing."""
    with LoadWatch() as watch:
        time.sleep(seconds)
    load = watch.load()
    return load.other_cores is not None and not load.busy
