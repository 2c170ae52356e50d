"""One checkpoint region: consecutive blocks whose forward runs under non-reentrant
checkpoint hooks and is replayed, block by block, in backward. The hooks are mct's
``frame.checkpoint_without_reentrant`` (torch's without ``torch._dynamo``), or torch's own
generator where ``frame.needs_torch_frame()`` (dynamo loaded already, or torch's debug mode).

The region opens in the first block's forward and closes after the last block's
forward, so a model that calls its blocks one by one (a plain ``for`` loop) needs no
change. Replay calls each block through ``block.__call__`` with the args/kwargs it got
in forward, so module forward pre-hooks and forward hooks fire again in recompute.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch
import torch.nn as nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import _checkpoint_without_reentrant_generator, set_checkpoint_early_stop

from mct.checkpointing import frame
from mct.checkpointing.blocks import first_tensor, primary
from mct.checkpointing.offload import Parked

# The private generator gained an ``early_stop`` parameter in newer torch.
_GENERATOR_TAKES_EARLY_STOP = "early_stop" in inspect.signature(_checkpoint_without_reentrant_generator).parameters


@dataclass
class _OpenRegion:
    """Per-forward record of an open region. The chained input of blocks after the
    first is not stored (it is recomputed), only the slot where it goes."""
    gen: Any
    calls: list[tuple[tuple[tuple, dict], str | int | None]] = field(default_factory=list)
    forward_outputs: list[Any] | None = None
    last_primary: Any = None


class Region:
    """Consecutive blocks ``[(qualified_name, module), ...]`` checkpointed together.

    ``install`` patches each block's ``forward`` (instance attribute); ``remove`` restores
    it. The region knows nothing of its owner: it is told whether to verify its first
    replay and what context a replay runs in, and keeps its own per-step counters
    (``recompute_calls``, ``recomputed_blocks``, ``recompute_time_s``).
    """

    def __init__(self, blocks: list[tuple[str, nn.Module]], context_fn: Callable | None, *, verify: bool = False,
                 recompute_context: Callable[[], ContextManager] = contextlib.nullcontext) -> None:
        self.blocks = blocks
        self.context_fn = context_fn
        self.verify = verify
        self.recompute_context = recompute_context
        self.verified = False
        self.recompute_calls = 0
        self.recomputed_blocks = 0
        self.recompute_time_s = 0.0
        self._open: _OpenRegion | None = None
        self._replaying: list[Any] | None = None
        self._originals: list[Callable] = []
        self._saved_attrs: list[Any] = []
        self.offload: Any = None  # an ActivationOffload: the region's input waits off the device
        self.mode = "all" if context_fn is None else "selective"  # what it keeps inside (apply sets it)

    @property
    def replaying(self) -> bool:
        """True while backward replays this region's forward."""
        return self._replaying is not None

    @property
    def label(self) -> str:
        names = [n for n, _ in self.blocks]
        return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"

    def install(self) -> None:
        for pos, (name, module) in enumerate(self.blocks):
            if getattr(module.forward, "_mct_checkpointed", False):
                raise ValueError(f"block {name!r} is already checkpointed; call remove() on the "
                                 "earlier CheckpointState before applying again")
            self._saved_attrs.append(module.__dict__.get("forward"))
            self._originals.append(module.forward)

            def patched(*args: Any, _pos: int = pos, **kwargs: Any) -> Any:
                return self._forward(_pos, args, kwargs)
            patched._mct_checkpointed = True  # type: ignore[attr-defined]
            module.forward = patched

    def remove(self) -> None:
        self._close(abort=True)
        for (_, module), saved in zip(self.blocks, self._saved_attrs):
            if saved is None:
                del module.forward
            else:
                module.forward = saved
        self._saved_attrs, self._originals = [], []

    # -- forward ---------------------------------------------------------------

    def _forward(self, pos: int, args: tuple, kwargs: dict) -> Any:
        original = self._originals[pos]
        if self._replaying is not None:
            out = original(*args, **kwargs)
            self._replaying.append(out)
            return out
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        slot = self._enter(pos, args, kwargs)
        try:
            out = original(*args, **kwargs)
        except BaseException:
            self._close(abort=True)
            raise
        region = self._open
        assert region is not None
        region.calls.append((self._strip(args, kwargs, slot), slot))  # type: ignore[arg-type]
        region.last_primary = primary(out)
        if region.forward_outputs is not None:
            region.forward_outputs.append(_detached_clone(out))
        if pos == len(self.blocks) - 1:
            self._close(abort=False)
        return out

    def _enter(self, pos: int, args: tuple, kwargs: dict) -> str | int | None:
        """Open the region at block 0, or check that block ``pos`` continues it.
        Returns where the chained input sits: None (block 0), 0 (first positional) or a kwarg name."""
        name = self.blocks[pos][0]
        if pos == 0:
            if self._open is not None:
                self._close(abort=True)
                raise ValueError(f"checkpoint region {self.label} was entered again before its last "
                                 "block ran; segment policies need each block called once, in order")
            self._open = _OpenRegion(gen=None)
            if not self.verified and self.verify:
                self._open.forward_outputs = []
            self._open.gen = self._start(self._open, first_tensor((args, kwargs)))
            return None
        region = self._open
        if region is None or len(region.calls) != pos:
            self._close(abort=True)
            raise ValueError(f"block {name!r} ran outside the order of its checkpoint region "
                             f"{self.label}; segment policies need the region's blocks called "
                             "consecutively (use policy 'all' or 'every_k' for this model)")
        slot = _chained_slot(args, kwargs)
        chained = None if slot is None else args[0] if slot == 0 else kwargs[slot]
        if chained is not region.last_primary:
            prev = self.blocks[pos - 1][0]
            self._close(abort=True)
            raise ValueError(f"blocks {prev!r} -> {name!r} do not chain: the first input of {name!r} "
                             f"is not the output of {prev!r}, so region {self.label} cannot be "
                             "replayed; use checkpointing.policy = 'all' or 'every_k' for this model")
        return slot

    @staticmethod
    def _strip(args: tuple, kwargs: dict, slot: str | int | None) -> tuple[tuple, dict]:
        # Drop the chained activation: keeping it would defeat the region's memory saving.
        if slot is None:
            return args, kwargs
        if slot == 0:
            return (None, *args[1:]), kwargs
        return args, {**kwargs, slot: None}

    def _start(self, record: _OpenRegion, anchor: torch.Tensor | None) -> Any:
        # The anchor only tells torch which device's RNG state to stash for replay. torch
        # keeps it until backward: under offload an empty tensor on its device stands in.
        if anchor is not None and self.offload is not None:
            anchor = anchor.detach().new_empty(0)
        anchors = (anchor,) if anchor is not None else ()
        head = (functools.partial(self._replay, record), True, self.context_fn or _noop_contexts, "default", False)
        if frame.needs_torch_frame():  # torch._dynamo loaded already (or torch's debug mode): torch's own
            start, takes_early_stop = _checkpoint_without_reentrant_generator, _GENERATOR_TAKES_EARLY_STOP
        else:
            start, takes_early_stop = frame.checkpoint_without_reentrant, True
        if takes_early_stop:
            head = (*head, True)
        gen = start(*head, *anchors)
        if record.forward_outputs is not None:
            # Verification compares every block's output, so the replay must run to the end.
            with set_checkpoint_early_stop(False):
                next(gen)
        else:
            next(gen)
        return gen

    def _close(self, abort: bool) -> None:
        region, self._open = self._open, None
        if region is None or region.gen is None:
            return
        if abort:
            region.gen.close()
            return
        region.last_primary = None
        next(region.gen, None)
        if self.offload is not None:
            region.calls[0] = (_map_chained(region.calls[0][0], self.offload.park), None)

    # -- backward (recompute) ----------------------------------------------------

    def _replay(self, region: _OpenRegion, *_anchor: Any) -> None:
        """Recompute the region: run its blocks in order through ``__call__``."""
        start = time.perf_counter()
        self._replaying = outputs = []
        try:
            with self.recompute_context():
                x: Any = None
                for pos, (_, module) in enumerate(self.blocks):
                    (args, kwargs), slot = region.calls[pos]
                    if pos == 0 and self.offload is not None:  # back from its tier (a local: freed after use)
                        args, kwargs = _map_chained((args, kwargs), self._restore)
                    if slot == 0:
                        args = (primary(x), *args[1:])
                    elif slot is not None:
                        kwargs = {**kwargs, slot: primary(x)}
                    # Counted before the call: torch may stop a replay early, inside the
                    # last block, once every tensor backward needs is recomputed.
                    self.recomputed_blocks += 1
                    x = module(*args, **kwargs)
                    if region.forward_outputs is not None:
                        self._verify(pos, region.forward_outputs[pos], outputs[pos])
            if region.forward_outputs is not None:
                region.forward_outputs = None
                self.verified = True
        finally:
            self._replaying = None
            self.recompute_calls += 1
            self.recompute_time_s += time.perf_counter() - start

    def _restore(self, parked: Any) -> Any:
        return self.offload.restore(parked) if isinstance(parked, Parked) else parked

    def _verify(self, pos: int, expected: Any, got: Any) -> None:
        with torch.no_grad(), _disable_current_modes():
            mismatch = _first_mismatch(expected, got)
        if mismatch is not None:
            raise RuntimeError(
                f"checkpointing.verify: block {self.blocks[pos][0]!r} recomputed a different "
                f"output than its forward ({mismatch}). A non-deterministic op runs inside a "
                "checkpointed region (an RNG outside torch's default generators, a counter, "
                "a non-deterministic kernel); make it deterministic or exclude the block")


def _chained_slot(args: tuple, kwargs: dict) -> str | int | None:
    """Where a block's chained input sits: 0 (its first positional argument), else the
    name of its first keyword argument; None when it takes no argument."""
    return 0 if args else next(iter(kwargs), None)


def _map_chained(call: tuple[tuple, dict], fn: Callable[[Any], Any]) -> tuple[tuple, dict]:
    """``call`` with ``fn`` applied to the first block's chained input (``_chained_slot``)."""
    args, kwargs = call
    slot = _chained_slot(args, kwargs)
    if slot is None:
        return args, kwargs
    if slot == 0:
        return (fn(args[0]), *args[1:]), kwargs
    return args, {**kwargs, slot: fn(kwargs[slot])}


def _noop_contexts() -> tuple[contextlib.nullcontext, contextlib.nullcontext]:
    return contextlib.nullcontext(), contextlib.nullcontext()


def _detached_clone(out: Any) -> Any:
    # Outside any dispatch mode (selective checkpointing's cache, FLOP counters): the
    # copy is bookkeeping, not part of the region's computation.
    with torch.no_grad(), _disable_current_modes():
        return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), out)


def _first_mismatch(expected: Any, got: Any) -> str | None:
    """Describe the first difference between two output structures, or None if equal."""
    exp_leaves, exp_spec = torch.utils._pytree.tree_flatten(expected)
    got_leaves, got_spec = torch.utils._pytree.tree_flatten(got)
    if exp_spec != got_spec:
        return f"output structure {got_spec} != forward's {exp_spec}"
    for i, (a, b) in enumerate(zip(exp_leaves, got_leaves)):
        if not isinstance(a, torch.Tensor):
            if a != b:
                return f"output leaf {i}: {b!r} != forward's {a!r}"
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output leaf {i}: {tuple(b.shape)}/{b.dtype} != forward's {tuple(a.shape)}/{a.dtype}"
        b = b.detach()
        same = (torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True)
                if a.is_floating_point() or a.is_complex() else torch.equal(a, b))
        if not same:
            diff = (a.double() - b.double()).abs().max().item()
            return f"output leaf {i}: max abs difference {diff:.3g}"
    return None
