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
At stages 1-3 a frozen input embedding and a frozen, untied output head are units of their
own, in ``blocks`` before the first and after the last block (``split_frozen_ends``): gathered
for their own call, and the head again for its backward, rather than with the root.
A streamed head (``streams``: the chunked loss reaches its rows a vocabulary slice at a
time, ``mct.task.vocab_slices``) is not gathered for a call its predicate says is streamed,
nor for that call's backward, and is never prefetched.
The root unit (parameters outside blocks, and weights shared between units such as
tied embeddings) follows the same lifecycle on the model itself: gathered when the
model's forward starts, freed when it returns (the loss and the start of backward, where
activation memory peaks, run without it), gathered again when the gradient reaches the
model's outputs, and freed once its gradients are reduced. So at stage 3 parameters
hold data only inside the model's forward and backward. ``reshard_root=False``
(``zero.reshard_root_after_forward = false``, FSDP2's root): the root stays gathered
from the forward into the backward, one all-gather fewer, its bytes held during the loss.

Frozen units (``mct.zero.frozen``, stages 1-3; at stages 1/2 the only units here) follow
the same gathers; having no gradient to reduce, a block's frozen unit is freed in backward
once the gradient of every input of every forward call of the block that needs one has
been computed (tensor hooks on those inputs, registered in forward: the block's backward is
done). A block whose output needs a gradient but none of whose inputs does (its trainable
adapters after a frozen embedding; the root) keeps its frozen unit until the backward ends
(``after_backward``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from mct.memory.tracker import Phase
from mct.zero.comm import Comm
from mct.zero.flat import FlatParamUnit
from mct.zero.frozen import FrozenUnit

RELEASE_FIRST = "_mct_release_first"
"""The attribute a block's output tensor carries in forward: the frozen-unit release hooks the
next block registered on it, run before the producing block's backward gather."""


class Stage3Lifecycle:
    def __init__(self, blocks: list[tuple[str, nn.Module]],
                 units_by_block: dict[str, list[FlatParamUnit | FrozenUnit]],
                 comm: Comm, tracker, prefetch: bool, root: nn.Module | None = None,
                 reshard_root: bool = True, streams: dict[str, object] | None = None) -> None:
        """``units_by_block``: block name (or 'root') -> its units, trainable (stage 3)
        and frozen (stages 1-3). ``streams``: block name -> an object whose ``active`` is
        True during a call that reaches the block's weights itself (gather nothing for it).
        Every unit is released here."""
        self.streams = streams or {}
        self._streamed: set[str] = set()  # blocks whose current call is streamed
        self.comm, self.tracker, self.prefetch, self.reshard_root = comm, tracker, prefetch, reshard_root
        self.order = [name for name, _ in blocks if name in units_by_block]
        self.units = units_by_block
        self.frozen = {name: [u for u in us if isinstance(u, FrozenUnit)] for name, us in units_by_block.items()}
        self.phase = Phase.IDLE
        self.gathers = 0
        # per block, this backward: forward calls whose input gradients are awaited, and
        # blocks whose frozen unit waits for the backward's end (no input needs a gradient)
        self._awaiting: dict[str, int] = {}
        self._sticky: set[str] = set()
        self._hooked_inputs: dict[str, int] = {}
        self._in_backward: set[str] = set()  # units whose outputs' gradient gathers them, this step
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

    def release(self, name: str, frozen_only: bool = False) -> None:
        for u in (self.frozen if frozen_only else self.units).get(name, []):
            u.release()
            self.tracker.refresh(u.working)

    def _neighbour(self, name: str, delta: int) -> str | None:
        if name == "root":  # backward reaches the last block first; forward has begun at the first
            return self.order[-1 if delta < 0 else 0] if self.order else None
        i = self.order.index(name) + delta
        return self.order[i] if 0 <= i < len(self.order) else None

    def _prefetch(self, name: str, delta: int) -> None:
        nxt = self._neighbour(name, delta) if self.prefetch else None
        if nxt in self.streams:  # a streamed head reaches its rows itself: a prefetch would gather it whole
            return
        # backward prefetches only what its backward will gather (a frozen embedding's is none)
        if nxt is not None and (delta > 0 or nxt in self._in_backward):
            self.gather(nxt, async_op=True)

    # ---- hooks ----
    def _pre_forward(self, name: str):
        def hook(module, args, kwargs):
            if getattr(self.streams.get(name), "active", False):
                self._streamed.add(name)
                return
            self.gather(name)
            if self.phase == Phase.FORWARD:
                self._prefetch(name, +1)
                if self.frozen.get(name) and torch.is_grad_enabled():
                    self._hook_inputs(name, (args, kwargs))
        return hook

    def _hook_inputs(self, name: str, inputs) -> None:
        """Free ``name``'s frozen units in backward once every input of this call that
        needs a gradient has got it (and every other hooked call of the block too)."""
        tensors = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        self._hooked_inputs[name] = len(tensors)
        if not tensors:
            return
        self._awaiting[name] = self._awaiting.get(name, 0) + 1
        left = [len(tensors)]

        def counted(fired: list[bool]):
            def hook(grad):
                if fired[0]:  # run already, ahead of a gather (below)
                    return
                fired[0] = True
                left[0] -= 1
                if left[0] == 0:
                    self._awaiting[name] -= 1
                    if self._awaiting[name] == 0 and name not in self._sticky:
                        self.release(name, frozen_only=True)
            return hook
        for t in tensors:
            hook = counted([False])
            t.register_hook(hook)
            # the block that produced ``t`` gathers its units in backward from a hook on ``t``
            # registered before this one: that gather runs this release first, so the two
            # blocks' frozen units are never gathered at once (mct.zero.stage3._pre_backward)
            ahead = getattr(t, RELEASE_FIRST, None)
            if ahead is not None:
                ahead.append(hook)

    def _post_forward(self, name: str):
        def hook(module, args, kwargs, output):
            if name in self._streamed:
                self._streamed.discard(name)
                return
            kept = name == "root" and not self.reshard_root and self.phase == Phase.FORWARD  # into backward
            if self.phase in (Phase.FORWARD, Phase.EVAL) and not kept:
                self.release(name)
            if self.phase == Phase.FORWARD:
                tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                for t in tensors:
                    ahead: list = []
                    setattr(t, RELEASE_FIRST, ahead)
                    t.register_hook(self._pre_backward(name, ahead))
                if tensors:
                    self._in_backward.add(name)
                if tensors and self.frozen.get(name) and not self._hooked_inputs.get(name, 0):
                    self._sticky.add(name)  # a backward no input hook can see the end of
        return hook

    def _pre_backward(self, name: str, ahead: list):
        """The hook gathering ``name`` when its output's gradient arrives; ``ahead``: the
        release hooks later blocks registered on the same output (their backward is done
        when this gradient is), run first so their frozen units are freed before this gather."""
        def hook(grad):
            while ahead:
                ahead.pop(0)(grad)
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

    def after_backward(self) -> None:
        """After a backward: free every frozen unit still gathered (a block no input hook
        released, one whose backward never ran)."""
        for name in ["root", *self.order]:
            self.release(name, frozen_only=True)
        self._awaiting, self._sticky, self._hooked_inputs, self._in_backward = {}, set(), {}, set()

    def end_step(self) -> None:
        """After the step: every non-persistent unit's storage is freed."""
        self.phase = Phase.IDLE
        for name in ["root", *self.order]:
            self.release(name)
        self._awaiting, self._sticky, self._hooked_inputs, self._in_backward = {}, set(), {}, set()
