"""The validation pass over a Hugging Face model directory's ``config.json``, made once
before any rank builds the model (``mct.task.hf.hf_config`` calls both checks).

``check_raw_config`` reads the JSON as written: custom code (``auto_map``), the sizes
(positive integers; JSON ``null`` only where transformers derives a default), dropout
rates and positive constants. ``check_config`` reads transformers' config object (field
aliases resolved, e.g. GPT-2's ``n_embd`` is ``hidden_size``): heads that divide the
width, and that the model transformers builds for it is causal. Each failure is one
``ValueError`` naming the field, its value and the fix.
"""

from __future__ import annotations

import json
import math
from typing import Any

SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
         "n_embd", "n_layer", "n_head")
"""Fields that must be positive integers when present."""

OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "n_inner", "max_position_embeddings", "n_positions", "n_ctx")
"""Positive integers, or null (transformers derives them from the others; positions: unbounded)."""

POSITIVE = ("layer_norm_eps", "layer_norm_epsilon", "rms_norm_eps", "rope_theta")
"""Finite numbers > 0 when present (null: transformers' default)."""

DROPOUT_SUFFIXES = ("dropout", "_pdrop", "dropout_prob", "dropout_rate")
"""Suffixes of dropout probabilities: numbers in [0, 1) when present (null: none)."""


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _bad(what: str, key: str, value: Any, need: str) -> ValueError:
    return ValueError(f"model.source = '{what}': config.json {key} = {_shown(value)} must be {need}; fix it "
                      f"in config.json")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_raw_config(raw: dict[str, Any], what: str) -> None:
    """Refuse custom code and wrongly typed or out-of-range fields of ``raw`` (config.json)."""
    if "auto_map" in raw:
        names = sorted(raw["auto_map"]) if isinstance(raw["auto_map"], dict) else raw["auto_map"]
        raise ValueError(f"model.source = '{what}': config.json has auto_map ({_shown(names)}): the model is "
                         f"custom code in the directory, and mct never runs a model directory's code "
                         f"(trust_remote_code); use an architecture transformers ships, or --model "
                         f"pkg.module:factory")
    for key in SIZES + OPTIONAL_SIZES:
        if key in raw and not (key in OPTIONAL_SIZES and raw[key] is None):
            if not _is_int(raw[key]) or raw[key] < 1:
                raise _bad(what, key, raw[key], "a positive integer" + (" or null" if key in OPTIONAL_SIZES else ""))
    for key, value in raw.items():
        if value is None:
            continue
        if key in POSITIVE and not (_is_real(value) and value > 0):
            raise _bad(what, key, value, "a finite number > 0")
        if key.endswith(DROPOUT_SUFFIXES) and not (_is_real(value) and 0 <= value < 1):
            raise _bad(what, key, value, "a probability in [0, 1)")


def check_config(config: Any, kind: str, what: str) -> None:
    """Refuse heads that do not divide the width, and a model that would not be causal:
    an encoder family (BERT, RoBERTa, ...) whose causal-LM class attends both ways
    unless ``is_decoder`` is true would be trained on next-token prediction with every
    target visible."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES
    width, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    kv, head_dim = getattr(config, "num_key_value_heads", None), getattr(config, "head_dim", None)
    if _is_int(width) and _is_int(heads) and heads > 0 and head_dim is None and width % heads:
        raise ValueError(f"model.source = '{what}': config.json hidden_size = {width} is not divisible by "
                         f"num_attention_heads = {heads}; pick heads that divide the width")
    if _is_int(heads) and _is_int(kv) and kv > 0 and heads % kv:
        raise ValueError(f"model.source = '{what}': config.json num_attention_heads = {heads} is not divisible "
                         f"by num_key_value_heads = {kv}; pick key/value heads that divide the heads")
    layers = getattr(config, "num_hidden_layers", None)
    if layers is not None and (not _is_int(layers) or layers < 1):
        raise _bad(what, "num_hidden_layers", layers, "a positive integer")
    if kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_encoder_decoder", False):
        if not (getattr(config, "is_decoder", False) or getattr(config, "causal", False)):
            raise ValueError(f"model.source = '{what}': model_type {kind!r} is an encoder that attends in both "
                             f"directions unless config.json sets is_decoder = true; trained on next-token "
                             f"prediction it would see every target. Set \"is_decoder\": true to train it as "
                             f"a causal decoder, or use a decoder-only model")
