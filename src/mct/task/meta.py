"""A model built on the meta device without running its random initializers.

Building a model under ``torch.device('meta')`` gives its parameters' shapes and dtypes
with no storage, but its initializers still run: ``nn.init.normal_`` and
``Tensor.uniform_`` on a meta tensor go through torch's Python reference kernels, whose
first call imports ``torch._dynamo`` (about a second, more than the build itself). On the
meta device they have nothing to fill, so ``build_on_meta`` answers them with the tensor
itself. Everything else in the constructor (shapes, ties, buffers, non-random fills)
runs as under ``torch.device('meta')`` alone, and no random stream is touched either way
(meta tensors draw nothing).

Not for ``mct.offload.meta_init``, which records a model's initializers on the meta
device to replay them on real storage: it builds under ``torch.device('meta')`` itself.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

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
