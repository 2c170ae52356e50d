"""Build a model on the meta device and materialize its parameters a few at a time,
with exactly the values a normal construction with the same seed gives.

``record_init(model_fn)`` runs ``model_fn()`` under ``torch.device('meta')`` inside a
dispatch mode that records every ATen op the construction runs (factories such as
``empty``/``ones``/``randn``, in-place initializers such as ``normal_``/``uniform_``/
``zero_``, and any op that computes a tensor from others), with each tensor argument
named by (storage, size, stride, offset). Nothing is allocated. Then, in one pass, it
replays only the random ops, in order, on scratch tensors of their shapes (one at a
time, freed at once): that advances the CPU generator exactly as the real
construction did, and records the generator state before each random op.

``InitProgram.materialize(params)`` replays, in the original order, the ops that write
the storages behind ``params`` (and, transitively, what those ops read), restoring the
recorded generator state before each random op, and points each parameter at its
real values. So unit k gets the values of the k-th slice of the normal model, while
the other units' parameters stay on meta. At the end the generator is left where a
normal construction leaves it.

Limits (checked, ValueError): a model whose construction reads tensor *values* on
the host (``.item()``, data-dependent control flow) cannot be built on meta. Ops are
taken as random by name (``RANDOM_INIT_OPS``) or by a ``Generator`` argument in the schema.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from mct.task import init_chunks
from mct.task.init_chunks import Ref as _Ref, advance_chunked, chain_of, chunk_bounds, contiguous, replay

RANDOM_INIT_OPS = frozenset({
    "normal", "normal_", "uniform", "uniform_", "bernoulli", "bernoulli_", "random_", "exponential_",
    "geometric_", "log_normal_", "cauchy_", "rand", "randn", "randint", "randperm", "rand_like", "randn_like",
    "randint_like", "multinomial", "poisson", "native_dropout", "dropout", "_standard_gamma",
})


@dataclass
class _Op:
    func: Any
    args: Any
    kwargs: Any
    reads: frozenset[int]
    writes: frozenset[int]
    outputs: list[tuple[int, _Ref]]   # (position in the flattened output, the fresh storage it holds)
    random: bool
    rng_state: torch.Tensor | None = None


def _is_random(func) -> bool:
    name = func._schema.name.split("::")[-1]
    if name in RANDOM_INIT_OPS:
        return True
    return any("Generator" in str(a.type) for a in func._schema.arguments)


class _Recorder(TorchDispatchMode):
    """Records every op of a construction on meta. Not wrapped for dynamo where nothing
    has loaded it (``_recorder``; as ``mct.memory.tracker._CountingMode``): torch wraps a
    dispatch mode's ``__torch_dispatch__`` in ``torch._disable_dynamo`` unless this says
    False, and that wrapper imports torch._dynamo (about 70 MiB resident) on the first op."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[_Op] = []
        self.keep: list[torch.Tensor] = []   # meta tensors alive: storage addresses stay unique

    @staticmethod
    def _ref(t: torch.Tensor) -> _Ref:
        return _Ref(t.untyped_storage()._cdata, tuple(t.size()), tuple(t.stride()), t.storage_offset(), t.dtype)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # a random fill of a meta tensor in place returns the tensor and computes nothing: not
        # run (its meta kernel, torch._refs, imports torch._dynamo); recorded below as any op
        out = args[0] if _fills_in_place(func, args) else func(*args, **kwargs)
        flat_in = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        for t in flat_in:
            if t.device.type != "meta":
                raise ValueError(f"model construction mixes a real tensor into {func} on the meta device; "
                                 f"build it without meta initialization")
        in_keys = {t.untyped_storage()._cdata for t in flat_in}
        mutated = {self._ref(a).key for a, s in zip(args, func._schema.arguments)
                   if isinstance(a, torch.Tensor) and s.alias_info is not None and s.alias_info.is_write}
        flat_out = tree_flatten(out)[0]
        fresh = [(i, self._ref(t)) for i, t in enumerate(flat_out)
                 if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in in_keys]
        if not fresh and not mutated:
            return out  # a view or a metadata query: described by the refs of later ops
        self.keep += [t for t in flat_out if isinstance(t, torch.Tensor)] + flat_in
        self.ops.append(_Op(func, tree_map(lambda a: self._ref(a) if isinstance(a, torch.Tensor) else a, args),
                            tree_map(lambda a: self._ref(a) if isinstance(a, torch.Tensor) else a, kwargs),
                            frozenset(in_keys), frozenset(mutated | {r.key for _, r in fresh}), fresh,
                            _is_random(func)))
        return out


def _fills_in_place(func: Any, args: tuple) -> bool:
    """Whether ``func`` is a random op that writes its first argument, a meta tensor, in
    place and returns it (``normal_``, ``uniform_``, ...)."""
    schema = func._schema
    first = schema.arguments[0].alias_info if schema.arguments else None
    ret = schema.returns[0].alias_info if len(schema.returns) == 1 else None
    return (_is_random(func) and bool(args) and isinstance(args[0], torch.Tensor) and args[0].is_meta
            and first is not None and first.is_write and ret is not None and ret.is_write)


def _on_cpu(value: Any) -> Any:
    return torch.device("cpu") if isinstance(value, torch.device) and value.type == "meta" else value


class InitProgram:
    """The recorded construction of one model (see the module docstring)."""

    def __init__(self, ops: list[_Op], final_rng: torch.Tensor) -> None:
        self.ops, self.final_rng = ops, final_rng

    def _needed(self, keys: set[int]) -> set[int]:
        needed, changed = set(keys), True
        while changed:
            changed = False
            for op in self.ops:
                if op.writes & needed and not op.reads <= needed:
                    needed |= op.reads
                    changed = True
        return needed

    def _replay(self, todo: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """The storages behind ``todo`` (meta tensors) with their real values, computed on the
        CPU by replaying whole what writes them (and what that reads); leaves the CPU
        generator where construction left it."""
        needed = self._needed({p.untyped_storage()._cdata for p in todo})
        real: dict[int, torch.Tensor] = {}

        def view(a: Any) -> Any:
            if not isinstance(a, _Ref):
                return _on_cpu(a)
            if a.key not in real:
                raise ValueError("a parameter's construction reads a tensor the meta device holds no values for "
                                 "(e.g. torch.tensor(...) of constants): build the model without meta init")
            return real[a.key].as_strided(a.size, a.stride, a.offset)
        try:
            for op in self.ops:
                if not op.writes & needed:
                    continue
                if op.random:
                    torch.set_rng_state(op.rng_state)
                out = op.func(*tree_map(view, op.args), **tree_map(view, op.kwargs))
                flat = tree_flatten(out)[0]
                for i, ref in op.outputs:
                    real[ref.key] = flat[i]
        finally:
            torch.set_rng_state(self.final_rng)
        return real

    def materialize(self, params: list[torch.Tensor], device: torch.device | str = "cpu") -> None:
        """Give every meta tensor in ``params`` (parameters or buffers) its real values,
        computed on the CPU as the normal construction computed them, then moved to
        ``device``. Others are left as they are. Swaps each tensor's contents in place
        (the Python objects stay); leaves the CPU generator where construction left it."""
        todo = [p for p in params if p.device.type == "meta"]
        if not todo:
            return
        real = self._replay(todo)
        with torch.no_grad():
            for p in todo:
                r = _Recorder._ref(p)
                values = real[r.key].as_strided(r.size, r.stride, r.offset).to(device)
                # A meta tensor cannot take CPU data (``.data =`` refuses the device
                # change): swap the whole tensor, keeping the Python object (and so
                # every module attribute, tie and optimizer group that holds it).
                new = nn.Parameter(values, requires_grad=p.requires_grad) if isinstance(p, nn.Parameter) else values
                torch.utils.swap_tensors(p, new)

    def chunks(self, p: torch.Tensor, chunk: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        """(start, values) of the meta tensor ``p``'s flattened elements, in order: CPU tensors
        of ``p``'s dtype with exactly the values of the normal construction, each valid until
        the next is drawn (copy it). Where the construction allows (``mct.task.init_chunks``)
        no more than one chunk of ``p`` exists at a time; else ``p`` is replayed whole first.
        ``p`` stays on meta; the CPU generator is not touched. ``chunk``: elements per chunk
        (default ``mct.task.init_chunks.INIT_CHUNK``, read at the call)."""
        chunk = chunk or init_chunks.INIT_CHUNK
        r = _Recorder._ref(p)
        chain = chain_of(self.ops, r.key) if contiguous(r) else None
        n = math.prod(r.size)
        if chain is not None and chain.dtype == r.dtype:
            for start, values in replay(chain, r.offset, r.offset + n, chunk):
                yield start - r.offset, values
            return
        flat = self._replay([p])[r.key].as_strided(r.size, r.stride, r.offset).reshape(-1)
        for a, b in chunk_bounds(n, chunk):
            yield a, flat[a:b]


def _advance(ops: list[_Op]) -> None:
    """Run each random op once on scratch tensors, recording the generator state
    before it: the CPU generator moves exactly as in a normal construction."""
    def scratch(a: Any) -> Any:
        if isinstance(a, _Ref):
            return torch.empty_strided(a.size, a.stride, dtype=a.dtype)
        return _on_cpu(a)
    for op in ops:
        if op.random:
            op.rng_state = torch.get_rng_state()
            if not advance_chunked(op):  # a whole-storage fill: a chunk of scratch at a time
                op.func(*tree_map(scratch, op.args), **tree_map(scratch, op.kwargs))


class _DynamoSafeRecorder(_Recorder):
    """``_Recorder`` with ``__torch_dispatch__`` wrapped as torch wraps every dispatch mode's."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return True

    __torch_dispatch__ = _Recorder.__torch_dispatch__


def record_init(model_fn: Callable[[], nn.Module]) -> tuple[nn.Module, InitProgram]:
    """Build ``model_fn()`` on the meta device; returns the model (every parameter and
    buffer on meta) and the program that materializes any of them. Seed the CPU
    generator before calling, as for a normal construction; it is left as the normal
    construction would leave it. Raises ValueError if construction reads values."""
    rec = (_DynamoSafeRecorder if "torch._dynamo" in sys.modules else _Recorder)()
    try:
        with torch.device("meta"), rec:
            model = model_fn()
    except NotImplementedError as e:
        raise ValueError(f"the model's construction reads tensor values, which the meta device does not "
                         f"have ({e}); build it without meta initialization") from None
    _advance(rec.ops)
    return model, InitProgram(rec.ops, torch.get_rng_state())


def probe_stand_ins(groups: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[int, nn.Parameter]]:
    """Meta parameters (a model built by ``record_init``) are shown to the optimizer
    factory as memoryless CPU tensors of the same shapes: a factory may refuse meta
    tensors (fused AdamW checks devices). Returns the groups and stand-in id -> param."""
    if not any(p.device.type == "meta" for g in groups for p in g["params"]):
        return groups, {}
    real_of: dict[int, nn.Parameter] = {}
    out = []
    for g in groups:
        params = []
        for p in g["params"]:
            s = nn.Parameter(torch.zeros((), dtype=p.dtype).expand(p.shape), requires_grad=p.requires_grad)
            real_of[id(s)] = p
            params.append(s)
        out.append({**g, "params": params})
    return out, real_of


def place_model(model: nn.Module, device: torch.device, program: InitProgram | None) -> nn.Module:
    """``model`` on ``device`` for the engine. Built normally: moved, but only what is
    elsewhere (``Module.to`` re-wraps every tensor, which fake tensors, the planner's
    dry runs, refuse once something holds a weakref to them). Built on meta
    (``program``): what no flat unit packs (buffers) is materialized now; the trainable
    and frozen units (``mct.zero.frozen``) materialize the parameters as they are packed."""
    if program is None:
        if any(t.device != device for t in (*model.parameters(), *model.buffers())):
            model.to(device)
        return model
    program.materialize(list(model.buffers()), device)
    return model
