"""Fault injection for tests: the ``MCT_FAULT`` environment variable.

Never part of a config (a config is the run; a fault is an experiment on it). One
fault or a comma-separated list; S and E count steps as ``metrics.jsonl``'s ``step``:

- ``corrupt@S`` / ``corrupt@SxF``: every parameter (master and working copies, every
  rank) is multiplied by 1e3 (or F, e.g. ``corrupt@5x1e5``) right after the optimizer
  update of step S. Whether the next steps' gradients stay finite (a loss spike) or
  overflow (skipped steps) depends on F, the model and the precision. Transient: fires
  once per process, not again when a rollback replays step S.
- ``nan@S`` / ``nan@S-E``: the gradients of those steps are non-finite on rank 0,
  every time those steps run (persistent: no rollback gets past it).
- ``kill@S[:RANK]``: that rank (default 1) kills itself with SIGKILL when step S
  starts, once.
- ``abort@S[:RANK]``: that rank (default 1) aborts (SIGABRT, as a crash in native code
  does) when step S starts, once.

No fault fires in a process started by a restart (``TORCHELASTIC_RESTART_COUNT`` > 0),
so a restarted group shows what recovery does, not the fault again.
"""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

CORRUPT_FACTOR = 1e3
_SPEC = re.compile(r"^(corrupt|nan|kill|abort)@(\d+)(?:-(\d+))?(?::(\d+))?(?:x(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?))?$")


@dataclass(frozen=True)
class Fault:
    kind: str
    """'corrupt', 'nan', 'kill' or 'abort'."""
    start: int
    end: int
    """Last step (inclusive); equals ``start`` for a single step."""
    rank: int = 1
    """kill, abort: the rank that dies."""
    factor: float = CORRUPT_FACTOR
    """corrupt: what every parameter is multiplied by."""


def parse_faults(text: str) -> list[Fault]:
    """``'corrupt@3,nan@5-7,kill@4:0,abort@6'`` -> faults. Raises ValueError naming the bad item."""
    faults = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        m = _SPEC.match(item)
        if not m:
            raise ValueError(f"MCT_FAULT item {item!r} is not one of corrupt@S[xF], nan@S, nan@S-E, kill@S[:RANK], "
                             f"abort@S[:RANK]")
        kind, s, e, r, x = m.group(1), int(m.group(2)), m.group(3), m.group(4), m.group(5)
        if x is not None and kind != "corrupt":
            raise ValueError(f"MCT_FAULT item {item!r}: only corrupt takes a factor xF")
        if e is not None and kind != "nan":
            raise ValueError(f"MCT_FAULT item {item!r}: only nan takes a step range S-E")
        if r is not None and kind not in ("kill", "abort"):
            raise ValueError(f"MCT_FAULT item {item!r}: only kill and abort take a :RANK")
        end = int(e) if e is not None else s
        if end < s:
            raise ValueError(f"MCT_FAULT item {item!r}: the range ends before it starts")
        faults.append(Fault(kind, s, end, int(r) if r is not None else 1,
                            float(x) if x is not None else CORRUPT_FACTOR))
    return faults


@dataclass
class FaultPlan:
    """The faults of this process and which transient ones already fired.

    Empty (every hook a no-op) without ``MCT_FAULT`` or in a restarted process."""

    faults: list[Fault] = field(default_factory=list)
    fired: set[Fault] = field(default_factory=set)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "FaultPlan":
        env = os.environ if environ is None else environ
        if int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
            return cls()
        return cls(parse_faults(env.get("MCT_FAULT", "")))

    def __bool__(self) -> bool:
        return bool(self.faults)

    def _at(self, kind: str, step: int) -> list[Fault]:
        return [f for f in self.faults if f.kind == kind and f.start <= step <= f.end]

    def before_step(self, step: int, rank: int) -> None:
        """kill@S[:RANK]: SIGKILL this process at the start of step S (once);
        abort@S[:RANK]: abort it there (SIGABRT, the end of a crash in native code)."""
        for f in self._at("kill", step) + self._at("abort", step):
            if f.rank == rank and f not in self.fired:
                self.fired.add(f)
                if f.kind == "abort":
                    os.abort()
                os.kill(os.getpid(), signal.SIGKILL)

    def wrap_loss(self, loss_fn: Callable, step: int, rank: int) -> Callable:
        """nan@S[-E] on rank 0: ``loss_fn`` whose loss value is unchanged but whose
        gradients are NaN (a hook on the loss multiplies its gradient by NaN)."""
        if rank != 0 or not self._at("nan", step):
            return loss_fn

        def poisoned(model: torch.nn.Module, batch: Any) -> torch.Tensor:
            loss = loss_fn(model, batch)
            if loss.requires_grad:
                loss.register_hook(lambda g: g * float("nan"))
            return loss
        return poisoned

    def after_update(self, step: int, engine: Any, skipped: bool) -> bool:
        """corrupt@S: after the (applied) update of step S multiply every master shard
        by its factor and republish the working parameters, once. Returns whether it fired."""
        hits = [f for f in self._at("corrupt", step) if f not in self.fired]
        if not hits or skipped:
            return False
        self.fired.update(hits)
        with torch.no_grad(), engine.residency.masters_resident(write_back=True):  # offloaded masters read back
            for m in engine.sharded.masters():
                for f in hits:
                    m.mul_(f.factor)
            engine.sharded.publish()
        return True
