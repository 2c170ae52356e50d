"""``mct train``'s recipes: the defaults of the keys a user did not set.

A run that starts from pretrained weights (``train.init_from`` set) gets the fine-tune
recipe (``FINETUNE_RECIPE``: lr 2e-5, warm-up 3% of the steps, weight decay 0.01, cosine
to 0, AdamW's betas, clip 1.0), or with adapters (``adapter.kind`` set too) the LoRA
fine-tune recipe, the same with lr 2e-4 (``LORA_LR``); any other run the from-scratch one (the field defaults
with ``CLI_RECIPE``: lr 3e-3, 30 warm-up steps, decay 0.1, cosine to lr/10, betas (0.9,
0.95), clip 1.0). A value from the config file or ``--set`` always wins. The Python API
(``EngineConfig.from_dict``) keeps the field defaults. A resumed run keeps the values it
was recorded with (its config is read back whole), so it keeps its recipe.

Imports nothing heavier than ``mct.config``: the launcher and ``--help`` read it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mct.config import (CLI_RECIPE, FINETUNE_RECIPE, FINETUNE_WARMUP_FRACTION, EngineConfig, TrainConfig,
                        load_config)

SCRATCH = "from scratch"
FINETUNE = "fine-tune"
LORA = "LoRA fine-tune"
LORA_LR = 2e-4
"""The LoRA fine-tune recipe's learning rate: adapters start at B = 0 and need 10x a full
fine-tune's rate (the QLoRA paper's 2e-4; peft's examples 1e-4 to 2e-4; torchtune 3e-4)."""
KEYS = ("train.lr", "train.warmup_steps", "train.weight_decay", "train.min_lr_ratio", "train.grad_clip",
        "optimizer.betas")
"""The keys a recipe sets, in the order the summary and ``--help`` name them."""
SCRATCH_BETAS = [0.9, 0.95]
"""AdamW's betas of ``mct train``'s models when ``optimizer.betas`` is [] (``mct.task.gpt.make_optimizer``)."""


def finetune_warmup(steps: int) -> int:
    """The fine-tune recipe's warm-up for a run of ``steps`` steps: ``FINETUNE_WARMUP_FRACTION``
    of them, rounded, at least 1."""
    return max(1, round(FINETUNE_WARMUP_FRACTION * steps))


def recipe_of(cfg: EngineConfig) -> str:
    """``LORA`` when ``cfg`` trains adapters on pretrained weights, ``FINETUNE`` when it
    starts from pretrained weights, else ``SCRATCH``."""
    if not cfg.train.init_from:
        return SCRATCH
    return LORA if cfg.adapter.enabled else FINETUNE


def recipe_values(name: str, steps: int) -> dict[str, Any]:
    """``{"section.key": value}`` of recipe ``name`` for a run of ``steps`` steps (``KEYS``)."""
    if name in (FINETUNE, LORA):
        flat = {f"{s}.{k}": v for s, keys in FINETUNE_RECIPE.items() for k, v in keys.items()}
        flat["train.warmup_steps"] = finetune_warmup(steps)
        if name == LORA:
            flat["train.lr"] = LORA_LR
    else:
        base = TrainConfig()
        flat = {f"train.{k}": getattr(base, k) for k in ("lr", "warmup_steps", "weight_decay", "min_lr_ratio")}
        flat.update({f"train.{k}": v for k, v in CLI_RECIPE["train"].items()})
        flat["optimizer.betas"] = SCRATCH_BETAS
    return {k: flat[k] for k in KEYS}


def train_config(path: str | Path | None, overrides: list[str]) -> EngineConfig:
    """The config of a new ``mct train`` run: the TOML file ``path`` (optional) and the
    ``--set`` ``overrides`` over the recipe the run's config calls for (fine-tune when
    ``train.init_from`` is set by either). Raises ValueError as ``load_config``."""
    cfg = load_config(path, overrides, defaults=CLI_RECIPE)
    if recipe_of(cfg) == SCRATCH:
        return cfg
    defaults: dict[str, dict[str, Any]] = {s: dict(keys) for s, keys in FINETUNE_RECIPE.items()}
    defaults["train"]["warmup_steps"] = finetune_warmup(cfg.train.steps)
    if recipe_of(cfg) == LORA:
        defaults["train"]["lr"] = LORA_LR
    return load_config(path, overrides, defaults=defaults)


def recipe_line(cfg: EngineConfig) -> str:
    """One line naming the recipe in force for ``cfg`` and its values; a value that differs
    from the recipe's is marked "(set)". E.g. ``fine-tune (train.init_from is set): lr 2e-05, ...``."""
    name = recipe_of(cfg)
    why = {FINETUNE: " (train.init_from is set)", LORA: " (train.init_from and adapter.kind are set)"}.get(name, "")
    own = recipe_values(name, cfg.train.steps)
    parts = []
    for key in KEYS:
        section, k = key.split(".")
        value = getattr(getattr(cfg, section), k)
        shown = value if value != [] else own[key]  # optimizer.betas = []: the recipe's
        parts.append(f"{k} {_fmt(shown)}" + (" (set)" if shown != own[key] else ""))
    return f"{name}{why}: " + ", ".join(parts)


def recipes_help() -> str:
    """Every recipe's defaults, for ``mct train --help``."""
    rows = []
    for name, when in ((SCRATCH, "new weights"), (FINETUNE, "train.init_from / --init-from set")):
        values = recipe_values(name, 100)
        if name == FINETUNE:
            values["train.warmup_steps"] = f"{FINETUNE_WARMUP_FRACTION:.0%} of train.steps (>= 1)"
        rows.append(f"{name} ({when}): " + ", ".join(f"{k} = {_fmt(v)}" for k, v in values.items()))
    rows.append(f"{LORA} (--init-from and adapter.kind set): {FINETUNE}'s, with train.lr = {_fmt(LORA_LR)}")
    return "; ".join(rows)


def _fmt(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(f"{v:g}" for v in value) + "]"
    return f"{value:g}" if isinstance(value, float) else str(value)
