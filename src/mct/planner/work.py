"""What one training step does, counted on the dry run's fake tensors: every ATen op
(its FLOPs, the bytes it reads and writes, its dtype), every collective the simulated
communicator was asked for, and the bytes offload moves. Plain counts, independent of
any machine: ``mct.planner.steptime`` turns them into seconds with a machine profile.

``OpCounter`` is a ``TorchDispatchMode`` the dry run enters for its steady-state step
(the second), so it sees the same ops the engine dispatches in a real step: forward,
backward with its recompute, the optimizer, the casts, ZeRO's copies. FLOPs come from
torch's own ``FlopCounterMode`` formulas (``torch.utils.flop_counter.flop_registry``,
plus ``mct.planner.flops.EXTRA_FORMULAS``); bytes are the sizes of the op's tensor
inputs and outputs (each storage once); a view moves nothing.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, shape_wrapper

from mct.checkpointing.policies import SelectiveDispatch
from mct.precision.cpu_matmul import UpcastMatmul

aten = torch.ops.aten


def attention_flops(query, key, value) -> int:
    """FLOPs of one SDPA forward from the shapes of its [B, H, S, D] query, key and value,
    as torch counts it (two matmuls over the full [S_q, S_k] scores, no causal discount).
    Key and value may have fewer heads than the query (grouped-query attention, the kernel
    broadcasts them): every query head is counted. Our own, as torch's formula asserts equal
    heads before 2.13."""
    scores, d_q, d_v = _scores(query, key, value)
    return 2 * scores * (d_q + d_v)


def attention_backward_flops(grad_out, query, key, value) -> int:
    """FLOPs of one SDPA backward, as torch counts it: the scores recomputed, then the
    gradients of both matmuls (five matmuls), every query head counted (see ``attention_flops``)."""
    scores, d_q, d_v = _scores(query, key, value)
    return 2 * scores * (3 * d_q + 2 * d_v)


def _scores(query, key, value) -> tuple[int, int, int]:
    """(elements of the [B, H_q, S_q, S_k] scores, D_q, D_v); ValueError unless all three are
    [B, H, S, D] with the query's heads a multiple of the key's and value's."""
    if (len(query) != 4 or len(key) != 4 or len(value) != 4 or key[1] != value[1] or key[1] < 1
            or query[1] % key[1]):
        raise ValueError(f"attention FLOPs: query {tuple(query)}, key {tuple(key)}, value {tuple(value)} are not "
                         f"[B, H, S, D] with the query's heads a multiple of the key's and value's")
    b, h, s_q, d_q = query
    return b * h * s_q * key[2], d_q, value[3]


def _attention_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return attention_flops(query, key, value)


def _attention_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return attention_backward_flops(grad_out, query, key, value)


def _addmm_inplace_flops(acc, a, b, *args, out_shape=None, **kwargs) -> int:
    return 2 * a[0] * a[1] * b[1]


def _ops(*names: str) -> list:
    return [getattr(aten, n) for n in names if hasattr(aten, n)]


EXTRA_FORMULAS = {**dict.fromkeys(_ops("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                                       "_scaled_dot_product_efficient_attention",
                                       "_scaled_dot_product_cudnn_attention"), _attention_flops),
                  **dict.fromkeys(_ops("_scaled_dot_product_flash_attention_for_cpu_backward",
                                       "_scaled_dot_product_flash_attention_backward",
                                       "_scaled_dot_product_efficient_attention_backward",
                                       "_scaled_dot_product_cudnn_attention_backward"), _attention_backward_flops),
                  aten.addmm_: _addmm_inplace_flops}
"""What torch's counter does not know, or knows only in newer versions. Fake tensors live
on the CPU, whose flash attention kernel it misses (it knows the CUDA ones): counted as
torch counts SDPA, the full [S, S] score matrix (no causal discount), 2 matmuls forward
and 5 backward (the scores recomputed). The CUDA SDPA kernels are counted by the same
formulas, so grouped-query attention (fewer key/value heads) counts alike on every torch
(torch before 2.13 rejects it). ``addmm_``: the in-place matmul chunked cross-entropy
accumulates the head's weight gradient with."""


DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
FORMULAS = {**flop_registry, **{k: shape_wrapper(v) for k, v in EXTRA_FORMULAS.items()}}
RANDOM_OPS = frozenset({aten.bernoulli, aten.bernoulli_, aten.native_dropout, aten.rand, aten.rand_like, aten.randn,
                        aten.randn_like, aten.randint, aten.randint_like, aten.randperm, aten.uniform_, aten.normal_,
                        aten.exponential_, aten.multinomial})
ATTENTION_OPS = {aten._scaled_dot_product_flash_attention_for_cpu: "forward",
                 aten._scaled_dot_product_flash_attention_for_cpu_backward: "backward"}
"""The CPU's fused attention kernels: timed at their own measured rates (``StepWork.attention``),
not a matmul's: in bf16 the backward runs ~10x below a bf16 matmul of its FLOPs here."""
"""Ops that draw random numbers (dropout's masks): each element costs ~50x an add's
bytes on a CPU, so ``OpCounter`` counts the elements they draw apart (``StepWork.random``)."""

ALIAS_OPS = frozenset({aten._unsafe_view, aten.lift_fresh})
"""Ops whose output is their input's storage though their schema does not say so (the
reshape autograd uses, a tensor lifted as it is): they move nothing, as a view."""

def _packets(*names: str) -> frozenset:
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


OP_KINDS: dict[Any, str] = {
    **dict.fromkeys(_packets("add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "neg", "pow", "copy_",
                             "clone", "_to_copy", "fill_", "zero_", "where", "masked_fill", "masked_fill_",
                             "addcmul", "addcmul_", "addcdiv", "addcdiv_", "lerp", "lerp_", "_foreach_add_",
                             "_foreach_mul_", "_foreach_div_", "_foreach_addcmul_", "_foreach_addcdiv_",
                             "_foreach_lerp_", "_foreach_sqrt", "_foreach_add", "_foreach_mul", "_foreach_div",
                             "_foreach_copy_"), "light"),
    **dict.fromkeys(_packets("_softmax", "_log_softmax", "_softmax_backward_data",
                             "_log_softmax_backward_data"), "softmax"),
    **dict.fromkeys(_packets("_safe_softmax"), "safe_softmax"),
    **dict.fromkeys(_packets("native_layer_norm", "native_layer_norm_backward", "_fused_rms_norm",
                             "_fused_rms_norm_backward"), "layer_norm"),
}
"""Elementwise ops timed at their own measured rates (``extra['elementwise_by_kind']``), by
kind: 'light' arithmetic and copies (one pass, bandwidth-bound: several times the rate of the
usual mix in cache), 'softmax' (max, exp-sum, normalize: three passes over a row),
'safe_softmax' (a softmax that also zeroes fully masked rows: several kernels, 3-6x a
softmax here; attention's math path with dropout), 'layer_norm'. Any other op: '', the mix
of ``mct.machine.profile``'s elementwise curve."""

def mode_counts() -> dict[str, int]:
    """{mode: ops dispatched under it so far in this process} of mct's Python dispatch modes
    that a real step runs every forward and backward op through (``precision.cpu_matmul``'s
    ``UpcastMatmul`` on a CPU without native bf16/fp16; torch's selective-checkpoint modes,
    which the forward and the recompute of a 'selective' region run their ops through,
    ``SelectiveDispatch``): ``DryRun.work.modes`` is the steady step's difference."""
    return {"upcast_matmul": UpcastMatmul.dispatched, "selective_checkpoint": SelectiveDispatch.dispatched}


OpKey = tuple[str, int, int, int, str]
"""(dtype name, FLOPs, bytes, smallest matrix dimension, kind) of one op; ('', 0, 0, 0, '')
for a view; the dimension is 0 for an op without FLOPs; the kind one of ``OP_KINDS`` ('' for
the rest). Code that builds keys by hand may leave the kind out (4 fields: '')."""
CommKey = tuple[str, int, int] | tuple[str, int, int, int]
"""(kind, bytes, buckets) of one collective over the world (``mct.zero.comm.SimulatedCollectives.calls``),
or (kind, bytes, buckets, group size) of one within a group of ranks (a context group's,
``mct.context.comm.SimulatedContextComm.calls``)."""


@dataclass(frozen=True)
class StepWork:
    """One rank's steady-state step as counts: ``ops`` {(dtype, FLOPs, bytes, dim, kind): calls},
    ``comm`` {(kind, bytes, buckets): calls}, ``offload`` {tier: bytes moved to and from
    it per step}, ``random`` {elements drawn: calls} of the ``RANDOM_OPS`` (also in ``ops``),
    ``attention`` {(phase, dtype, FLOPs, bytes, dim): calls} of the ``ATTENTION_OPS`` (not in
    ``ops``; in ``n_ops`` and ``flops``), ``modes`` {mode: ops} of those ops that also passed through one
    of mct's own Python dispatch modes (``mode_counts``: a Python call each, beyond the dispatch every op
    pays). Counts of a deep model are linear in its depth (``extend``; an
    extrapolated one's may be negative, its sums are right)."""

    ops: dict[OpKey, int] = field(default_factory=dict)
    comm: dict[CommKey, int] = field(default_factory=dict)
    offload: dict[str, int] = field(default_factory=dict)
    random: dict[int, int] = field(default_factory=dict)
    attention: dict[tuple[str, str, int, int, int], int] = field(default_factory=dict)
    modes: dict[str, int] = field(default_factory=dict)

    @property
    def n_ops(self) -> int:
        return sum(self.ops.values()) + sum(self.attention.values())

    @property
    def flops(self) -> int:
        return (sum(k[1] * n for k, n in self.ops.items())
                + sum(f * n for (_, _, f, _, _), n in self.attention.items()))

    @property
    def bytes_moved(self) -> int:
        """Bytes the ops read and write (each op's ``OpKey`` bytes x calls, the attention's too)."""
        return (sum(k[2] * n for k, n in self.ops.items())
                + sum(b * n for (_, _, _, b, _), n in self.attention.items()))

    @property
    def comm_bytes(self) -> int:
        return sum(key[1] * n for key, n in self.comm.items())

    def plus(self, other: "StepWork", times: int = 1) -> "StepWork":
        """``self + times x other``, count by count (signed: ``times=-1`` subtracts)."""
        out = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            d = {k: a.get(k, 0) + times * b.get(k, 0) for k in set(a) | set(b)}
            out[f.name] = {k: v for k, v in d.items() if v}
        return StepWork(**out)

    def extend(self, larger: list[tuple["StepWork", int]]) -> "StepWork":
        """The counts at full depth: ``A + sum_i m_i (B_i - A)`` for each larger copy
        ``B_i`` added ``m_i`` times (``mct.planner.depth``). Counts are signed: an op whose
        size grows with the depth (the gradient norm over every parameter, the root
        unit's padding) has one key per depth, the smaller's count falls below zero and
        the larger's rises, so any sum over the keys (seconds, bytes, ops) is the linear
        extrapolation of the copies' sums."""
        out = self
        for b, m in larger:
            out = out.plus(b, m).plus(self, -m)
        return out


class OpCounter(TorchDispatchMode):
    """Counts every op dispatched under it (enter it above the fake mode): ``ops``
    {(dtype, FLOPs, bytes, dim, kind): calls}, ``random`` {elements drawn: calls} of the
    ``RANDOM_OPS``, ``attention`` {(phase, dtype, FLOPs, bytes, dim): calls} of the
    ``ATTENTION_OPS`` (apart from ``ops``). Computes nothing itself; each op runs below."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[OpKey] = Counter()
        self.random: Counter[int] = Counter()
        self.attention: Counter[tuple[str, str, int, int, int]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        phase = ATTENTION_OPS.get(func._overloadpacket)
        if phase is None:
            self.ops[op_key(func, args, kwargs, out)] += 1
        else:
            self.attention[(phase, *op_key(func, args, kwargs, out)[:4])] += 1
        if func._overloadpacket in RANDOM_OPS:
            self.random[random_elements(out)] += 1
        return out


def random_elements(out) -> int:
    """The elements a random op drew: its first tensor output's."""
    first = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)
    return 0 if first is None else first.numel()


def op_key(func, args: tuple, kwargs: dict, out) -> OpKey:
    """(dtype, FLOPs, bytes, dim, kind) of one call of ``func``: the dtype of its first floating
    tensor input ('' when none), FLOPs by torch's formulas (0 for ops without one), the
    bytes of its distinct tensor inputs and outputs (0 for a view or an ``ALIAS_OPS`` op), and for an op with
    FLOPs the smallest of its first two tensor inputs' last two dimensions (a matmul's
    short side, an attention head's width: what its speed depends on besides its size), and
    the op's ``OP_KINDS`` kind."""
    if func.is_view or func._overloadpacket in ALIAS_OPS:
        return ("", 0, 0, 0, "")
    formula = FORMULAS.get(func._overloadpacket)
    flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
    seen: set[int] = set()
    nbytes, dtype, mats = 0, "", []
    for t in tree_leaves((args, kwargs, out)):
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            nbytes += t.numel() * t.element_size()
            if not dtype and t.is_floating_point():
                dtype = DTYPE_NAMES.get(t.dtype, str(t.dtype))
            if flops and t.dim() >= 2 and len(mats) < 2:
                mats.append(min(int(t.shape[-1]), int(t.shape[-2])))
    return (dtype, flops, nbytes, min(mats) if mats else 0, "" if flops else OP_KINDS.get(func._overloadpacket, ""))
