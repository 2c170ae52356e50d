"""Precision policy: which dtype each kind of tensor lives and computes in.

One object answers every dtype question the engine asks, so the choice of
``precision.mode`` is made in exactly one place.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager

import torch

from mct.config import PrecisionConfig
from mct.precision.cpu_matmul import matmul_kernels

MODE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


@dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """Dtypes for one precision mode.

    - ``param_dtype``: working parameters and their gradients (what forward/backward see).
    - ``compute_dtype``: autocast dtype for matmuls; equal to ``param_dtype`` here.
    - ``reduce_dtype``: dtype gradients are reduced across ranks in.
    - ``master_dtype``: always float32; the optimizer steps on fp32 master weights.

    Build it with ``from_config`` or ``for_mode``; the constructor validates the
    dtypes and raises ``ValueError`` naming the bad one.
    """

    mode: str
    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    master_dtype: torch.dtype = torch.float32
    cpu_matmul: str = "auto"
    """'auto' | 'native' | 'fp32': kernels for low-precision matmuls on a CPU (see ``kernels``)."""

    def __post_init__(self) -> None:
        if MODE_DTYPES.get(self.mode) is not self.param_dtype:
            raise ValueError(
                f"precision mode {self.mode!r} with param_dtype {self.param_dtype} is not allowed: "
                f"choose one of {', '.join(f'{m}={d}' for m, d in MODE_DTYPES.items())}")
        if self.compute_dtype is not self.param_dtype:
            raise ValueError(f"compute_dtype {self.compute_dtype} must equal param_dtype {self.param_dtype}")
        if self.reduce_dtype not in (torch.float32, self.param_dtype):
            raise ValueError(f"reduce_dtype {self.reduce_dtype} is not allowed: choose torch.float32 "
                             f"or the param dtype {self.param_dtype}")
        if self.master_dtype is not torch.float32:
            raise ValueError(f"master_dtype must be torch.float32, got {self.master_dtype}")

    @classmethod
    def for_mode(cls, mode: str, reduce_dtype: str = "fp32", cpu_matmul: str = "auto") -> "PrecisionPolicy":
        """``mode`` in fp32/bf16/fp16; ``reduce_dtype`` 'fp32' or 'param' (the working dtype).
        Raises ValueError naming the bad value."""
        if mode not in MODE_DTYPES:
            raise ValueError(f"precision.mode = {mode!r} is not allowed: choose 'fp32', 'bf16' or 'fp16'")
        if reduce_dtype not in ("fp32", "param"):
            raise ValueError(f"precision.reduce_dtype = {reduce_dtype!r} is not allowed: choose 'fp32' or 'param'")
        dtype = MODE_DTYPES[mode]
        return cls(mode=mode, param_dtype=dtype, compute_dtype=dtype,
                   reduce_dtype=torch.float32 if reduce_dtype == "fp32" else dtype, cpu_matmul=cpu_matmul)

    @classmethod
    def from_config(cls, cfg: PrecisionConfig) -> "PrecisionPolicy":
        """The policy for a ``[precision]`` config section."""
        return cls.for_mode(cfg.mode, reduce_dtype=cfg.reduce_dtype, cpu_matmul=cfg.cpu_matmul)

    @property
    def has_master(self) -> bool:
        """True when working params are not fp32, so a separate fp32 master copy is needed."""
        return self.param_dtype is not torch.float32

    def autocast(self, device_type: str | torch.device) -> ContextManager[None]:
        """``torch.autocast(device_type, dtype=compute_dtype)`` for bf16/fp16, a no-op
        context for fp32. ``device_type`` may be 'cpu', 'cuda' or a ``torch.device``.

        Autocast runs matmuls in the compute dtype. On CPU it also leaves softmax and
        norms in that dtype (CUDA autocast would promote them), so the model computes
        those in fp32 itself; see docs/precision.md.
        """
        if not self.has_master:
            return contextlib.nullcontext()
        return torch.autocast(torch.device(device_type).type, dtype=self.compute_dtype)

    def kernels(self, device_type: str | torch.device) -> ContextManager:
        """The context forward, backward (with recompute) and evaluation run in: on a CPU
        without native bf16/fp16 units, low-precision matmuls run on fp32 kernels and are
        rounded back (``mct.precision.cpu_matmul``); a no-op everywhere else."""
        return matmul_kernels(self.cpu_matmul, torch.device(device_type).type, self.compute_dtype)
