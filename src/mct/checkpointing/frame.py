"""torch's non-reentrant checkpoint frame without ``torch._dynamo``.

mct never compiles, but torch 2.13's non-reentrant checkpoint imports ``torch._dynamo``
(about 72 MiB resident, a second of import time) in a process that only recomputes:
``_checkpoint_without_reentrant_generator`` reads ``torch._dynamo.config`` on entry, its
recompute runs under ``torch._disable_dynamo`` and a pack hook made by
``torch._dynamo.disable``, and selective checkpointing's dispatch modes have their
``__torch_dispatch__`` wrapped in ``torch._disable_dynamo`` (which imports it on the first op).

``checkpoint_without_reentrant`` is the same generator (same call, same saved tensors, same
recompute, RNG replay, autocast and device context, same early stop and the same
``CheckpointError`` messages) on torch's own frame, holders and metadata checks, with its two
hooks (``_CheckpointHook``, ``_RecomputationHook``) written here without the dynamo
wrappers. ``selective_contexts`` gives torch's selective-checkpoint modes as classes whose
``__torch_dispatch__`` is torch's, unwrapped (as ``mct.memory.tracker._CountingMode``).

Where ``torch._dynamo`` is loaded already (something in the process may compile) or torch's
checkpoint debug mode is on, ``needs_torch_frame`` says so and torch's own pieces are used:
there is nothing left to save, and torch.compile sees the frames it expects.
"""

from __future__ import annotations

import contextlib
import sys
import uuid
import weakref
from typing import Any, Callable, ContextManager, Iterator

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext
from torch.utils.checkpoint import (
    CheckpointError,
    GraphExecGroup,
    _CachedTorchDispatchMode,
    _CachingTorchDispatchMode,
    _CheckpointFrame,
    _Handle,
    _Holder,
    _StopRecomputationError,
    _get_autocast_kwargs,
    _infer_device_type,
    create_selective_checkpoint_contexts,
    get_device_states,
    noop_context_fn,
    set_device_states,
)

from mct.memory.undynamo import undecorated

def needs_torch_frame() -> bool:
    """True where torch's own checkpoint pieces must run: ``torch._dynamo`` is loaded (the
    process may compile; loading it costs nothing more now) or torch's checkpoint debug mode
    is on globally (its logging mode is a dispatch mode torch wraps for dynamo)."""
    return "torch._dynamo" in sys.modules or bool(torch_checkpoint._checkpoint_debug_enabled)


class _RecomputationHook(torch.autograd.graph.saved_tensors_hooks):
    """torch's ``_recomputation_hook`` without ``torch._dynamo.disable`` on its pack hook:
    during a recompute, each saved tensor goes to the holder the forward's pack made for it
    (``frame.recomputed[gid]``); raises ``_StopRecomputationError`` once the last one is in
    (early stop) and ``CheckpointError`` when the recompute saves more than the forward did."""

    def __init__(self, frame_ref: weakref.ReferenceType, gid: Any) -> None:
        def pack_hook(x: torch.Tensor) -> torch.Tensor:
            x = x.detach() if x.requires_grad else x
            frame = frame_ref()
            assert frame is not None, "checkpoint frame freed during its own recompute"
            idx = frame.recomp_counter[gid]
            frame.recomp_counter[gid] += 1
            if idx >= len(frame.weak_holders):
                assert not frame.early_stop, "an early-stopping recompute ran past its last saved tensor"
                if not frame.forward_completed:  # grad inside the forward, early stop off (torch's Rule 6)
                    frame.ignore_saved_mismatch = True
                    return x
                raise CheckpointError(
                    "torch.utils.checkpoint: trying to save more tensors during "
                    "recomputation than during the original forward pass.\n"
                    f"{torch_checkpoint._debug_tip_msg}")
            holder = frame.weak_holders[idx]()
            if holder is not None:  # else freed by a backward inside the forward: nothing to keep
                assert holder.handles.get(gid) is None, "a holder filled twice in one recompute"
                holder.handles[gid] = _Handle()
                frame.recomputed[gid][holder.handles[gid]] = x
            if frame.early_stop and frame.recomp_counter[gid] == len(frame.weak_holders):
                raise _StopRecomputationError
            return x

        super().__init__(pack_hook, lambda x: x)


def _graph_id() -> Any:
    """The id a recompute is kept under, as torch's unpack hook chooses it: the
    ``GraphExecGroup``, else the running backward's graph task, else a fresh one."""
    gid = GraphExecGroup._get_current_group()
    if gid is None:
        gid = torch._C._current_graph_task_id()
        if gid == -1:  # unpacked outside any backward
            gid = int(uuid.uuid4())
    return gid


class _CheckpointHook(torch.autograd.graph.saved_tensors_hooks):
    """torch's ``_checkpoint_hook``: pack keeps a ``_Holder`` (and the tensor's metadata) in
    place of the tensor; the first unpack of a backward recomputes the frame under
    ``_RecomputationHook``, checks the recompute saved what the forward did, and hands each
    holder its recomputed tensor once. Raises ``CheckpointError`` as torch's does."""

    def __init__(self, frame: _CheckpointFrame) -> None:
        def pack_hook(x: torch.Tensor) -> _Holder:
            holder = _Holder()
            frame.weak_holders.append(weakref.ref(holder))
            if frame.metadata_fn is not None:
                with torch.no_grad():
                    frame.x_metadatas.append(frame.metadata_fn(x))
            return holder

        def unpack_hook(holder: _Holder) -> torch.Tensor:
            gid = _graph_id()
            if not frame.is_recomputed[gid]:
                args = frame.get_inputs()
                try:
                    with _RecomputationHook(weakref.ref(frame), gid), torch.autograd.enable_grad():
                        frame.recompute_fn(*args)
                except _StopRecomputationError:
                    pass
                frame.is_recomputed[gid] = True
                frame.check_recomputed_tensors_match(gid)
            assert gid in holder.handles, "a holder the recompute never reached"
            if holder.handles[gid] is None:
                extra = ""
                if torch._C._get_graph_exec_group() is not None:
                    extra = ("Performing two backward calls that overlap (i.e. require the same "
                             "saved activation in order to compute gradients) is not allowed while "
                             "under the torch.utils.checkpoint.GraphExecGroup context. ")
                raise CheckpointError(
                    "torch.utils.checkpoint: Unpack is being triggered for a tensor that was already "
                    f"unpacked once. {extra}If you are calling ctx.saved_tensors in backward, make sure "
                    "to do so only once. Otherwise please open an issue with details on your use case.")
            ret = frame.recomputed[gid][holder.handles[gid]]
            holder.handles[gid] = None
            return ret

        super().__init__(pack_hook, unpack_hook)


def _recompute_fn(fn: Callable[..., Any], inputs: tuple, kwargs: dict, preserve_rng_state: bool,
                  device_type: str, recompute_context: ContextManager) -> Callable[..., None]:
    """The frame's recompute, captured now as torch's generator captures it: ``fn(*args,
    **kwargs)`` (``args``: the frame's saved ``inputs``) from the RNG states of now (CPU, and of
    the devices ``inputs`` sit on when the device is initialized; both restored afterwards), under
    the autocast state of now, ``recompute_context`` and the ``torch.device`` context of now.
    Its ``had_device`` says whether the device's RNG states were kept."""
    device_module = torch_checkpoint._get_device_module(device_type)
    device_autocast_kwargs, cpu_autocast_kwargs = _get_autocast_kwargs(device_type=device_type)
    had_device = preserve_rng_state and getattr(device_module, "_initialized", False)
    cpu_state = torch.get_rng_state() if preserve_rng_state else None
    devices, device_states = get_device_states(*inputs) if had_device else ([], [])
    device_ctx = next((m for m in reversed(_get_current_function_mode_stack()) if isinstance(m, DeviceContext)),
                      contextlib.nullcontext())

    def recompute_fn(*args: Any) -> None:
        with torch.random.fork_rng(devices=devices, enabled=preserve_rng_state, device_type=device_type):
            if preserve_rng_state:
                torch.set_rng_state(cpu_state)
                if had_device:
                    set_device_states(devices, device_states, device_type=device_type)
            device_autocast = (torch.amp.autocast(device_type=device_type, **device_autocast_kwargs)
                               if torch.amp.is_autocast_available(device_type) else contextlib.nullcontext())
            with device_autocast, torch.amp.autocast("cpu", **cpu_autocast_kwargs), recompute_context, device_ctx:
                fn(*args, **kwargs)

    recompute_fn.had_device = had_device  # type: ignore[attr-defined]
    return recompute_fn


def checkpoint_without_reentrant(
    fn: Callable[..., Any], preserve_rng_state: bool = True,
    context_fn: Callable[[], tuple[ContextManager, ContextManager]] = noop_context_fn,
    determinism_check: str = "default", debug: bool = False, early_stop: bool = True,
    *args: Any, **kwargs: Any,
) -> Iterator[None]:
    """torch's ``_checkpoint_without_reentrant_generator`` (same arguments) without dynamo:
    the first ``next`` opens the frame (the ops until the second ``next`` are checkpointed:
    their saved tensors are dropped and recomputed by ``fn(*args, **kwargs)`` in backward).
    ``set_checkpoint_early_stop`` overrides ``early_stop`` as for torch's. Raises ValueError
    for an unknown ``determinism_check`` or ``debug`` (torch's frame serves it:
    ``needs_torch_frame``), RuntimeError as torch's when the device is first initialized
    inside the forward or ``context_fn``'s forward context suppresses an exception."""
    if debug:
        raise ValueError("debug=True needs torch's checkpoint (torch.utils.checkpoint.checkpoint)")
    checks = torch_checkpoint._allowed_determinism_checks_to_fns
    if determinism_check not in checks:
        raise ValueError(f"determinism_check should be one of {list(checks)}, but got {determinism_check}")
    device_type = _infer_device_type(*args)
    forward_context, recompute_context = context_fn()
    recompute_fn = _recompute_fn(fn, args, kwargs, preserve_rng_state, device_type, recompute_context)
    flag = torch_checkpoint._enable_checkpoint_early_stop
    frame = _CheckpointFrame(recompute_fn, flag if flag is not None else early_stop, None, checks[determinism_check])
    if not torch.is_grad_enabled():
        yield
        return
    frame.save_inputs(*args)
    suppressed = False
    with _CheckpointHook(frame), forward_context:
        try:
            yield
        except BaseException:
            suppressed = True
            raise
    if suppressed:
        raise RuntimeError(
            "torch.utils.checkpoint: the forward context provided by context_fn suppressed an exception "
            "raised during the checkpointed forward. This is not supported because checkpoint "
            "cannot return a value for a failed forward.")
    frame.forward_completed = True
    device_module = torch_checkpoint._get_device_module(device_type)
    if getattr(device_module, "_initialized", False) and preserve_rng_state and not recompute_fn.had_device:
        raise RuntimeError(
            "PyTorch's device state was initialized in the forward pass of a Checkpoint, which is not "
            "allowed. Please open an issue if you need this feature.")


class _EagerCachingMode(_CachingTorchDispatchMode):
    """torch's forward-side selective mode (caches the outputs its policy keeps) with its
    ``__torch_dispatch__`` as written: not wrapped for dynamo."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    __torch_dispatch__ = undecorated(_CachingTorchDispatchMode.__torch_dispatch__)


class _EagerCachedMode(_CachedTorchDispatchMode):
    """torch's recompute-side selective mode (replays from that cache), not wrapped for dynamo."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    __torch_dispatch__ = undecorated(_CachedTorchDispatchMode.__torch_dispatch__)


def selective_contexts(policy_fn: Callable[..., Any]) -> tuple[ContextManager, ContextManager]:
    """torch's ``create_selective_checkpoint_contexts(policy_fn)``: the forward's caching mode
    and the recompute's cached mode, sharing one cache. Where ``needs_torch_frame`` is False
    they are of ``_EagerCachingMode`` / ``_EagerCachedMode`` (the same instances, re-classed:
    still instances of torch's classes), so no op imports ``torch._dynamo``."""
    caching, cached = create_selective_checkpoint_contexts(policy_fn)
    if not needs_torch_frame():
        caching.__class__, cached.__class__ = _EagerCachingMode, _EagerCachedMode
    return caching, cached
