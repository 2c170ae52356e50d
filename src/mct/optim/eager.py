"""torch optimizers without ``torch._dynamo``: the same arithmetic, state and hooks.

mct never compiles, but torch's optimizers import ``torch._dynamo`` (about 70 MiB
resident with sympy) on first use: ``Optimizer.add_param_group`` (called by the
constructor), ``zero_grad``, ``state_dict`` and ``load_state_dict`` are wrapped by
``torch._disable_dynamo``, whose wrapper imports it on the first call, and every
``step`` by ``_use_grad_for_differentiable``, which imports it to call
``graph_break()`` (a no-op outside compilation). ``EagerOptimizer`` puts the undecorated
functions (the ``__wrapped__`` that ``functools.wraps`` records) in their place, so an
eager run never loads it; ``AdamW`` is torch's AdamW on that base, its step torch's own
undecorated ``Adam.step`` (single-tensor, foreach or fused, as constructed), so its
bytes, state, ``state_dict`` format and checkpoints are torch's exactly.

Under ``torch.compile`` these methods would be traced instead of skipped; mct does not
compile the optimizer, and a user who does can pass ``torch.optim.AdamW`` as the factory.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from mct.memory.undynamo import undecorated


class EagerOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose dynamo-wrapped methods are the undecorated ones.
    Put it before the torch optimizer in the bases (``class X(EagerOptimizer, torch.optim.Adam)``)
    or subclass it directly; its ``step`` is the subclass's own."""

    add_param_group = undecorated(torch.optim.Optimizer.add_param_group)
    zero_grad = undecorated(torch.optim.Optimizer.zero_grad)
    state_dict = undecorated(torch.optim.Optimizer.state_dict)
    load_state_dict = undecorated(torch.optim.Optimizer.load_state_dict)


_ADAM_STEP = undecorated(torch.optim.Adam.step)


class AdamW(EagerOptimizer, torch.optim.AdamW):
    """``torch.optim.AdamW`` (same arguments, same bytes, same ``state_dict``) that never
    imports ``torch._dynamo``. Still an instance of ``torch.optim.AdamW``: LR schedulers,
    step hooks and checkpoints written by either class work with the other."""

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step of torch's ``Adam.step`` (``decoupled_weight_decay`` set, as AdamW sets it)
        with grad mode as torch's wrapper sets it (off unless ``differentiable``); returns
        the closure's loss. Mutates the parameters and ``self.state``."""
        prev = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(self.defaults["differentiable"])
            return _ADAM_STEP(self, closure)
        finally:
            torch.set_grad_enabled(prev)
