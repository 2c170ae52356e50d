"""Models the planner was not tuned on, for its accuracy tests and benchmark; also
``mct plan --model tests.planner_models:hf_gpt2`` modules (the convention in
docs/planner.md: ``factory()``, optional ``loss_fn``/``example_batch``/``optimizer``).

- ``hf_gpt2``: a Hugging Face ``GPT2LMHeadModel`` built from a tiny config (nothing is
  downloaded), dropout on, tied embeddings, forward returning an object with ``.loss``;
- ``hf_llama``: a Hugging Face ``LlamaForCausalLM`` (GQA, rotary, gated MLP), tiny;
- ``tied_frozen_reused``: a tied input/output embedding, a frozen projection, one block
  applied twice per forward, buffers, and odd sizes (nothing divisible by the world).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ = 101, 13


def hf_gpt2(n_layer: int = 2, d_model: int = 36, n_head: int = 3, dropout: float = 0.1) -> nn.Module:
    """A tiny GPT-2 of transformers (attention through torch's SDPA)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging
    logging.set_verbosity_error()  # tiny vocabularies make it warn about the default special tokens
    # no KV cache in training: the recompute of a checkpointed block must see what forward saw
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=d_model, n_layer=n_layer, n_head=n_head,
                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0,
                     use_cache=False, attn_implementation="sdpa")
    return GPT2LMHeadModel(cfg)


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 3 * d + 1)
        self.down = nn.Linear(3 * d + 1, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TiedFrozenReused(nn.Module):
    """Embedding tied to the head, a frozen input projection, block 0 run twice."""

    def __init__(self, d: int = 27, n_blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(n_blocks))
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((d,), 0.5))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.frozen(self.embed(idx))
        x = x * self.scale.to(x.dtype)  # buffers keep their dtype: follow the working one
        x = self.blocks[0](x)
        for block in self.blocks:  # block 0 again: a re-used module
            x = block(x)
        return self.head(x)


def raising() -> nn.Module:
    """A factory whose own code fails: `mct plan --model` says so in one line."""
    raise RuntimeError("a factory that fails")


def hf_llama(n_layer: int = 7) -> nn.Module:
    """A tiny Llama of transformers: grouped-query attention (4 query, 2 key/value
    heads), gated MLP, rotary positions, untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging
    logging.set_verbosity_error()
    cfg = LlamaConfig(num_hidden_layers=n_layer, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=44, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
                      attn_implementation="sdpa", tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def tied_frozen_reused() -> nn.Module:
    return TiedFrozenReused()


def example_batch(cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``--model`` convention's batch hook: token ids of this module's sizes."""
    shape = (cfg.data.micro_batch_size, SEQ)
    return torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.long)


def random_batch(step: int, rank: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randint(0, VOCAB, (batch, SEQ), generator=g), torch.randint(0, VOCAB, (batch, SEQ), generator=g))
