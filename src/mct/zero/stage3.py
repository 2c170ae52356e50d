"""ZeRO-3 parameter lifecycle: gather a block's parameters just before it runs, free
them right after, gather again for its backward (and recompute), free once its
gradients are reduced.

Phases, set by the engine: "forward" (training forward), "backward" (backward,
including recomputation of checkpointed blocks), "eval" (no-grad forward), "idle".
  forward pre-hook   gather this block (wait for its prefetch), prefetch the next one
  forward post-hook  forward/eval: free it; forward: hook its outputs, so that the
                     gradient reaching them gathers it again (and prefetches the
                     previous block) before its backward runs. backward: nothing,
                     the block stays gathered until its gradients are reduced.
The root unit (parameters outside blocks, and weights shared between units such as
tied embeddings) follows the same lifecycle on the model itself: gathered when the
model's forward starts, freed when it returns (the loss and the start of backward, where
activation memory peaks, run without it), gathered again when the gradient reaches the
model's outputs, and freed once its gradients are reduced. So at stage 3 parameters
hold data only inside the model's forward and backward. ``reshard_root=False``
(``zero.reshard_root_after_forward = false``, FSDP2's root): the root stays gathered
from the forward into the backward, one all-gather fewer, its bytes held during the loss.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from mct.memory.tracker import Phase
from mct.zero.comm import Comm
from mct.zero.flat import FlatParamUnit


class Stage3Lifecycle:
    def __init__(self, blocks: list[tuple[str, nn.Module]], units_by_block: dict[str, list[FlatParamUnit]],
                 comm: Comm, tracker, prefetch: bool, root: nn.Module | None = None,
                 reshard_root: bool = True) -> None:
        self.comm, self.tracker, self.prefetch, self.reshard_root = comm, tracker, prefetch, reshard_root
        self.order = [name for name, _ in blocks if name in units_by_block]
        self.units = units_by_block
        self.phase = Phase.IDLE
        self.gathers = 0
        hooked = [(name, block) for name, block in blocks if name in units_by_block]
        if root is not None and "root" in units_by_block:
            hooked.append(("root", root))
        for name, module in hooked:
            module.register_forward_pre_hook(self._pre_forward(name), with_kwargs=True)
            module.register_forward_hook(self._post_forward(name), with_kwargs=True)
        for units in units_by_block.values():
            for u in units:
                u.release()
                tracker.refresh(u.working)

    # ---- gather / release ----
    def gather(self, name: str, async_op: bool = False) -> None:
        for u in self.units.get(name, []):
            if not u.gathered and u.pending_gather is None:
                self.gathers += 1
            u.gather(self.comm, async_op=async_op)
            self.tracker.refresh(u.working)

    def release(self, name: str) -> None:
        for u in self.units.get(name, []):
            u.release()
            self.tracker.refresh(u.working)

    def _neighbour(self, name: str, delta: int) -> str | None:
        if name == "root":  # backward reaches the last block first; forward has begun at the first
            return self.order[-1 if delta < 0 else 0] if self.order else None
        i = self.order.index(name) + delta
        return self.order[i] if 0 <= i < len(self.order) else None

    def _prefetch(self, name: str, delta: int) -> None:
        nxt = self._neighbour(name, delta) if self.prefetch else None
        if nxt is not None:
            self.gather(nxt, async_op=True)

    # ---- hooks ----
    def _pre_forward(self, name: str):
        def hook(module, args, kwargs):
            self.gather(name)
            if self.phase == Phase.FORWARD:
                self._prefetch(name, +1)
        return hook

    def _post_forward(self, name: str):
        def hook(module, args, kwargs, output):
            kept = name == "root" and not self.reshard_root and self.phase == Phase.FORWARD  # into backward
            if self.phase in (Phase.FORWARD, Phase.EVAL) and not kept:
                self.release(name)
            if self.phase == Phase.FORWARD:
                tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                for t in tensors:
                    t.register_hook(self._pre_backward(name))
        return hook

    def _pre_backward(self, name: str):
        def hook(grad):
            self.gather(name)
            self._prefetch(name, -1)
        return hook

    # ---- step boundaries ----
    def begin(self, phase: Phase) -> None:
        """Enter a phase. Forward/eval gather the root unit up front (the model's own
        pre-hook would too); backward gathers it only when the gradient reaches the
        model's outputs."""
        self.phase = phase
        if phase != Phase.BACKWARD:
            self.gather("root")

    def end_step(self) -> None:
        """After the step: every non-persistent unit's storage is freed."""
        self.phase = Phase.IDLE
        for name in ["root", *self.order]:
            self.release(name)
