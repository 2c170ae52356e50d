"""``--model pkg.module:factory``: a user's own module as a Task.

A module named by ``mct plan --model pkg.module:factory`` provides ``factory()``, a
function with no arguments returning the ``nn.Module`` (it is called under
``torch.device('meta')``, so it must not load weights or move tensors by itself).
Optionally, at module level:

- ``loss_fn(model, batch) -> scalar tensor``: the loss the model is trained with;
- ``example_batch(config) -> batch``: one rank's micro-batch (real, meta or fake
  tensors; only shapes and dtypes matter), given the resolved ``EngineConfig``;
- ``optimizer(groups) -> torch.optim.Optimizer``: the factory ``mct.Engine`` takes;
- ``param_groups(model) -> list[dict]``: the engine's ``param_groups``.

Defaults, for token-id models: the batch is ``(input_ids, targets)``, two int64
``[data.micro_batch_size, model.seq_len]`` tensors; the loss calls the model with
``labels=targets`` when its forward takes ``labels`` (Hugging Face causal LMs) and
uses the returned ``.loss``, else calls ``model(input_ids)`` and takes the
cross-entropy (in fp32) of the logits it returns (a tensor, or an object with
``.logits``); the optimizer is ``mct.Engine``'s default, AdamW over one group.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch.nn as nn

from mct.config import EngineConfig
from mct.task.meta import build_on_meta
from mct.task.spec import Task
from mct.task.tokens import chunk_choices, loss_for, token_batch, token_loss


def load_workload(path: str, cfg: EngineConfig) -> Task:
    """'pkg.module:factory' -> the Task of that module (convention above).
    Raises ValueError naming the path for a bad import, a missing or non-callable
    factory, or a non-callable hook."""
    mod_name, _, attr = path.partition(":")
    if not mod_name or not attr:
        raise ValueError(f"--model {path!r} must look like 'package.module:factory'")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"--model {path!r}: cannot import {mod_name!r} ({e}); is it on PYTHONPATH?") from None
    except Exception as e:  # noqa: BLE001 - user code: a syntax error or a raise at import is one line
        raise ValueError(f"--model {path!r}: importing {mod_name!r} failed ({_first_line(e)}); fix the module") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--model {path!r}: {mod_name} has no function {attr!r} returning an nn.Module")
    factory = _user_code(path, f"{mod_name}.{attr}()", factory)
    hooks: dict[str, Callable | None] = {}
    for name in ("loss_fn", "example_batch", "optimizer", "param_groups"):
        hook = getattr(module, name, None)
        if hook is not None and not callable(hook):
            raise ValueError(f"--model {path!r}: {mod_name}.{name} must be a function, got {type(hook).__name__}")
        hooks[name] = hook
    batch = _user_code(path, f"{mod_name}.example_batch()", hooks["example_batch"])(cfg) if hooks["example_batch"] \
        else token_batch(cfg)
    return Task(model_fn=factory, loss_fn=hooks["loss_fn"] or loss_for(cfg, token_loss), batch=batch,
                optimizer=hooks["optimizer"], param_groups=hooks["param_groups"], label=path,
                vocab_size=_vocab_of(factory),
                loss_for_chunk=None if hooks["loss_fn"] else chunk_choices(token_loss))


def _vocab_of(factory: Callable) -> int | None:
    """The token ids the model embeds: its input embeddings (``get_input_embeddings()``,
    else its first ``nn.Embedding``), found on a construction on the meta device; None
    when it has none or cannot be built there (the factory's own errors surface later)."""
    try:
        model = build_on_meta(factory)
    except Exception:  # noqa: BLE001 - reported by the run that builds it for real
        return None
    if not isinstance(model, nn.Module):
        return None
    try:
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    except NotImplementedError:
        emb = None
    if not isinstance(emb, nn.Embedding):
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return emb.num_embeddings if emb is not None else None


def _first_line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _user_code(path: str, what: str, fn: Callable) -> Callable:
    """``fn`` whose exceptions become one-line ValueErrors naming ``--model path`` (a
    ValueError of its own passes as it is: it already is a user-facing message)."""
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - user code
            raise ValueError(f"--model {path!r}: {what} raised {_first_line(e)}") from None
    return call
