"""A parameter's initial values a chunk of elements at a time, bit for bit the values of
the whole construction (``mct.task.init_program``).

Replaying a parameter whole (``InitProgram.materialize``) holds all of it on the host in
its construction dtype: an 8B model's untied head is 1.96 GiB of fp32 before a frozen
unit keeps 1/N of it in bf16. Most constructions write a parameter by a chain this
module replays a chunk at a time instead (``chain_of``):

- one factory makes the storage (``empty``, ``zeros``, ``ones``, ``full``), contiguous,
  with no tensor argument;
- then in-place ops on contiguous element ranges of it, with no other tensor argument:
  deterministic elementwise ones (``zero_``, ``fill_``, any op tagged pointwise), and
  random fills over the whole storage whose draws are prefix-consistent
  (``normal_``, ``uniform_``).

A random fill is prefix-consistent when filling elements [0, n) in consecutive chunks,
the generator carried from chunk to chunk, gives the same bits and leaves the generator
in the same state as one fill of [0, n). torch's CPU ``uniform_`` draws one number per
element in order; its ``normal_`` draws a uniform per element, transforms blocks of 16,
and redraws the last 16 when n is not a multiple of 16, so chunks hold multiples of 16
elements and the last one at least 16 (``chunk_bounds``). That is checked rather than
assumed: each (op, dtype, arguments) is probed once per process on a small tensor, whole
against chunked (``prefix_consistent``). Each random op replays on a generator of its own,
set to the state recorded before it, so chunks of different parameters never share one.
An op that fails the probe, or any other chain (an op reading another tensor, a random
fill of part of a storage, a user's own ``Generator``), is replayed whole, as before.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.utils._pytree import tree_flatten

INIT_CHUNK = 1 << 22
"""Elements per chunk (16 MiB of fp32): a multiple of 16 (``normal_``'s block)."""
FACTORIES = {"empty": None, "zeros": 0.0, "ones": 1.0}
"""Factories by name -> the value they fill with (None: none); ``full`` fills its argument."""
CHUNKED_RANDOM = frozenset({"normal_", "uniform_"})
"""Random fills that may be replayed in chunks (each is probed first)."""
_PROBE = (1000, 320)  # probe elements and chunk: chunks 320, 320, 360 (the last merged, not a multiple of 16)


def chunk_bounds(n: int, chunk: int = INIT_CHUNK) -> list[tuple[int, int]]:
    """[a, b) element ranges covering [0, n) in order: ``chunk`` elements each (a multiple of
    16), the last one merged into the one before when it would hold fewer than 16."""
    assert chunk >= 16 and chunk % 16 == 0, chunk
    bounds = [(a, min(a + chunk, n)) for a in range(0, n, chunk)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < 16:
        bounds.pop()
        bounds[-1] = (bounds[-1][0], n)
    return bounds


def _name(func: Any) -> str:
    return func._schema.name.split("::")[-1]


def contiguous(ref: Any) -> bool:
    """Whether a recorded view (``_Ref``) is a contiguous run of its storage's elements."""
    expected, stride = [], 1
    for size in reversed(ref.size):
        expected.append(stride)
        stride *= size
    return all(s == e for s, e, size in zip(ref.stride, reversed(expected), ref.size) if size != 1)


def _numel(ref: Any) -> int:
    return math.prod(ref.size)


def _has_ref(values: Any) -> bool:
    return any(isinstance(v, Ref) for v in tree_flatten(values)[0])


@dataclass(frozen=True)
class Ref:
    """A recorded tensor argument: a view (size, stride, offset) of recorded storage ``key``."""

    key: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass(frozen=True)
class Step:
    """An in-place op of a chain, on storage elements [lo, hi)."""

    op: Any
    lo: int
    hi: int


@dataclass(frozen=True)
class Chain:
    """How a storage of ``numel`` elements of ``dtype`` is written: filled with ``fill``
    (None: left as allocated), then ``steps`` in order."""

    numel: int
    dtype: torch.dtype
    fill: float | None
    steps: tuple[Step, ...]


def _factory(op: Any, key: int) -> tuple[int, torch.dtype, float | None] | None:
    """(numel, dtype, fill) of a factory op that creates storage ``key`` contiguous, or None."""
    name = _name(op.func)
    refs = [r for _, r in op.outputs if r.key == key]
    if op.reads or len(refs) != 1 or refs[0].offset != 0 or not contiguous(refs[0]):
        return None
    if name in FACTORIES:
        return _numel(refs[0]), refs[0].dtype, FACTORIES[name]
    if name == "full" and len(op.args) > 1 and isinstance(op.args[1], (int, float, bool)):
        return _numel(refs[0]), refs[0].dtype, float(op.args[1])
    return None


def _step(op: Any, key: int, numel: int) -> Step | None:
    """``op`` as a step of a chain on storage ``key`` (``numel`` elements), or None when it
    cannot be replayed a chunk at a time."""
    target = op.args[0] if op.args else None
    if (not isinstance(target, Ref) or target.key != key or op.outputs or op.reads != {key}
            or op.writes != {key} or _has_ref((op.args[1:], op.kwargs)) or not contiguous(target)):
        return None
    lo, hi = target.offset, target.offset + _numel(target)
    name = _name(op.func)
    if op.random:
        return Step(op, lo, hi) if hi - lo == numel and _fills_whole_in_chunks(op) else None
    if name in ("zero_", "fill_") or (name.endswith("_") and torch.Tag.pointwise in op.func.tags):
        return Step(op, lo, hi)
    return None


def _kw(kwargs: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in kwargs.items() if k != "generator"))


def _fills_whole_in_chunks(op: Any) -> bool:
    """Whether the random ``op`` fills a whole contiguous storage (its first argument, from
    offset 0), reads no other tensor, draws from the default generator, and is
    prefix-consistent: what both its replay (``_step``) and its advance at record time
    (``advance_chunked``) may run a chunk at a time."""
    target = op.args[0] if op.args else None
    return (isinstance(target, Ref) and _name(op.func) in CHUNKED_RANDOM and target.offset == 0
            and contiguous(target) and not _has_ref((op.args[1:], op.kwargs))
            and op.kwargs.get("generator") is None
            and prefix_consistent(op.func, target.dtype, tuple(op.args[1:]), _kw(op.kwargs)))


def chain_of(ops: list[Any], key: int) -> Chain | None:
    """The chain that writes storage ``key`` in the recorded ``ops``, or None when it is not
    one this module replays in chunks (see the module docstring)."""
    writers = [op for op in ops if key in op.writes]
    if not writers:
        return None
    made = _factory(writers[0], key)
    if made is None:
        return None
    numel, dtype, fill = made
    steps = [_step(op, key, numel) for op in writers[1:]]
    if any(s is None for s in steps):
        return None
    return Chain(numel, dtype, fill, tuple(steps))  # type: ignore[arg-type]


def _call(op: Any, target: torch.Tensor, generator: torch.Generator | None) -> None:
    args = tuple(torch.device("cpu") if isinstance(a, torch.device) else a for a in op.args[1:])
    kwargs = {k: (torch.device("cpu") if isinstance(v, torch.device) else v) for k, v in op.kwargs.items()}
    if generator is not None:
        kwargs["generator"] = generator
    op.func(target, *args, **kwargs)


def replay(chain: Chain, lo: int, hi: int, chunk: int = INIT_CHUNK) -> Iterator[tuple[int, torch.Tensor]]:
    """(start, values) of storage elements [lo, hi) of ``chain`` in order: CPU tensors of the
    chain's dtype, each a view of one reused buffer (copy it before drawing the next). Every
    chunk before ``hi`` is computed (the random ops' draws before ``lo`` included); none after.
    ``chunk``: elements per chunk (``chunk_bounds``)."""
    bounds = chunk_bounds(chain.numel, chunk)
    if not bounds:
        return
    buf = torch.empty(max(b - a for a, b in bounds), dtype=chain.dtype)
    generators = {}
    for s in chain.steps:
        if s.op.random:
            g = torch.Generator()
            g.set_state(s.op.rng_state)
            generators[id(s)] = g
    for a, b in bounds:
        if a >= hi:
            return
        v = buf[:b - a]
        if chain.fill is not None:
            v.fill_(chain.fill)
        for s in chain.steps:
            x, y = max(a, s.lo), min(b, s.hi)
            if x < y:
                _call(s.op, v[x - a:y - a], generators.get(id(s)))
        x, y = max(a, lo), min(b, hi)
        if x < y:
            yield x, v[x - a:y - a]


def advance_chunked(op: Any) -> bool:
    """Run the random ``op`` (its first argument a whole contiguous storage) on a scratch
    chunk at a time with the default generator, moving it exactly as one whole call would;
    False (nothing run) when the op is not one that may be chunked."""
    target = op.args[0] if op.args else None
    if not isinstance(target, Ref) or _numel(target) <= INIT_CHUNK or not _fills_whole_in_chunks(op):
        return False
    bounds = chunk_bounds(_numel(target), INIT_CHUNK)
    buf = torch.empty(max(b - a for a, b in bounds), dtype=target.dtype)
    for a, b in bounds:
        _call(op, buf[:b - a], None)
    return True


@functools.lru_cache(maxsize=None)
def prefix_consistent(func: Any, dtype: torch.dtype, args: tuple, kwargs: tuple) -> bool:
    """Whether the random in-place ``func(t, *args, **kwargs)`` on ``dtype`` gives the same bits
    and the same final generator state filled whole as filled in ``chunk_bounds`` chunks
    (probed on a small tensor with a chunk size of its own; cached per process)."""
    n, chunk = _PROBE
    op = _Probe(func, args, dict(kwargs))
    results = []
    for bounds in ([(0, n)], chunk_bounds(n, chunk)):
        g = torch.Generator().manual_seed(20261205)
        t = torch.empty(n, dtype=dtype)
        try:
            for a, b in bounds:
                _call(op, t[a:b], g)
        except (RuntimeError, TypeError):
            return False
        results.append((t, g.get_state()))
    (whole, g1), (parts, g2) = results
    same = whole.view(torch.uint8).equal(parts.view(torch.uint8))
    return bool(same and g1.equal(g2))


@dataclass(frozen=True)
class _Probe:
    """An op as ``_call`` takes it, for the probe (no recorded target)."""

    func: Any
    args_tail: tuple
    kwargs: dict

    @property
    def args(self) -> tuple:
        return (None, *self.args_tail)
