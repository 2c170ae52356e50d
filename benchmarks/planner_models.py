"""Model factories for ``mct plan --model benchmarks.planner_models:<factory>`` (run from
the repository root with ``PYTHONPATH=.``), built from a config alone: nothing is
downloaded and, under the planner, nothing is allocated (the planner calls the factory
on the meta device and on fake tensors).

- ``llama_70b``: a 70B-class Llama (transformers' ``LlamaForCausalLM``): 80 decoder
  layers, hidden 8192, 64 query heads sharing 8 key/value heads (GQA), MLP 28672,
  vocabulary 128256, window 4096; 70.6 B parameters;
- ``llama_tiny``: the same architecture at test size (4 layers, hidden 32), for checking
  the planner against a real run.

``example_batch(cfg)`` gives one rank's micro-batch at the model's window (token ids,
``data.micro_batch_size`` rows); the loss is the convention's default (the model's own
``.loss`` given ``labels``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

WINDOW = 4096


def _llama(layers: int, hidden: int, heads: int, kv_heads: int, mlp: int, vocab: int, window: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging
    logging.set_verbosity_error()
    # no KV cache in training: the recompute of a checkpointed layer must see what forward saw
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, intermediate_size=mlp, vocab_size=vocab,
                      max_position_embeddings=window, use_cache=False, attn_implementation="sdpa",
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def llama_70b() -> nn.Module:
    """Llama 70B-class shapes (Llama 3 70B's config)."""
    return _llama(80, 8192, 64, 8, 28672, 128256, WINDOW)


def llama_tiny() -> nn.Module:
    """The same architecture at test size."""
    return _llama(4, 32, 4, 2, 64, 101, 16)


def example_batch(cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, targets) of ``data.micro_batch_size`` rows at the window (meta: shapes only)."""
    shape = (cfg.data.micro_batch_size, WINDOW)
    return (torch.zeros(shape, dtype=torch.long, device="meta"), torch.zeros(shape, dtype=torch.long, device="meta"))
