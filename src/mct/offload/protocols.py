"""What the satellites of an offloaded state (``torch_format.py``, ``persist.py``) may
use of it: its public records and methods, never its privates. ``OffloadedState``
(``runtime.py``) is the one implementation; typing against this protocol keeps the
satellites from importing it (it imports them)."""

from __future__ import annotations

from typing import Protocol

import torch

from mct.offload.store import Store, UnitState
from mct.offload.stream import ChunkStream
from mct.zero.flat import FlatParamUnit


class OffloadedUnits(Protocol):
    units: list[FlatParamUnit]
    """The flat units, in build order; unit ``i``'s records are ``u<i>.*``."""
    states: list[UnitState | None]
    """Per unit: which optimizer state it has (None before its first step)."""
    store: Store
    stream: ChunkStream
    device: torch.device
    spans: dict[str, int]
    """Per-block optimizer state: name -> master elements per entry."""

    def state_numel(self, name: str, n: int) -> int: ...

    def fetch(self, store: Store, key: str, out: torch.Tensor) -> None: ...

    def ensure_record(self, key: str, numel: int, dtype: torch.dtype) -> None: ...

    def refresh_params(self, i: int, u: FlatParamUnit) -> None: ...

    def publish(self) -> None: ...

    def end_step(self) -> None: ...

    def report_offloaded(self) -> None: ...
