"""Training has no use for a model's KV cache, and checkpointing cannot live with one.

A Hugging Face causal LM called without ``use_cache=False`` (``model(input_ids=x,
labels=y).loss``, the loss every transformers user writes) builds a cache object in
forward and appends every layer's keys and values to it. A checkpointed block's
recompute then sees a cache that grew since its forward: selective checkpointing fails
in backward with "aten.slice.Tensor encountered during backward but not found in
storage", other policies attend over stale keys. transformers' own gradient
checkpointing turns the cache off for training; the engine does the same for every
policy and every loss (``disable_kv_cache``), before it checkpoints the model.
"""

from __future__ import annotations

import torch.nn as nn


def disable_kv_cache(model: nn.Module) -> list[str]:
    """Set ``config.use_cache = False`` on every module of ``model`` whose config has
    it on (transformers models share one config object between their submodules), so
    a forward called without ``use_cache`` keeps no cache. Returns the qualified names
    of the modules whose config changed ('' for the model itself). Other models pass
    through unchanged; a forward given ``use_cache=True`` explicitly still gets one."""
    changed = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if config is None or id(config) in seen or getattr(config, "use_cache", None) is not True:
            continue
        seen.add(id(config))
        config.use_cache = False
        changed.append(name)
    return changed
