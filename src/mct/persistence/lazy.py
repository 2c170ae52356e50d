"""A module imported at the first use of one of its names.

``torch.distributed.checkpoint`` takes about a second to import, more than the rest of
mct together: a process that never writes or reads a checkpoint (a config error, the
launcher, ``mct plan``, a dry run) should not pay it. The modules that use the DCP layer
hold it as ``shards = LazyModule("mct.persistence.shards")``; the import runs at the first
``shards.<name>``, through the ordinary import system (one module object in
``sys.modules``, imported once). The proxy itself is not a module and is not registered
anywhere, so nothing that walks ``sys.modules`` (``inspect``, pickling) loads it by accident.
"""

from __future__ import annotations

import importlib
from typing import Any


class LazyModule:
    """Attribute access forwarded to ``importlib.import_module(name)``."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self._name), attr)

    def __repr__(self) -> str:
        return f"LazyModule({self._name!r})"
