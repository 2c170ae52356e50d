"""Storage codecs for a frozen base: NF4 (QLoRA's 4-bit NormalFloat, double-quantized scales)."""

from mct.quant.nf4 import ALIGN, BLOCK, GROUP, NF4Codec, round_trip

__all__ = ["ALIGN", "BLOCK", "GROUP", "NF4Codec", "round_trip"]
