"""``model.source = 'hf:DIR'``: a local Hugging Face causal LM as a Task.

The directory holds ``config.json`` (and usually safetensors weights and tokenizer
files). The model is built from its config alone (``AutoModelForCausalLM.from_config``,
fp32, random init from ``seed``; ``train.init_from`` loads weights into the engine's
shards afterwards), so stage 3 and offload can build it on the meta device. Nothing is
ever downloaded, and no code from the directory runs: an architecture transformers
does not ship (``auto_map`` / ``trust_remote_code``) is refused in one line.

transformers is an optional dependency (``pip install 'mct[hf]'``), imported only here.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn as nn

from mct.config import EngineConfig
from mct.errors import read_text
from mct.models.gpt import optimizer_groups
from mct.task.hf_checks import check_config, check_raw_config
from mct.task.spec import Task
from mct.task.tokens import causal_lm_loss, chunk_choices, loss_for, token_batch

POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length")
"""config.json keys that bound the positions a model can embed, in order of preference."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
"""Files of a model directory that travel with its weights (export copies them): every
file ``AutoTokenizer.from_pretrained`` reads (special tokens, chat template) and the
generation defaults."""


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ValueError("model.source = 'hf:...' needs transformers; install it with pip install 'mct[hf]' "
                         "(or `make install`)") from None
    from transformers.utils import logging
    logging.set_verbosity_error()  # tiny vocabularies make it warn about default special tokens
    return transformers


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    """config.json of a local model directory as a dict. Raises ValueError (one line)
    for a missing directory or file, invalid JSON, or no ``model_type``."""
    d = Path(directory)
    what = f"model.source = 'hf:{directory}'"
    if not d.is_dir():
        raise ValueError(f"{what}: no such directory; pass a local Hugging Face model directory "
                         f"(nothing is downloaded)")
    path = d / "config.json"
    if not path.is_file():
        raise ValueError(f"{what}: {path} is missing; a Hugging Face model directory holds config.json "
                         f"(write one with model.config.save_pretrained(DIR))")
    try:
        text = read_text(path)
    except UnicodeDecodeError as e:
        raise ValueError(f"{what}: {path} is not UTF-8 text ({e})") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}: {path} is not valid JSON ({e})") from None
    except RecursionError:
        raise ValueError(f"{what}: {path} nests its JSON too deeply to read; it is not a model config") from None
    if not isinstance(config, dict):
        raise ValueError(f"{what}: {path} holds a JSON {_json_kind(config)}, not an object; it is not a Hugging "
                         f"Face model config")
    if not isinstance(config.get("model_type"), str):
        raise ValueError(f"{what}: {path} has no 'model_type'; it is not a Hugging Face model config")
    return config


def _json_kind(value: Any) -> str:
    """How JSON names the type of ``value`` (``null``, not NoneType)."""
    return {type(None): "null", bool: "boolean", int: "number", float: "number", str: "string",
            list: "array", dict: "object"}.get(type(value), type(value).__name__)


def hf_config(directory: str | Path):
    """The transformers ``PretrainedConfig`` of ``directory``, for training: fp32, no KV
    cache (a cache is state that changes between a checkpointed block's forward and its
    recompute: selective checkpointing then fails with 'aten.slice.Tensor encountered
    during backward but not found in storage', other policies compute on stale keys).
    Raises ValueError for an architecture transformers does not ship or no causal LM."""
    raw = read_hf_config(directory)
    tf = _transformers()  # transformers is optional (mct[hf]): loaded for hf: sources only
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    kind = raw["model_type"]
    if kind not in CONFIG_MAPPING:
        raise ValueError(f"model.source = 'hf:{directory}': model_type {kind!r} is not an architecture "
                         f"transformers {tf.__version__} ships, and mct never runs code from a model directory "
                         f"(trust_remote_code); upgrade transformers or use --model pkg.module:factory")
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"model.source = 'hf:{directory}': model_type {kind!r} has no causal-LM head in "
                         f"transformers (AutoModelForCausalLM); mct trains next-token prediction")
    check_raw_config(raw, f"hf:{directory}")
    try:
        config = tf.AutoConfig.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - a user's file: transformers' and huggingface_hub's own error types
        raise ValueError(f"model.source = 'hf:{directory}': transformers cannot read its config.json "
                         f"({type(e).__name__}: {' '.join(str(e).split())[:300]}); fix the field it names") from None
    check_config(config, kind, f"hf:{directory}")
    config.use_cache = False
    return config


def positions_of(config) -> int | None:
    """The longest sequence the model's position embeddings cover, or None (unbounded)."""
    for key in POSITION_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


@contextmanager
def _weights_initialized_on_meta(tf) -> Iterator[None]:
    """Within: a model built on meta is initialized as a normal construction is.

    transformers skips ``initialize_weights()`` in every ``post_init`` when the device
    is meta (it expects weights to be loaded). ``record_init`` needs the same random
    ops, in the same order (nested ``post_init`` calls included), as a normal
    construction, so that stage 3 and offload give the values of stage 0: this swaps in
    ``init_weights`` without that skip (transformers' own ``no_init_weights`` swaps the
    same method the other way), and restores it on exit."""
    cls = tf.PreTrainedModel
    original = cls.init_weights

    def init_weights(self) -> None:
        self.initialize_weights()
        self.tie_weights(recompute_mapping=False)
    cls.init_weights = init_weights
    try:
        yield
    finally:
        cls.init_weights = original


def hf_task(cfg: EngineConfig, directory: str) -> Task:
    """The Hugging Face causal LM of ``directory`` as a Task: built from config.json in
    fp32 (``AutoModelForCausalLM.from_config``), trained with ``causal_lm_loss`` (chunked: ``train.loss_chunk_tokens``) and the
    recipe's AdamW groups (decay on matrices only). Raises ValueError for what
    ``hf_config`` refuses and for ``model.seq_len`` beyond the model's positions."""
    config = hf_config(directory)
    limit = positions_of(config)
    if limit is not None and cfg.model.seq_len > limit:
        raise ValueError(f"model.seq_len = {cfg.model.seq_len} is longer than the {limit} positions of "
                         f"hf:{directory}; set model.seq_len <= {limit}")
    tf = _transformers()

    def model_fn() -> nn.Module:
        with _weights_initialized_on_meta(tf):
            try:
                return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError) as e:
                raise ValueError(f"model.source = 'hf:{directory}': transformers cannot build a model from its "
                                 f"config.json ({type(e).__name__}: {' '.join(str(e).split())[:200]}); fix the "
                                 f"field it names") from None
    return Task(model_fn=model_fn, loss_fn=loss_for(cfg, causal_lm_loss), batch=token_batch(cfg),
                param_groups=lambda m: optimizer_groups(m, cfg.train.weight_decay), label=f"hf:{directory}",
                vocab_size=int(config.vocab_size), max_positions=limit, hf_dir=str(directory),
                loss_for_chunk=chunk_choices(causal_lm_loss))
