"""QLoRA's 4-bit base: which frozen weights are stored as NF4 (``mct.quant.nf4``), and the
same base, quantized and dequantized, for the fp32 reference.

The NF4 weights are the frozen weights of the linear layers inside the model's transformer
blocks (attention and MLP projections: the layers ``adapter.targets = []`` selects, adapted
or not), as QLoRA quantizes them; the embedding, the output head, norms and biases stay in
the compute dtype. A frozen unit packs each NF4 weight on a multiple of ``NF4Codec.align``,
so a weight decodes exactly as ``mct.quant.round_trip`` of it alone (``dequantized_base``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from mct.adapters.targets import linear_shape
from mct.checkpointing.blocks import find_blocks, find_output_head
from mct.config import AdapterConfig
from mct.quant import NF4Codec, round_trip


def stores_nf4(adapter: AdapterConfig) -> bool:
    """Does ``adapter`` store its frozen base as NF4 (``kind = 'qlora'``, ``base_dtype`` 'auto' or 'nf4')?"""
    return adapter.kind == "qlora"


def nf4_weights(model: nn.Module) -> list[str]:
    """Names of the frozen weights of the linear layers inside ``model``'s blocks
    (``find_blocks``' default), in ``named_parameters`` order; [] for a model without
    blocks. Reads ``requires_grad``: call it after the adapters froze the base."""
    blocks = tuple(f"{name}." for name, _ in find_blocks(model))
    head = find_output_head(model)
    if not blocks:
        return []
    chosen = {id(m.weight) for n, m in model.named_modules()
              if n.startswith(blocks) and m is not head and linear_shape(m) is not None}
    return [n for n, p in model.named_parameters() if id(p) in chosen and not p.requires_grad]


def nf4_codecs(model: nn.Module, adapter: AdapterConfig) -> dict[str, NF4Codec]:
    """{name: codec} of the weights a frozen unit stores as NF4 under ``adapter`` (one shared
    codec); {} unless ``adapter`` is QLoRA. ValueError when QLoRA finds no weight to quantize."""
    if not stores_nf4(adapter):
        return {}
    names = nf4_weights(model)
    if not names:
        raise ValueError(f"adapter.kind = 'qlora' stores the frozen linear weights inside the blocks as NF4, and "
                         f"{type(model).__name__} has none (no nn.ModuleList of blocks with linear layers): "
                         f"use adapter.kind = 'lora'")
    codec = NF4Codec()
    return dict.fromkeys(names, codec)


@torch.no_grad()
def dequantize_base(model: nn.Module, adapter: AdapterConfig, dtype: torch.dtype) -> list[str]:
    """Replace each NF4 weight of ``model`` (``nf4_codecs``) by its NF4 round trip from
    ``dtype`` (the engine's working dtype, what its frozen units encode and decode), cast
    back to the weight's own dtype: the base an engine run computes with, for the fp32
    reference. Returns the names changed; mutates ``model``."""
    codecs = nf4_codecs(model, adapter)
    params = dict(model.named_parameters())
    for name, codec in codecs.items():
        p = params[name]
        p.copy_(round_trip(p.to(dtype), codec).to(p.dtype))
    return list(codecs)
