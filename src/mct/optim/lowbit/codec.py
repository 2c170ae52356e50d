"""Blockwise codecs for Adam's moments, laid on a unit's GLOBAL flat index.

Pure tensor functions (no optimizer, no collectives). A 1-D fp32 tensor whose first
element sits at a global index that is a multiple of ``BLOCK`` is cut into blocks of
``BLOCK`` elements; every block keeps one fp32 scale (its absolute maximum) and one
byte per element. Because ZeRO shards of block-quantized state start at multiples of
``BLOCK`` (``mct.zero.partition.build_layout(shard_align=BLOCK)``), a block never
straddles two ranks, and the bytes of element i depend only on the values of its own
block: the same on 1, 2 or 3 ranks, at any stage.

Maps (non-linear, as the anchors' dynamic maps: more codes near zero, where most of a
block's values are):
  first moment m (signed):   code = round(127 * sign(x) * sqrt(|x| / absmax))   int8
  second moment v (>= 0):    code = round(255 * (v / max) ** (1/4))             uint8
A second moment never decodes to 0 (codes are at least 1): Adam divides by it.

Rounding: to nearest, or stochastic with ``noise`` (uniform in [0, 1), one per
element, from ``mct.optim.lowbit.noise``): unbiased, so small EMA decays are not lost.

Every operation rounds once, IEEE-exactly, so that ``kernel.c`` (the fused CPU step)
writes the same bytes: square roots are taken in float64 and rounded to float32
(``sqrt_``), which is the correctly rounded float32 root; torch's own float32 ``sqrt`` on
CPU is not always (it differed in the last bit for ~0.7% of inputs here).
"""

from __future__ import annotations

import torch

BLOCK = 256
"""Elements per quantization block (one fp32 scale each: 4 / 256 bytes per element)."""


def blocks_of(numel: int) -> int:
    """Blocks covering ``numel`` elements (the last one may be partial)."""
    return -(-numel // BLOCK)


def sqrt_(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) = its correctly rounded square root (through float64), in place."""
    return x.copy_(x.double().sqrt_())


def _round(x: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
    return x.round_() if noise is None else x.add_(noise).floor_()


def _blocked(x: torch.Tensor) -> torch.Tensor:
    assert x.numel() % BLOCK == 0, f"{x.numel()} elements are not whole blocks of {BLOCK}"
    return x.view(-1, BLOCK)


def encode_signed(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                  noise: torch.Tensor | None = None) -> None:
    """Write ``x`` (fp32 [k * BLOCK]) into ``codes`` (int8, same length) and ``scales``
    (fp32 [k]). ``x`` is used as scratch (its values are destroyed)."""
    xb = _blocked(x)
    torch.amax(xb.abs(), dim=1, out=scales)
    inv = torch.where(scales > 0, scales.reciprocal(), torch.zeros_like(scales))
    sign = torch.sign(xb)
    sqrt_(xb.abs_().mul_(inv[:, None])).mul_(127.0)
    codes.view(-1, BLOCK).copy_(_round(xb, noise if noise is None else noise.view(-1, BLOCK))
                                .clamp_(max=127.0).mul_(sign))


def decode_signed(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (fp32, the codes' length) = sign(c) * (c / 127)^2 * scale."""
    ob = out.view(-1, BLOCK)
    ob.copy_(codes.view(-1, BLOCK))
    ob.mul_(ob.abs()).mul_((scales * (1.0 / 127.0**2))[:, None])
    return out


def encode_unsigned(v: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    noise: torch.Tensor | None = None) -> None:
    """Write ``v`` (fp32 >= 0 [k * BLOCK]) into ``codes`` (uint8) and ``scales`` (fp32
    [k], each block's maximum). ``v`` is used as scratch."""
    vb = _blocked(v)
    torch.amax(vb, dim=1, out=scales)
    inv = torch.where(scales > 0, scales.reciprocal(), torch.zeros_like(scales))
    sqrt_(sqrt_(vb.mul_(inv[:, None]))).mul_(255.0)
    # code >= 1 everywhere: a positive v never decodes to 0 (a zero v, whose m is zero
    # too, decodes to a value below its block's 255^-4 * max: harmless)
    codes.view(-1, BLOCK).copy_(_round(vb, noise if noise is None else noise.view(-1, BLOCK)).clamp_(1.0, 255.0))


def decode_unsigned(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (fp32) = (c / 255)^4 * max."""
    ob = out.view(-1, BLOCK)
    ob.copy_(codes.view(-1, BLOCK)).mul_(1.0 / 255.0).square_().square_().mul_(scales[:, None])
    return out


def round_bf16(x: torch.Tensor, out: torch.Tensor, noise16: torch.Tensor | None) -> None:
    """``out`` (bf16) = ``x`` (fp32) rounded to bf16: to nearest, or stochastically with
    ``noise16`` (int32 in [0, 2^16), one per element): the 16 dropped mantissa bits are
    rounded up with probability (their value / 2^16), which is unbiased. ``x`` is scratch."""
    if noise16 is None:
        out.copy_(x)
        return
    bits = x.view(torch.int32)
    bits.add_(noise16).bitwise_and_(-65536)  # 0xFFFF0000: the bf16 bits, now exact
    out.copy_(x)
