"""A model built on the meta device without running its random initializers.

Building a model under ``torch.device('meta')`` gives its parameters' shapes and dtypes
with no storage, but its initializers still run: ``nn.init.normal_`` and
``Tensor.uniform_`` on a meta tensor go through torch's Python reference kernels, whose
first call imports ``torch._dynamo`` (about a second, more than the build itself). On the
meta device they have nothing to fill, so ``build_on_meta`` answers them with the tensor
itself. Everything else in the constructor (shapes, ties, buffers, non-random fills)
runs as under ``torch.device('meta')`` alone, and no random stream is touched either way
(meta tensors draw nothing).

Not for ``mct.task.init_program``, which records a model's initializers on the meta
device to replay them on real storage: it builds under ``torch.device('meta')`` itself.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from mct.config import EngineConfig

_INITIALIZERS = frozenset(getattr(nn.init, name) for name in (
    "normal_", "uniform_", "trunc_normal_", "xavier_normal_", "xavier_uniform_", "kaiming_normal_",
    "kaiming_uniform_", "orthogonal_", "sparse_"))
_RANDOM_FILLS = frozenset((torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.random_,
                           torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.log_normal_,
                           torch.Tensor.cauchy_, torch.Tensor.bernoulli_))


class _SkipRandomInitOnMeta(TorchFunctionMode):
    """Random initializers of a meta tensor return the tensor, unfilled."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _INITIALIZERS or func in _RANDOM_FILLS:
            # nn.init passes its tensor by keyword (``tensor=``), Tensor methods as self
            target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def build_on_meta(model_fn: Callable[[], Any]) -> Any:
    """``model_fn()`` under ``torch.device('meta')``, its random initializers skipped."""
    with torch.device("meta"), _SkipRandomInitOnMeta():
        return model_fn()


def check_host_memory(cfg: EngineConfig, nproc: int, task: Any) -> None:
    """On CPU, refuse a model whose parameters alone (at 2 or 4 bytes each: nproc copies,
    or one copy split across the ranks at stage 3; a lower bound on what training needs)
    exceed the machine's physical memory, before anything is allocated: allocating it
    would end in swapping or the OOM killer, not an error. Not checked when the
    parameters are offloaded (offload.params) or the planner decides (zero.stage = auto).
    Raises ValueError naming the size and the fix."""
    if torch.cuda.is_available() or not hasattr(os, "sysconf"):
        return
    if cfg.offload.params != "none" or cfg.zero.stage == "auto":
        return
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return
    n = sum(p.numel() for p in build_on_meta(task.model_fn).parameters())
    need = n * cfg.precision.mode.itemsize * (1 if cfg.zero.stage == 3 else nproc)
    if need > ram:
        raise ValueError(f"the model has {n:,} parameters: {need / 2**30:.1f} GiB for the parameters alone on "
                         f"{nproc} worker(s), more than this machine's {ram / 2**30:.1f} GiB of memory; shrink "
                         f"model.n_layer/model.d_model, set zero.stage=3 with offload.optimizer=disk and "
                         f"offload.params=disk, or run `mct plan` for the memory a configuration needs")
