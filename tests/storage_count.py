"""An independent yardstick for the planner: peak bytes of every live tensor storage,
counted without the engine's tracker or its categories.

``LiveStorage`` is a dispatch mode that remembers each storage any op returns (a
weakref: its bytes leave the count when it is freed) and checks the total after every
op. Storages resized in place (stage 3 frees and re-gathers parameters that way, outside
any op) are followed by wrapping ``UntypedStorage.resize_`` while the mode is active.
Exact on CPU, for tiny models only.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mct.engine import Engine


class LiveStorage(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list] = {}  # id(storage) -> [weakref, nbytes]
        self.total = 0
        self.peak = 0
        self._resize = None

    def _add(self, t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            st = t.untyped_storage()
            key = id(st)
            if key not in self.live:
                self.live[key] = [weakref.ref(st, lambda _, key=key: self._forget(key)), st.nbytes()]
                self.total += st.nbytes()

    def _forget(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.total -= entry[1]

    def seed(self, tensors) -> None:
        """Count tensors that existed before the mode was entered."""
        for t in tensors:
            self._add(t)

    def reset_peak(self) -> None:
        self.peak = self.total

    def __enter__(self):
        original = self._resize = torch.UntypedStorage.resize_
        counter = self

        def resize_(st, n):
            out = original(st, n)
            entry = counter.live.get(id(st))
            if entry is not None:
                counter.total += st.nbytes() - entry[1]
                entry[1] = st.nbytes()
                counter.peak = max(counter.peak, counter.total)
            return out
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            self._add(t)
        self.peak = max(self.peak, self.total)
        return out


def measure(model_fn: Callable, loss_fn: Callable, batch_fn: Callable, cfg, rank: int, *, optimizer=None,
            param_groups: Callable | None = None, steps: int = 2) -> dict[str, Any]:
    """Train ``steps`` steps of a fresh engine under ``LiveStorage``. Returns the peak
    live bytes of building the model and engine ('init'), of each step ('steps'), and
    the engine tracker's own peak per step ('tracker') and the bytes it holds off the
    device per offload tier ('offloaded'). Collective: every rank calls it."""
    torch.manual_seed(0)
    counter = LiveStorage()
    with counter:
        model = model_fn()
        engine = Engine(model, optimizer, cfg, param_groups=param_groups(model) if param_groups else None)
    out: dict[str, Any] = {"init": counter.peak, "steps": [], "tracker": []}
    batches = [batch_fn(s, rank) for s in range(steps)]
    counter.seed(tree_leaves(batches))
    for s in range(steps):
        with counter:
            counter.reset_peak()
            result = engine.train_step(batches[s], loss_fn)
        out["steps"].append(counter.peak)
        out["tracker"].append(result.metrics["peak_bytes"])
    out["offloaded"] = engine.tracker.offloaded()
    engine.close()
    return out
