"""What a cached machine profile entry must hold, checked before it is used: each field of its
JSON type (never coerced: a rate written as a string is damage), the rates finite and
positive, the time model's curves ``[[size, rate], ...]`` of positive numbers, the load, the
suspect mark and the pin of their types. Every check raises ValueError or TypeError naming
the field; ``MachineProfile.from_dict`` turns either into one ValueError, and the cache then
measures again."""

from __future__ import annotations

import math
from typing import Any

from mct.machine.load import Load

SCALAR_RATES = ("copy_all_bytes_per_s", "disk_bytes_per_s", "host_bytes_per_s", "random_elements_per_s",
                "python_mode_op_s", "selective_mode_op_s", "tracker_op_s")
"""``extra``'s single-number entries: a cached one that is not a finite number >= 0 is a
damaged entry (measured again), never a traceback where the time model reads it."""


def check_extra(extra: dict[str, Any]) -> None:
    """Raise ValueError naming the first of ``extra``'s curves or single-number rates (a
    profile's time-model rates) that is not what the time model reads."""
    curves = [(name, extra.get(name) or []) for name in ("elementwise_curve", "elementwise_speedup",
                                                          "matmul_speedup")]
    curves += [(f"elementwise_by_dtype.{k}", c) for k, c in _mapping(extra, "elementwise_by_dtype").items()]
    kinds = _mapping(extra, "elementwise_by_kind")
    curves += [(f"elementwise_by_kind.{kind}.{k}", c) for kind in kinds
               for k, c in _mapping(kinds, kind, f"elementwise_by_kind.{kind}").items()]
    for name in SCALAR_RATES:
        x = extra.get(name)
        if x is not None and not (isinstance(x, (int, float)) and not isinstance(x, bool)
                                  and math.isfinite(x) and x >= 0):
            raise ValueError(f"machine profile entry is damaged ({name} is {x!r}, not a number >= 0)")
    for name, curve in curves:
        if not (isinstance(curve, list) and all(isinstance(pt, list) and len(pt) == 2 and
                                                all(isinstance(x, (int, float)) and x > 0 for x in pt)
                                                for pt in curve)):
            raise ValueError(f"machine profile entry is damaged ({name} is not [[size, rate], ...] of positive numbers)")


def check_marks(load: dict[str, Any], suspect: Any, pinned: Any) -> None:
    """Raise ValueError naming the field when the profile's load, suspect mark or pin is not
    of its type (a damaged entry: measured again)."""
    if load:
        try:
            Load.from_dict(load)
        except ValueError as e:
            raise ValueError(f"machine profile entry is damaged ({e})") from None
        if not isinstance(load.get("passes", 1), int) or isinstance(load.get("passes"), bool):
            raise ValueError(f"machine profile entry is damaged (load.passes is {load.get('passes')!r})")
    if not isinstance(suspect, str):
        raise ValueError(f"machine profile entry is damaged (suspect is {suspect!r}, not a string)")
    if not isinstance(pinned, bool):
        raise ValueError(f"machine profile entry is damaged (pinned is {pinned!r}, not true or false)")


def _mapping(d: dict[str, Any], key: str, name: str | None = None) -> dict[str, Any]:
    """``d[key]`` (a JSON object; absent: {}). Raises ValueError naming it (``name``) for anything else."""
    got = d.get(key) or {}
    if not isinstance(got, dict):
        raise ValueError(f"machine profile entry is damaged ({name or key} is a {type(got).__name__}, not an object)")
    return got


FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "device": (str,), "name": (str,), "flags": (list,), "torch_version": (str,), "threads": (int,),
    "matmul_one": (dict,), "matmul_all": (dict,), "matmul_size": (dict,), "memcpy_bytes_per_s": (int, float),
    "measured_at": (str,), "seconds": (int, float), "extra": (dict,), "load": (dict,), "suspect": (str,),
    "pinned": (bool,)}
"""The JSON type of each field a cached profile holds: a value of another type (a rate
written as a string, a thread count as a float) is a damaged entry, never coerced."""


def check_types(d: dict[str, Any]) -> None:
    """Raise TypeError naming the first field of ``d`` (a cached profile) whose value is not of
    its ``FIELD_TYPES`` type, or whose rates, sizes or flags are not numbers, integers or strings."""
    for name, types in FIELD_TYPES.items():
        v = d.get(name)
        if name in d and not (isinstance(v, types) and (bool not in types) == (not isinstance(v, bool))):
            raise TypeError(f"{name} is {v!r}, not {' or '.join(t.__name__ for t in types)}")
    if not all(isinstance(f, str) for f in d.get("flags") or []):
        raise TypeError(f"flags are {d.get('flags')!r}, not strings")
    for name in ("matmul_one", "matmul_all", "matmul_size"):
        want = int if name == "matmul_size" else (int, float)
        bad = {k: v for k, v in (d.get(name) or {}).items() if isinstance(v, bool) or not isinstance(v, want)}
        if bad:
            raise TypeError(f"{name} holds {bad!r}, not {'integers' if want is int else 'numbers'}")


def positive_rates(d: Any) -> dict[str, float]:
    rates = {str(k): float(v) for k, v in d.items()}
    if any(not (math.isfinite(v) and v > 0) for v in rates.values()):
        raise ValueError(f"rates must be finite and positive, got {rates}")
    return rates
