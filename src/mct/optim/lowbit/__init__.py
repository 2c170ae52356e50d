"""Low-precision AdamW state: bf16 or blockwise int8 moments, shard-invariant by construction."""

from mct.optim.lowbit.adamw import STATE_DTYPES, LowPrecisionAdamW
from mct.optim.lowbit.codec import BLOCK

__all__ = ["BLOCK", "STATE_DTYPES", "LowPrecisionAdamW"]
