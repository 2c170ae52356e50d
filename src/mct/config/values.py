"""Typed values of the config and the checks every section shares: ``Name`` (a name of a fixed
set), ``PrecisionMode``, ``ByteSize`` (a size as written, bytes once loaded), what a resume may
change (``OnResume``), and the range checks that raise ``ValueError`` naming the key and value."""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any


class Name(str, Enum):
    """A name of a fixed set (phases, verdicts, rollback actions). Equal to, hashed,
    printed, formatted and JSON-encoded as its string value, so it goes wherever that
    string went (metric keys, event records) unchanged."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

class PrecisionMode(Name):
    """``precision.mode``, converted at load: the dtype working parameters, their gradients
    and the compute live in (``dtype``; fp32 master weights whatever the mode), and what
    follows from it. Equal to, and serialized as, its name ('fp32', 'bf16', 'fp16')."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"

    def __repr__(self) -> str:  # messages show the value as the user wrote it: 'bf16'
        return repr(self.value)

    @property
    def itemsize(self) -> int:
        """Bytes per working parameter."""
        return 4 if self is PrecisionMode.fp32 else 2

    @property
    def is_low(self) -> bool:
        """bf16 or fp16: 16-bit working parameters over fp32 masters."""
        return self is not PrecisionMode.fp32

    @property
    def scales_loss(self) -> bool:
        """fp16: dynamic loss scaling protects small gradients (bf16 has fp32's range)."""
        return self is PrecisionMode.fp16

    @property
    def dtype(self) -> Any:
        """The ``torch.dtype`` of working parameters (torch is imported on first use: the
        schema loads without it)."""
        import torch
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.value]


@dataclass(frozen=True)
class OnResume:
    """What ``mct train --resume RUN_DIR --set key=value`` does with a changed key: where
    ``allowed``, the new value applies from the resumed step on and ``effect`` says what
    that means; otherwise the change is refused and ``effect`` says why, ``fix`` what to do.
    Every config key declares one (each section's ``ON_RESUME``, beside its fields); ``fix``
    may name ``{old}`` and ``{new}``, the two values."""

    allowed: bool
    effect: str
    fix: str = ""


NEW_RUN = "start a new run with --run-dir (add --init-from RUN_DIR to start from this run's weights)"


def may(effect: str) -> OnResume:
    """A key ``--resume`` may change, with what happens when it does."""
    return OnResume(True, effect)


def fixed(why: str, fix: str = NEW_RUN) -> OnResume:
    """A key ``--resume`` refuses to change: ``why`` it would make another run, ``fix``."""
    return OnResume(False, why, fix)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int, key: str = "memory.budget") -> int:
    """'24GiB' / '512MB' / 1024 -> bytes. Raises ValueError naming ``key``."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise ValueError(f"{key} must be positive, got {text!r}")
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"{key} must be a positive size like '2GiB', '512MiB' or '1.5GB', got {text!r}")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 1:  # '0.5B' rounds to nothing: not a budget anyone means
        raise ValueError(f"{key} = {text!r} is less than one byte; pass a size like '2GiB'")
    return n


class ByteSize(int):
    """A config key's byte count, written as a size ('2GiB') or an int: the loader hands
    the text on as written and the section converts it once (``ByteSize.of``). An int
    everywhere (arithmetic, JSON), it remembers how the user wrote it: its ``repr`` is
    that text, so a message names the value as written."""

    text: str

    def __new__(cls, value: int, text: str | None = None) -> "ByteSize":
        obj = super().__new__(cls, value)
        obj.text = str(int(value)) if text is None else text
        return obj

    @classmethod
    def of(cls, written: "str | int", key: str = "memory.budget") -> "ByteSize":
        """The bytes of ``written`` ('24GiB', '512MB', 1024). Raises ValueError naming ``key``."""
        if isinstance(written, ByteSize):
            return written
        return cls(parse_bytes(written, key), written if isinstance(written, str) else None)

    def __repr__(self) -> str:
        return repr(self.text)

    def __str__(self) -> str:  # str() and f"{x}": the number of bytes
        return int.__repr__(self)

    def __format__(self, spec: str) -> str:
        return format(int(self), spec)

    def __reduce__(self) -> tuple:
        return (ByteSize, (int(self), self.text))


def check_int(key: str, value: Any, lo: int, hi: int | None = None) -> None:
    """Raise ValueError unless ``value`` is an integer (not a bool; numpy integers
    pass) in ``[lo, hi)`` (``hi`` None: no upper bound), naming ``key`` and the value.
    The one integer validator of the project (config, data sampler, loss scaler)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo or (
            hi is not None and value >= hi):
        bound = f"in [{lo}, {hi})" if hi is not None else f">= {lo}"
        raise ValueError(f"{key} = {value!r} is not allowed: must be an integer {bound}")


def _fail(key: str, value: Any, allowed: str) -> None:
    raise ValueError(f"{key} = {value!r} is not allowed: {allowed}")


def _check_range(key: str, value: float, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False) -> None:
    if isinstance(value, float) and not math.isfinite(value):  # nan passes every comparison
        _fail(key, value, "must be a finite number")
    if lo is not None and (value < lo or (lo_open and value == lo)):
        _fail(key, value, f"must be {'>' if lo_open else '>='} {lo}")
    if hi is not None and value > hi:
        _fail(key, value, f"must be <= {hi}")
