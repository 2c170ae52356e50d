"""Which modules are blocks: the unit that checkpointing keeps or recomputes; and which
module is the output head (``find_output_head``: chunked loss and adapter targets ask here)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn


def find_blocks(model: nn.Module, class_names: list[str] | None = None,
                key: str = "checkpointing.blocks") -> list[tuple[str, nn.Module]]:
    """Return the model's blocks as ``(qualified_name, module)`` in ``named_modules`` order.

    With ``class_names`` empty: the children of the longest ``nn.ModuleList`` whose
    children are all of one class (the repeated layers of any transformer: an HF
    model's decoder layers), else of the longest ``nn.ModuleList``; ties go to the first
    one met. Otherwise: every module whose class name is listed; a match
    nested inside another match is skipped (blocks do not nest). Returns ``[]`` when no
    ModuleList exists. Raises ValueError for a class name the model does not contain,
    naming the config ``key`` that listed it and the class names the model does contain.
    Mutates nothing.
    """
    if class_names:
        return _blocks_by_class(model, class_names, key)
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    # A list of one repeated class is the model's layer stack; a mixed list (heads,
    # adapters) is only the fallback.
    repeated = [(n, m) for n, m in lists if len({type(c) for c in m}) == 1]
    best: tuple[str, nn.ModuleList] | None = None
    for name, module in repeated or lists:
        if best is None or len(module) > len(best[1]):
            best = (name, module)
    if best is None:
        return []
    prefix = f"{best[0]}." if best[0] else ""
    return [(f"{prefix}{i}", child) for i, child in enumerate(best[1])]


def _exposed_module(model: nn.Module, getter: str, attribute: str) -> nn.Module | None:
    """``model.<getter>()`` when the model has it (and it does not raise NotImplementedError),
    else ``model.<attribute>``; None when neither is a module. Mutates nothing."""
    found = None
    get = getattr(model, getter, None)
    if callable(get):
        try:
            found = get()
        except NotImplementedError:
            found = None
    if found is None:
        found = getattr(model, attribute, None)
    return found if isinstance(found, nn.Module) else None


def find_output_head(model: nn.Module) -> nn.Module | None:
    """The module a model applies last to its hidden states to make the logits:
    ``model.get_output_embeddings()`` (Hugging Face models; mct's GPT), else its ``lm_head``
    attribute; None when it exposes neither. Mutates nothing."""
    return _exposed_module(model, "get_output_embeddings", "lm_head")


def find_input_embedding(model: nn.Module) -> nn.Module | None:
    """The module that embeds the token ids: ``model.get_input_embeddings()`` (Hugging Face
    models), else the built-in GPT's ``wte``; None when it exposes neither. Mutates nothing."""
    return _exposed_module(model, "get_input_embeddings", "wte")


def _blocks_by_class(model: nn.Module, class_names: list[str], key: str) -> list[tuple[str, nn.Module]]:
    present = {type(m).__name__ for m in model.modules()}
    unknown = [c for c in class_names if c not in present]
    if unknown:
        raise ValueError(
            f"{key} = {class_names!r}: {unknown!r} not found in the model; "
            f"its module class names are: {', '.join(sorted(present))}")
    wanted = set(class_names)
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if type(module).__name__ not in wanted:
            continue
        # A listed class inside another listed block would nest regions; the outer one wins.
        if any(name.startswith(f"{outer}.") for outer, _ in found):
            continue
        found.append((name, module))
    return found


def primary(output: Any) -> Any:
    """The value a block passes on to the next one: a tensor itself, the first item of a
    tuple/list, the first value of a dict (recursively), as Hugging Face layers return."""
    while isinstance(output, (tuple, list, dict)) and len(output) > 0:
        output = next(iter(output.values())) if isinstance(output, dict) else output[0]
    return output


def first_tensor(tree: Any) -> torch.Tensor | None:
    """First tensor among the leaves of nested args/kwargs, or None."""
    leaves, _ = torch.utils._pytree.tree_flatten(tree)
    return next((x for x in leaves if isinstance(x, torch.Tensor)), None)
