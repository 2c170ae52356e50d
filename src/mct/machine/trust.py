"""A machine profile checked against reality: what a run's steps say about it.

Every run records its predicted step time beside the measured one. When the steady
measured step (the median after the first) is off the prediction by more than the time
model's stated error (``STATED_ERROR``, either way), or the model FLOP/s exceed the
profile's matmul peak (MFU above 100%), the run says so in one line naming the profile and
the fix, and marks the cached profile suspect (``mct.machine.cache.mark_suspect``): the
next command that measures (`mct plan`, `mct train`'s rank 0) measures it again, with a line
first (`auto` inside a run measures nothing and says it ranks by a suspect profile). Not marked: a pinned profile (written by hand; only `mct calibrate --force` replaces
it), and one measured on a quiet machine when the disagreement is explained otherwise (the
run itself shared the machine, or both were quiet: then the time model, not the profile, is
off for this configuration, and measuring again would change nothing).
"""

from __future__ import annotations

from pathlib import Path

from mct.machine.cache import mark_suspect
from mct.machine.load import Load
from mct.machine.passes import measured_line
from mct.machine.profile import MachineProfile

STATED_ERROR = 1.5
"""The time model's stated error: a run's median step within [1/1.5, 1.5] x its prediction
(docs/planner.md, "Accuracy on CPU": median 6%, worst 35% on the quiet 2-core machine)."""

MIN_STEADY_STEPS = 3
"""Timed steps after the first that a run needs before its median says anything."""


def disagreement(measured_s: float | None, predicted_s: float | None) -> float | None:
    """measured / predicted when it lies outside ``STATED_ERROR`` either way, else None (also
    when either is missing or not positive)."""
    if not measured_s or not predicted_s or measured_s <= 0 or predicted_s <= 0:
        return None
    ratio = measured_s / predicted_s
    return ratio if ratio > STATED_ERROR or ratio < 1 / STATED_ERROR else None


def check_run(profile: MachineProfile, measured_s: float | None, predicted_s: float | None, steady_steps: int,
              over_peak: bool = False, run_load: Load | None = None, *, path: Path | None = None) -> str | None:
    """The one line a run prints when its steps disagree with ``profile`` (``disagreement``;
    at least ``MIN_STEADY_STEPS`` steady steps) or its MFU was above 100% (``over_peak``);
    None when they agree. Marks the cached profile suspect (the cache file ``path``, default
    ``cache_file()``) unless the module docstring's exceptions hold; ``run_load``: what other
    processes used of the cores during the run's steps (None: unknown)."""
    ratio = disagreement(measured_s, predicted_s) if steady_steps >= MIN_STEADY_STEPS else None
    if ratio is None and not over_peak:
        return None
    what = (f"steps took {ratio:.2f}x the predicted {predicted_s:.3g} s (the time model's stated error is "
            f"{STATED_ERROR}x either way)" if ratio is not None else "model FLOP/s exceeded the profile's matmul peak")
    name = f"the machine profile '{profile.key}' ({measured_line(profile)})"
    quiet_profile = bool(profile.load) and not profile.load_busy and profile.load.get("other_cores") is not None
    if profile.pinned:
        return f"{what}: {name} is pinned, not marked; mct calibrate --force replaces it"
    if quiet_profile and not over_peak and run_load is not None and run_load.other_cores is not None:
        if run_load.busy:
            return (f"{what}, but the run shared the machine ({run_load.describe()}) and {name} was measured "
                    f"quiet: not marked suspect; compare on a quiet machine")
        return (f"{what}; {name} was measured quiet, as were these steps: the time model is off for this "
                f"configuration (docs/planner.md, 'Time model'), not marked suspect; mct calibrate --force if the "
                f"machine changed")
    reason = what.split(" (")[0] + (f" in a run, {run_load.describe()}" if run_load is not None else " in a run")
    warning = mark_suspect(profile.key, reason, path=path)
    fix = "the next `mct plan` or `mct train` measures it again; now: mct calibrate --force"
    return f"{what}: {name} is marked suspect; {fix}" + (f" ({warning})" if warning else "")
