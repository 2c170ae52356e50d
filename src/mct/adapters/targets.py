"""Which modules get adapters: ``adapter.targets`` patterns (fnmatch on module names), or by
default every linear layer inside the model's transformer blocks (attention and MLP
projections), never the embedding or the output head."""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch.nn as nn

from mct.checkpointing.blocks import find_blocks, find_output_head

SHOWN = 8
"""Module names an error lists as what a pattern could have matched."""


def linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """(in_features, out_features) of a linear layer: an ``nn.Linear`` (weight [out, in]) or a
    transformers ``Conv1D`` (GPT-2's projections: weight [in, out], ``fan_in_fan_out``); None
    for any other module."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None:
        n_in, n_out = module.weight.shape
        return int(n_in), int(n_out)
    return None


def find_targets(model: nn.Module, patterns: list[str]) -> list[tuple[str, nn.Module]]:
    """(name, module) of every linear layer ``patterns`` select, in ``named_modules`` order.
    ``patterns`` [] = every linear layer inside the blocks (``find_blocks``' default). Mutates
    nothing. Raises ValueError for a pattern that matches no linear layer (naming the first
    few it could have matched), for a model without blocks and no patterns, and for a pattern
    that selects the output head (the chunked loss and tied embeddings use its weight directly)."""
    head = find_output_head(model)
    linears = [(n, m) for n, m in model.named_modules() if linear_shape(m) is not None and m is not head]
    if not patterns:
        blocks = find_blocks(model)
        if not blocks:
            raise ValueError(f"adapter.targets = [] selects the linear layers inside the model's blocks, and "
                             f"{type(model).__name__} has no nn.ModuleList of blocks: name the layers, e.g. "
                             f"adapter.targets = {_suggest(linears)}")
        prefixes = tuple(f"{name}." for name, _ in blocks)
        chosen = [(n, m) for n, m in linears if n.startswith(prefixes)]
        if not chosen:
            raise ValueError(f"adapter.targets = [] found no linear layer inside the blocks of "
                             f"{type(model).__name__} ({blocks[0][0]}, ...): name the layers in adapter.targets")
        return chosen
    names = [n for n, _ in linears]
    for pattern in patterns:
        if head is not None and any(m is head for n, m in model.named_modules() if fnmatchcase(n, pattern)):
            raise ValueError(f"adapter.targets pattern {pattern!r} selects the output head, which takes no adapter "
                             f"(the chunked loss and tied embeddings use its weight directly): narrow the pattern")
        if not any(fnmatchcase(n, pattern) for n in names):
            raise ValueError(f"adapter.targets pattern {pattern!r} matches no linear layer of "
                             f"{type(model).__name__}; it could match e.g. {', '.join(names[:SHOWN]) or '(none)'}"
                             f"{' ...' if len(names) > SHOWN else ''}")
    return [(n, m) for n, m in linears if any(fnmatchcase(n, p) for p in patterns)]


def _suggest(linears: list[tuple[str, nn.Module]]) -> str:
    leaves = sorted({n.rsplit(".", 1)[-1] for n, _ in linears})[:3]
    return "[" + ", ".join(f'"*{leaf}"' for leaf in leaves) + "]" if leaves else '["*proj"]'
