"""Storage codecs for a frozen base: NF4 (QLoRA's 4-bit NormalFloat, double-quantized scales)."""

from mct.quant.nf4 import NF4_ALIGN, NF4_BLOCK, NF4_GROUP, NF4Codec, round_trip

__all__ = ["NF4_ALIGN", "NF4_BLOCK", "NF4_GROUP", "NF4Codec", "round_trip"]
