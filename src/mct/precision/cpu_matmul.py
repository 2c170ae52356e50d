"""Low-precision matrix multiplies on CPUs without native bf16/fp16 units.

On a CPU with AVX512-BF16/AMX, oneDNN multiplies bf16 matrices natively and bf16 is
faster than fp32. Without them (e.g. an AVX2-only CPU), torch falls back to a generic
bf16 kernel that measured 25-40x slower than fp32 on the default GPT's shapes
(docs/precision.md). ``UpcastMatmul`` then runs each bf16/fp16 matrix multiply with
fp32 kernels and rounds the result back: the inputs are exact in fp32 and a native
kernel accumulates in fp32 too, so the result equals the native one up to summation
order, while activations, gradients and working parameters stay low precision.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

aten = torch.ops.aten

LOW = (torch.bfloat16, torch.float16)
# op -> which outputs a native low-precision call returns in the low dtype (None: all).
# SDPA's CPU flash kernels are included: in bf16 on an AVX2 CPU their backward took 28% of
# a step, against a few percent in fp32; their logsumexp output is fp32 either way.
UPCAST_OPS: dict = {aten.mm.default: None, aten.addmm.default: None, aten.bmm.default: None,
                    aten.baddbmm.default: None,
                    aten._scaled_dot_product_flash_attention_for_cpu.default: (0,),
                    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: None}
CHOICES = ("auto", "native", "fp32")


def cpu_has_native_low_precision(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dtype`` (bf16/fp16) matrices natively through oneDNN
    (AVX512-BF16/AMX; AVX512-FP16/AMX-FP16). False when torch cannot tell."""
    try:
        if dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        if dtype == torch.float16:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):  # builds without oneDNN
        pass
    return False


def use_fp32_kernels(choice: str, device_type: str, dtype: torch.dtype) -> bool:
    """``precision.cpu_matmul = choice``: should ``dtype`` matmuls on ``device_type`` run
    on fp32 kernels? 'auto' = yes on a CPU without native ``dtype`` units."""
    if choice not in CHOICES:
        raise ValueError(f"precision.cpu_matmul = {choice!r} is not allowed: choose one of {', '.join(CHOICES)}")
    if device_type != "cpu" or dtype not in LOW or choice == "native":
        return False
    return choice == "fp32" or not cpu_has_native_low_precision(dtype)


class UpcastMatmul(TorchDispatchMode):
    """Runs the ops of ``UPCAST_OPS`` whose first operand is a bf16/fp16 CPU tensor on
    fp32 kernels and rounds the outputs a native call would return in that dtype back to
    it. Every other op passes through untouched. Active around forward, backward and
    recompute; ``calls`` counts what it upcast.

    Every op dispatched under it, upcast or not, pays a Python call (15-30 us on a CPU,
    ``extra['python_mode_op_s']`` of the machine profile): ``dispatched`` counts them in this
    process, across instances, so that the planner's dry run can count a step's
    (``StepWork.modes``) and its time model charge them."""

    dispatched = 0
    """Ops dispatched under any ``UpcastMatmul`` in this process."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace != "prim":  # a fake tensor's device query, which a real step never dispatches
            UpcastMatmul.dispatched += 1
        kwargs = kwargs or {}
        if func not in UPCAST_OPS or args[0].dtype not in LOW or args[0].device.type != "cpu":
            return func(*args, **kwargs)
        dtype = args[0].dtype
        self.calls += 1
        out = func(*tree_map(lambda t: _cast(t, dtype, torch.float32), args),
                   **tree_map(lambda t: _cast(t, dtype, torch.float32), kwargs))
        if isinstance(out, torch.Tensor):
            return _cast(out, torch.float32, dtype)
        low = UPCAST_OPS[func]
        return type(out)(_cast(t, torch.float32, dtype) if low is None or i in low else t for i, t in enumerate(out))


def _cast(t, src: torch.dtype, dst: torch.dtype):
    """``t`` as ``dst`` when it is a ``src`` tensor. Inside a dispatch mode ``t.to()``
    reaches the modes below as ``aten.to`` (an op that may alias), which a storage
    counter such as the memory tracker does not count as new; ``_to_copy`` always
    allocates, so every temporary here is counted."""
    return aten._to_copy.default(t, dtype=dst) if isinstance(t, torch.Tensor) and t.dtype == src else t


def matmul_kernels(choice: str, device_type: str, dtype: torch.dtype) -> ContextManager:
    """The context that forward, backward and evaluation run in: ``UpcastMatmul`` where
    ``use_fp32_kernels`` says so, else a no-op."""
    return UpcastMatmul() if use_fp32_kernels(choice, device_type, dtype) else contextlib.nullcontext()
