"""torch's functions without the wrappers that import ``torch._dynamo``.

mct never compiles, but torch wraps many eager functions in ``torch._disable_dynamo`` (and an
optimizer's ``step`` in ``_use_grad_for_differentiable``), whose first call imports
``torch._dynamo``: about 70 MiB resident with sympy, in a process that never needed it.
``undecorated`` gives the function inside (the ``__wrapped__`` that ``functools.wraps``
records), for ``mct.optim.eager`` (the optimizers) and ``mct.checkpointing.frame`` (the
selective-checkpoint dispatch modes). A leaf module (torch only), so any room may import it.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.optim.optimizer as torch_optimizer


def _wrapper_code(decorator: Any) -> Any:
    return decorator(lambda: None).__code__  # every function a decorator makes shares its code


DYNAMO_WRAPPERS = frozenset(_wrapper_code(d) for d in (
    torch._disable_dynamo, torch.optim.Optimizer.profile_hook_step,
    getattr(torch_optimizer, "_use_grad_for_differentiable", torch._disable_dynamo)))
"""The code of torch's wrappers ``undecorated`` removes (``profile_hook_step``: torch wraps a
class's step in it again on its first instance). Any other wrapper is kept, so a torch that
adds one (a ``no_grad``, say) keeps its meaning, and one that changes these loads dynamo
again (the tests say so) rather than losing a behaviour."""


def undecorated(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` without torch's dynamo wrappers (``DYNAMO_WRAPPERS``, followed through the
    ``__wrapped__`` ``functools.wraps`` records); ``fn`` itself when it has none."""
    return inspect.unwrap(fn, stop=lambda f: getattr(f, "__code__", None) not in DYNAMO_WRAPPERS)
