"""Mixed precision: dtype policy, autocast, dynamic loss scaling, overflow check.

See docs/precision.md for the stage contract and the loss-scale state machine.
"""

from mct.precision.policy import MODE_DTYPES, PrecisionPolicy
from mct.precision.scaler import LossScaleFloorError, LossScaler

__all__ = ["MODE_DTYPES", "LossScaleFloorError", "LossScaler", "PrecisionPolicy"]
