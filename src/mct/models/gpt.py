"""Reference GPT: pre-norm blocks in an nn.ModuleList, causal attention, GELU MLP,
dropout, tied input/output embeddings.

Sensitive ops run in fp32 whatever the autocast dtype: layer norms, the attention
softmax (inside SDPA's kernels, which accumulate in fp32, or explicitly in fp32 in
``explicit_attention``) and the loss. CPU autocast would otherwise leave norms and
softmax in bf16.

Attention has two implementations with the same math (``model.attention``):
``scaled_dot_product_attention`` (fused; flash kernel on CPU) and an explicit
matmul-softmax-matmul with the softmax in fp32. ``auto`` picks per device and dtype
from measurements (docs/precision.md): explicit for bf16/fp16 on a CPU with native
low-precision matrix units (AVX512-BF16/AMX, where SDPA's CPU flash backward took 70%
of the bf16 backward), SDPA everywhere else (CUDA, fp32, CPUs without them).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from mct.config import ModelConfig
from mct.models.documents import block_causal_mask, document_positions
from mct.precision.cpu_matmul import cpu_has_native_low_precision


class LayerNorm(nn.Module):
    """LayerNorm computed in fp32, returned in the input dtype."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            y = F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), self.bias.float(), 1e-5)
        return y.to(x.dtype)


def attention_impl(choice: str, device_type: str, dtype: torch.dtype) -> str:
    """'sdpa' or 'explicit' for ``model.attention = choice`` on this device and dtype."""
    if choice != "auto":
        return choice
    low = dtype in (torch.bfloat16, torch.float16)
    return "explicit" if device_type == "cpu" and low and cpu_has_native_low_precision(dtype) else "sdpa"


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                       mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention as two matmuls in the input dtype around an fp32 softmax.
    q, k, v: [B, H, T, D] -> [B, H, T, D] in q's dtype. Matches SDPA up to rounding.
    ``mask``: bool [B, 1, T, T], True where attention is allowed (packed documents:
    ``block_causal_mask``); None = causal."""
    T = q.size(-2)
    scores = (q * (1.0 / math.sqrt(q.size(-1)))) @ k.transpose(-2, -1)
    hidden = torch.ones(T, T, dtype=torch.bool, device=q.device).triu_(1) if mask is None else ~mask
    with torch.autocast(q.device.type, enabled=False):  # softmax statistics in fp32
        wide = scores.to(torch.promote_types(scores.dtype, torch.float32))
        probs = torch.softmax(wide.masked_fill(hidden, float("-inf")), dim=-1).to(v.dtype)
    if dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p)
    return probs @ v


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.attention = cfg.attention
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_drop = nn.Dropout(cfg.dropout)
        # context parallelism (mct.context.install): attend(q, k, v, *, dropout_p) runs this
        # rank's queries across its context group instead of the attention below
        self.context_attention = None

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, C] -> [B, T, C]; ``mask`` bool [B, 1, T, T] (packed documents) or None
        (causal, or the context attention's own mask)."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        if self.context_attention is not None:
            y = self.context_attention(q, k, v, dropout_p=p)
        elif attention_impl(self.attention, q.device.type, q.dtype) == "explicit":
            y = explicit_attention(q, k, v, p, mask)
        elif mask is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:  # one fused call with the bool block-causal mask (docs/data.md, "packing": measured choice)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one Parameter, two uses
        self.apply(self._init_weights)
        # GPT-2: scale residual projections by 1/sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, segments: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """idx: int64 [B, T] -> logits [B, T, vocab] in the compute dtype: the output head
        applied last to ``hidden_states(idx, segments, positions=positions)`` (chunked
        cross-entropy replaces the head)."""
        return self.lm_head(self.hidden_states(idx, segments, positions=positions))

    def hidden_states(self, idx: torch.Tensor, segments: torch.Tensor | None = None, *,
                      positions: torch.Tensor | None = None) -> torch.Tensor:
        """idx: int64 [B, T] -> the final normed hidden states [B, T, d_model].
        ``segments`` int64 [B, T] (packed documents, ``mct.models.documents``): positions
        restart at each document and attention stays inside it; one mask, built here,
        goes to every block (a recomputed block is called with the same tensor).
        ``positions`` int64 [B, T] (context parallelism: this rank's tokens of a longer
        window, ``mct.context``): their position ids; the installed context attention masks."""
        T = idx.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds model.seq_len = {self.cfg.seq_len}")
        if positions is not None:
            pos, mask = positions, None
        elif segments is None:
            pos, mask = torch.arange(T, device=idx.device), None
        else:
            pos, mask = document_positions(segments), block_causal_mask(segments)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x) if mask is None else block(x, mask)
        return self.ln_f(x)

    def get_output_embeddings(self) -> nn.Linear:
        """The output head (as Hugging Face models name it): weight [vocab, d_model], tied to ``wte``."""
        return self.lm_head


def gpt_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Mean cross-entropy, in fp32, over the targets of (input_ids, targets) or, packed,
    (input_ids, targets, segments) that are not -100 (a target across a document boundary)."""
    x, y = batch[:2]
    logits = model(x) if len(batch) == 2 else model(x, batch[2])
    with torch.autocast(logits.device.type, enabled=False):
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))


def optimizer_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decay matrices (dim >= 2), not biases and norm weights."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]
