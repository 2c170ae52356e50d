"""Packed documents are exact: a window of several documents gives each document the
loss, gradients and logits it gets alone (the built-in GPT, a transformers Llama with SDPA
and eager attention, GPT-2, fp32), and no document's logits depend on another's tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mct.data.packing import IGNORE_INDEX, pack_window
from mct.models.documents import block_causal_mask, document_positions
from mct.models.gpt import GPT, gpt_loss
from mct.task.tokens import causal_lm_loss
from tests.helpers import tiny_config

T = 32
LENGTHS = (7, 12, 5, 9)  # the last document goes on past the window (its last target is its own next token)


def _window(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One packed window [1, T] of LENGTHS documents: (input_ids, targets, segments)."""
    g = np.random.default_rng(seed)
    docs = np.repeat(np.arange(len(LENGTHS)), LENGTHS)[: T + 1]
    chunk = g.integers(0, 64, size=T + 1)
    return pack_window(chunk[None], docs[None])


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(tiny_config(model={"vocab_size": 64, "seq_len": T, "dropout": 0.0}).model)


def _hf(kind: str, attention: str = "sdpa") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig
    from transformers.utils import logging
    logging.set_verbosity_error()
    if kind == "llama":
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T)
    else:
        config = GPT2Config(vocab_size=64, n_positions=T, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention).eval()


def _summed(loss_fn, model, batch) -> torch.Tensor:
    """The loss summed over counted targets (loss_fn returns their mean)."""
    return loss_fn(model, batch) * (batch[1] != IGNORE_INDEX).sum()


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


MODELS = [("gpt", _gpt, gpt_loss), ("llama", lambda: _hf("llama"), causal_lm_loss),
          ("llama_eager", lambda: _hf("llama", "eager"), causal_lm_loss), ("gpt2", lambda: _hf("gpt2"), causal_lm_loss)]


@pytest.mark.parametrize("name,make,loss_fn", MODELS, ids=[m[0] for m in MODELS])
def test_packed_window_loss_and_grads_equal_the_sum_over_its_documents_alone(name, make, loss_fn):
    if name != "gpt":
        pytest.importorskip("transformers")
    x, y, seg = _window()
    packed = make()
    _summed(loss_fn, packed, (x, y, seg)).backward()
    alone = make()
    total = torch.zeros(())
    for k in range(int(seg.max()) + 1):
        keep = seg[0] == k
        doc = _summed(loss_fn, alone, (x[:, keep], y[:, keep]))
        doc.backward()
        total = total + doc.detach()
    summed_packed = _summed(loss_fn, packed, (x, y, seg)).detach()
    assert abs(summed_packed - total) <= 1e-6 * abs(total)
    gp, ga = _grads(packed), _grads(alone)
    assert ((gp - ga).norm() / ga.norm()).item() <= 1e-6


@pytest.mark.parametrize("name,make,loss_fn", MODELS, ids=[m[0] for m in MODELS])
def test_changing_one_document_leaves_every_other_documents_logits_bit_identical(name, make, loss_fn):
    if name != "gpt":
        pytest.importorskip("transformers")
    x, _, seg = _window()
    model = make()
    logits = (lambda ids: model(ids, seg)) if name == "gpt" else \
        (lambda ids: model(input_ids=ids, position_ids=document_positions(seg), use_cache=False).logits)
    with torch.no_grad():
        before = logits(x)
        for k in range(int(seg.max()) + 1):
            changed = x.clone()
            changed[seg == k] = (changed[seg == k] + 1) % 64
            after = logits(changed)
            others = seg[0] != k
            assert torch.equal(after[0, others], before[0, others]), f"document {k} leaked"
            assert not torch.equal(after[0, ~others], before[0, ~others])


def test_no_target_crosses_a_document_boundary():
    x, y, seg = _window()
    boundary = torch.cat([seg[0, 1:] != seg[0, :-1], torch.tensor([False])])
    assert (y[0, boundary] == IGNORE_INDEX).all() and (y[0, ~boundary] != IGNORE_INDEX).all()
    assert torch.equal(y[0, ~boundary][:-1], x[0, 1:][~boundary[:-1]])  # the next token of the same document


def test_positions_restart_at_each_document_and_the_mask_is_block_causal():
    seg = torch.tensor([[0, 0, 0, 1, 1, 2]])
    assert document_positions(seg).tolist() == [[0, 1, 2, 0, 1, 0]]
    mask = block_causal_mask(seg)[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False]
    assert mask[2].tolist() == [True, True, True, False, False, False]


def test_explicit_attention_with_the_document_mask_matches_sdpa():
    from mct.models.gpt import explicit_attention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    mask = block_causal_mask(torch.tensor([[0, 0, 0, 1, 1, 2]]))
    torch.testing.assert_close(explicit_attention(q, k, v, 0.0, mask),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=mask), rtol=1e-12, atol=1e-12)


def test_chunked_loss_of_a_packed_transformers_llama_equals_its_whole_loss():
    pytest.importorskip("transformers")
    from mct.task.tokens import chunked_token_loss
    batch = _window()
    model = _hf("llama")
    torch.testing.assert_close(chunked_token_loss(5)(model, batch), causal_lm_loss(model, batch), rtol=1e-5, atol=0)


def test_a_model_that_cannot_take_documents_is_one_line_naming_the_fix():
    from mct.task.tokens import token_loss

    class Plain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.emb(x)
    with pytest.raises(ValueError, match="data.packing = 'documents' needs a model .* set data.packing = 'stream'"):
        token_loss(Plain(), _window())
    assert torch.isfinite(token_loss(Plain(), _window()[:2]))  # the same model trains stream windows
