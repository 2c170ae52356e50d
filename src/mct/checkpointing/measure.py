"""Measure the activation bytes a forward leaves alive for backward.

A ``saved_tensors_hooks`` counter would miss exactly what checkpointing keeps: inside a
region torch's own hooks take precedence, and a region's input is held by reference,
not saved. So this counts instead every storage created during the forward that is
still alive when it returns: with the loss as the only result, that is what autograd
keeps for backward, including region inputs.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode


class _StorageRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.preexisting: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Storages an op reads that no recorded op made existed before (parameters,
        # inputs); outputs sharing them (weight.t() in a linear) are views, not activations.
        for t in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                cdata = StorageWeakRef(t.untyped_storage()).cdata
                if cdata not in self.storages:
                    self.preexisting.add(cdata)
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                if ref.cdata not in self.preexisting:
                    self.storages.setdefault(ref.cdata, (ref, storage.nbytes()))
        return out


def saved_activation_bytes(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn`` (a forward returning the loss) and return ``(result, bytes)``, where
    bytes is the total size of unique storages created by ``fn`` and still alive after
    it returns. Since saved tensors only accumulate during forward, this is the peak of
    what is kept for backward. Mutates nothing; the result can be back-propagated."""
    recorder = _StorageRecorder()
    with recorder:
        result = fn()
    alive = sum(nbytes for ref, nbytes in recorder.storages.values() if not ref.expired())
    return result, alive
