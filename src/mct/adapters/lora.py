"""LoRA injection. A targeted linear layer at module path P keeps its own parameters
(``P.weight``, ``P.bias``), frozen, and gains ``P.lora_A`` (nn.Linear in -> rank, no bias,
kaiming-uniform as peft) and ``P.lora_B`` (nn.Linear rank -> out, no bias, zeros), and a
forward hook adding ``lora_B(lora_A(dropout(x))) * alpha / rank`` to its output. The names
are peft's without its ``base_model.model.`` prefix and ``.default`` suffix.

The hook is a module-level function reading its module (no closure): a deep-copied or
pickled model keeps adapters that use its own parameters. It runs inside the layer's
``__call__``, so checkpointing, ZeRO units and tiled MLPs see adapters as part of the block.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from mct.adapters.targets import find_targets, linear_shape
from mct.config import AdapterConfig

ADAPTER_NAMES = ("lora_A", "lora_B")
"""Child module names an adapter adds to its layer."""


def is_adapter_name(name: str) -> bool:
    """Is the parameter (or module) ``name`` part of an adapter (``...lora_A.weight``)?"""
    return any(part in ADAPTER_NAMES for part in name.split("."))


def _lora_hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """Forward hook of an adapted layer: its output plus the scaled low-rank update."""
    x = args[0]
    if module.lora_dropout > 0.0:
        x = F.dropout(x, module.lora_dropout, module.training)
    return output + module.lora_B(module.lora_A(x)) * module.lora_scaling


def _add_adapter(module: nn.Module, rank: int, alpha: float, dropout: float) -> None:
    """Give ``module`` (a linear layer) its adapter; mutates ``module``."""
    n_in, n_out = linear_shape(module)  # type: ignore[misc]  # a target is a linear layer
    like = module.weight
    dtype = like.dtype if like.is_floating_point() else torch.float32
    module.lora_A = nn.Linear(n_in, rank, bias=False, device=like.device, dtype=dtype)
    module.lora_B = nn.Linear(rank, n_out, bias=False, device=like.device, dtype=dtype)
    nn.init.kaiming_uniform_(module.lora_A.weight, a=math.sqrt(5))  # peft's init of A
    nn.init.zeros_(module.lora_B.weight)  # B = 0: the adapted model starts as the base
    module.lora_scaling = alpha / rank
    module.lora_dropout = float(dropout)
    module.register_forward_hook(_lora_hook)


def apply_adapters(model: nn.Module, cfg: AdapterConfig) -> list[str]:
    """Freeze every parameter of ``model`` and add a LoRA adapter (trainable) to each layer
    ``cfg.targets`` selects (``find_targets``); returns the targeted module names, in
    ``named_modules`` order. ``cfg.kind = 'none'``: nothing changes, returns []. Mutates
    ``model``. Raises ValueError for a pattern that matches nothing (``find_targets``) and
    for a model that already has adapters."""
    if not cfg.enabled:
        return []
    already = [n for n, _ in model.named_modules() if is_adapter_name(n)]
    if already:
        raise ValueError(f"the model already has adapters ({already[0]}); build the base model without them")
    targets = find_targets(model, list(cfg.targets))
    for p in model.parameters():
        p.requires_grad_(False)
    for _, module in targets:
        _add_adapter(module, cfg.rank, cfg.alpha, cfg.dropout)
    return [name for name, _ in targets]


def check_adapted(model: nn.Module, cfg: AdapterConfig) -> None:
    """ValueError when ``cfg`` asks for adapters and ``model`` has none: an engine given the
    base model would train every parameter. ``mct train`` builds through ``task_for``, which
    applies them; the Python API applies them before building the engine."""
    if cfg.enabled and not adapter_parameters(model):
        raise ValueError(f"adapter.kind = {cfg.kind!r} but the model has no adapters: call "
                         f"mct.adapters.apply_adapters(model, config.adapter) before mct.Engine(model, ...) "
                         f"(or build it with mct.task.task_for(config).model_fn)")


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapter parameters of ``model`` by name (``P.lora_A.weight``, ``P.lora_B.weight``)."""
    return {n: p for n, p in model.named_parameters() if is_adapter_name(n)}


def adapter_summary(model: nn.Module, cfg: AdapterConfig) -> str:
    """One line for the run summary and metadata.json: the adapters and the share of the
    parameters they are ('' when ``cfg.kind = 'none'``). Reads shapes only (meta is fine)."""
    if not cfg.enabled:
        return ""
    trainable = sum(p.numel() for p in adapter_parameters(model).values())
    total = sum(p.numel() for p in model.parameters())
    layers = sum(1 for n, _ in model.named_modules() if n.endswith(".lora_A"))
    return (f"{cfg.kind} rank {cfg.rank}, alpha {cfg.alpha:g} on {layers} layers: {trainable:,} trainable of "
            f"{total:,} parameters ({100 * trainable / max(total, 1):.2f}%), the rest frozen")
