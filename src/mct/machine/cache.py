"""The machine-profile cache: one JSON file of profiles by key, measured on first use.

The file is ``$MCT_CACHE_DIR/machine.json``, else ``$XDG_CACHE_HOME/mct/machine.json``,
else ``~/.cache/mct/machine.json``. It holds ``{"version": 1, "profiles": {key:
profile}}``; a key names what the rates depend on (CPU model and flags or the CUDA
device, torch version, thread count), so one file serves every machine sharing a home
directory. A file or entry that cannot be read (truncated, not JSON, another version)
counts as absent: the profile is measured again and the file rewritten, never a
traceback. A cache that cannot be written costs a warning, not the run.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from mct.machine.load import quiet_now
from mct.machine.passes import MAX_PASSES, measure_watched, measured_line
from mct.machine.profile import MachineProfile, current_key, format_rate, measure_profile

CACHE_ENV = "MCT_CACHE_DIR"
FILE_VERSION = 1
FIRST_MEASUREMENT_S = 15
"""What one pass of a first measurement takes on the 2-core machine, quiet (said before it starts)."""


@dataclass(frozen=True)
class Calibration:
    """A profile and where it came from: ``source`` 'cache' or 'measured'; ``path`` the
    cache file; ``warning``: why the file was not read or not written (None when fine)."""

    profile: MachineProfile
    source: str
    path: Path
    warning: str | None = None


def cache_file() -> Path:
    """Where profiles are cached (see the module docstring)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]) / "machine.json"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mct" / "machine.json"


def calibrate(device: str = "cpu", *, force: bool = False, path: Path | None = None,
              say: Callable[[str], None] | None = None) -> Calibration:
    """This machine's profile for ``device`` ('cpu' | 'cuda'): from the cache file
    (``path``, default ``cache_file()``) when it holds a sound one for this key and ``force``
    is off, else measured now (``mct.machine.passes.measure_watched``: a quiet machine
    about 15 s on 2 cores, a busy one up to three passes) and written there. A profile a run
    marked suspect (``mark_suspect``) is measured again, as is one measured under load when the
    machine is quiet now (``quiet_now``: half a second watched). Before any measurement one line goes
    to ``say`` (default: stderr) saying why (first use, a damaged or unreadable file, a cache
    path that is not a directory, a suspect profile) and that it is measuring: never minutes
    of silence. Raises ValueError only for a device that cannot be measured (``measure_profile``)."""
    path = path or cache_file()
    problem = _not_a_directory(path)
    entries, warning = ({}, problem) if problem else _read(path)
    key = current_key(device)
    why = f"warning: {warning}" if warning else ("forced (mct calibrate --force)" if force else
                                                 f"first use: no profile of this machine in {path}")
    if not force and key in entries:
        try:
            profile = MachineProfile.from_dict(entries[key])
        except ValueError as e:
            why = f"warning: {path}: {e}"
        else:
            if profile.pinned or not (profile.suspect or (profile.load_busy and quiet_now())):
                return Calibration(profile, "cache", path)
            when = profile.measured_at or "(time not recorded)"
            why = (f"warning: the machine profile measured {when} is suspect ({profile.suspect})" if profile.suspect
                   else f"warning: the machine profile was measured {when} under load ({profile.load['other_cores']:.2f} "
                        f"of {profile.load['cores']} cores used by other processes) and the machine is quiet now")
    say = say or say_line
    say(f"{why}; measuring this machine now, {_estimate(entries.get(key))}")
    profile = measure_watched(lambda: measure_profile(device), say)
    if problem:  # already said: the profile serves this command only
        return Calibration(profile, "measured", path)
    entries[profile.key] = profile.to_dict()
    try:
        _write(path, entries)
    except OSError as e:
        return Calibration(profile, "measured", path,
                           f"{path} not written ({e.strerror or e}); set {CACHE_ENV} to a writable directory")
    return Calibration(profile, "measured", path)


def mark_suspect(key: str, reason: str, *, path: Path | None = None) -> str | None:
    """Mark the cached profile ``key`` suspect for ``reason`` (the next ``calibrate`` measures
    it again). Mutates the cache file (atomically); a pinned profile, or one the file no
    longer holds, is left alone. Returns why the file was not written (None when fine or
    nothing to do)."""
    path = path or cache_file()
    entries, _ = _read(path)
    entry = entries.get(key)
    if not isinstance(entry, dict) or entry.get("pinned") is True:
        return None
    entries[key] = {**entry, "suspect": reason}
    try:
        _write(path, entries)
    except OSError as e:
        return f"{path} not written ({e.strerror or e}); set {CACHE_ENV} to a writable directory"
    return None


def say_line(line: str) -> None:
    """Print ``line`` as one ``mct: ...`` line to stderr now (a progress line before a
    measurement, or a warning), flushed: stdout may be a `--json` document."""
    print(f"mct: {line}", file=sys.stderr, flush=True)


def _estimate(entry: Any) -> str:
    """'about 15 s (...)': one pass of the last measurement of this key (``entry``, a cached
    profile, maybe damaged), else ``FIRST_MEASUREMENT_S``; a busy machine takes up to
    ``MAX_PASSES`` times that."""
    try:
        last = MachineProfile.from_dict(entry)
        each = last.seconds / max(1, last.load.get("passes", 1))
    except ValueError:
        each = 0.0
    return f"about {each or FIRST_MEASUREMENT_S:.0f} s (up to {MAX_PASSES}x that on a busy machine)"


def _not_a_directory(path: Path) -> str | None:
    """One line when the cache file's folder (or one above it) exists but is not a directory,
    or the file's own place is a directory: the profile cannot be cached there."""
    fix = f"the profile is not cached; set {CACHE_ENV} to a directory"
    if path.is_dir():
        return f"{path} is a directory, not the profile cache file: {fix}"
    for parent in path.parents:
        if parent.is_dir():
            return None
        if parent.exists() or parent.is_symlink():
            named = f" ({CACHE_ENV})" if os.environ.get(CACHE_ENV) and Path(os.environ[CACHE_ENV]) == parent else ""
            return f"{parent}{named} is not a directory: {fix}"
    return None


def cached(device: str = "cpu", *, path: Path | None = None) -> MachineProfile | None:
    """This machine's cached profile for ``device``, or None: never measures (for a
    training rank, where a measurement would compete with the other ranks)."""
    entries, _ = _read(path or cache_file())
    try:
        entry = entries.get(current_key(device))
        return MachineProfile.from_dict(entry) if entry is not None else None
    except ValueError:
        return None


def remember(profile: MachineProfile, name: str, value: object, *, path: Path | None = None
             ) -> tuple[MachineProfile, str | None]:
    """``profile`` with ``extra[name]`` merged with ``value`` (a dict: its keys added to
    what is there), written back to the cache file (``path``, default ``cache_file()``)
    under the profile's key: a rate measured on first use (collectives at a world size,
    the per-op overhead) is measured once. Returns the new profile and a warning when the
    file could not be written (None when fine)."""
    path = path or cache_file()
    merged = {**profile.extra.get(name, {}), **value} if isinstance(value, dict) else value
    new = MachineProfile.from_dict({**profile.to_dict(), "extra": {**profile.extra, name: merged}})
    if _not_a_directory(path):  # said once, before the profile was measured
        return new, None
    entries, _ = _read(path)
    entries[new.key] = new.to_dict()
    try:
        _write(path, entries)
    except OSError as e:
        return new, f"{path} not written ({e.strerror or e}); set {CACHE_ENV} to a writable directory"
    return new, None


def _extra_lines(extra: dict) -> list[str]:
    """The time model's rates a profile holds (``MachineProfile.extra``), one line each."""
    lines = []
    if extra.get("copy_all_bytes_per_s"):
        lines.append(f"copy (every thread): {extra['copy_all_bytes_per_s'] / 1e9:.2f} GB/s")
    if extra.get("disk_bytes_per_s"):
        lines.append(f"disk write: {extra['disk_bytes_per_s'] / 1e9:.2f} GB/s")
    for dtype, curve in (extra.get("matmul_by_dim") or {}).items():
        lines.append(f"matmul {dtype} 1 thread by smallest dimension: " + ", ".join(
            f"{int(d)}: {format_rate(r)}" for d, r in curve))
    if extra.get("elementwise_curve"):
        lines.append("elementwise 1 thread by bytes an op moves: " + ", ".join(
            f"{b / 2**20:.2g} MiB: {r / 1e9:.1f} GB/s" for b, r in extra["elementwise_curve"]))
    for dtype, curve in (extra.get("elementwise_by_dtype") or {}).items():
        lines.append(f"elementwise {dtype} 1 thread by bytes an op moves: " + ", ".join(
            f"{b / 2**20:.2g} MiB: {r / 1e9:.1f} GB/s" for b, r in curve))
    for kind, curves in (extra.get("elementwise_by_kind") or {}).items():
        lines.append(f"elementwise {kind} 1 thread by bytes an op moves: " + "; ".join(
            f"{dtype} " + ", ".join(f"{b / 2**20:.2g} MiB: {r / 1e9:.1f} GB/s" for b, r in curve)
            for dtype, curve in curves.items()))
    for dtype, phases in (extra.get("attention_by_dim") or {}).items():
        lines.append(f"attention {dtype} 1 thread by head width: " + "; ".join(
            f"{phase} " + ", ".join(f"{int(d)}: {format_rate(r)}" for d, r in curve) for phase, curve in phases.items()))
    if extra.get("elementwise_speedup"):
        lines.append("elementwise every thread over 1 thread by bytes an op moves: " + ", ".join(
            f"{b / 2**20:.2g} MiB: {x:.2f}x" for b, x in extra["elementwise_speedup"]))
    if extra.get("matmul_speedup"):
        lines.append("matmul fp32 every thread over 1 thread by FLOPs: " + ", ".join(
            f"{f:.2g}: {x:.2f}x" for f, x in extra["matmul_speedup"]))
    if extra.get("python_mode_op_s"):
        lines.append(f"an op through mct's Python dispatch mode (bf16/fp16 matmuls on fp32 kernels): "
                     f"+{extra['python_mode_op_s'] * 1e6:.1f} us")
    if extra.get("tracker_op_s"):
        lines.append(f"an op through the memory tracker (steps that track memory): "
                     f"+{extra['tracker_op_s'] * 1e6:.1f} us")
    if extra.get("selective_mode_op_s"):
        lines.append(f"an op through torch's selective-checkpoint modes (forward and recompute of a 'selective' "
                     f"region): +{extra['selective_mode_op_s'] * 1e6:.1f} us")
    if extra.get("random_elements_per_s"):
        lines.append(f"random numbers (bernoulli_, 1 thread): {extra['random_elements_per_s'] / 1e6:.0f} M elements/s")
    if extra.get("op_overhead_s"):
        lines.append("per-op overhead: " + ", ".join(f"{1e6 * s:.1f} us at {_overhead_where(t)}"
                                                      for t, s in sorted(extra["op_overhead_s"].items())))
    if extra.get("byte_overhead_s"):
        lines.append("per-byte cost inside a step (beyond the rates above): " + ", ".join(
            f"{1e12 * s:.0f} ps/B at {_overhead_where(t)}" for t, s in sorted(extra["byte_overhead_s"].items())))
    if extra.get("collective_wait_s"):
        lines.append("wait at each collective call of a step: " + ", ".join(
            f"{1e6 * s:.1f} us at {_overhead_where(t)}" for t, s in sorted(extra["collective_wait_s"].items())))
    for key, kinds in sorted((extra.get("collectives") or {}).items()):
        lines.append(f"collectives {key}: " + ", ".join(
            f"{k} {1e6 * lat:.0f} us + {bw / 1e9:.2f} GB/s" for k, (lat, bw) in kinds.items()))
    return lines


def _overhead_where(key: str) -> str:
    """'2 thread(s)' for an ``op_overhead_s`` key '2', '1 thread(s) x 2 ranks at once' for '1x2'."""
    threads, _, ranks = key.partition("x")
    return f"{threads} thread(s)" + (f" x {ranks} ranks at once" if ranks else "")


def _read(path: Path) -> tuple[dict, str | None]:
    """The file's profiles by key ({} when absent or damaged) and why it was not read."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}, None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return {}, f"{path} not read ({e})"
    if not isinstance(data, dict) or data.get("version") != FILE_VERSION or not isinstance(data.get("profiles"), dict):
        return {}, f"{path} is not a version-{FILE_VERSION} profile cache"
    return dict(data["profiles"]), None


def _write(path: Path, entries: dict) -> None:
    """Write atomically (a temporary file renamed over ``path``): a reader never sees
    half a file, and two processes racing leave one whole file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"version": FILE_VERSION, "profiles": entries}, indent=1) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def calibration_table(cal: Calibration) -> str:
    """What ``mct calibrate`` prints: the machine, where the profile came from, the
    matmul rates per dtype and the copy bandwidth."""
    p = cal.profile
    problem = _not_a_directory(cal.path)
    kept = f"not cached ({problem})" if problem else f"cached in {cal.path}"
    where = (f"measured now in {p.seconds:.1f} s, {kept} ({measured_line(p)})"
             if cal.source == "measured" else f"cached in {cal.path} ({measured_line(p)}; --force measures again)")
    lines = [f"machine  {p.name} ({' '.join(p.flags) or '-'}), torch {p.torch_version}", f"profile  {where}"]
    if p.device == "cuda":
        heads, cells = ["matmul (device)"], lambda d: [p.matmul_one[d]]
    else:
        heads = ["matmul 1 thread", f"matmul {p.threads} threads"]
        cells = lambda d: [p.matmul_one[d], p.matmul_all.get(d, float("nan"))]
    lines.append(f"{'dtype':<6}" + "".join(f"{h:>20}" for h in heads) + f"{'size':>7}")
    for d in p.matmul_one:
        lines.append(f"{d:<6}" + "".join(f"{format_rate(v):>20}" for v in cells(d)) + f"{p.matmul_size.get(d, 0):>7}")
    copy = "device to device" if p.device == "cuda" else "1 thread"
    lines.append(f"copy ({copy}): {p.memcpy_bytes_per_s / 1e9:.2f} GB/s")
    lines += _extra_lines(p.extra)
    lines.append("MFU divides by the 1-thread (CUDA: device) rate of the run's compute dtype x threads per rank x ranks")
    return "\n".join(lines)
