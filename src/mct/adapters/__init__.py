"""Low-rank adapters (LoRA) on a frozen base: ``apply_adapters(model, cfg.adapter)``
freezes every parameter of ``model`` and gives each targeted linear layer two trainable
children, ``lora_A`` and ``lora_B`` (docs/adapters.md). ``targets`` picks the layers;
``lora`` injects and reads them back."""

from mct.adapters.lora import (ADAPTER_NAMES, adapter_parameters, adapter_summary, apply_adapters,  # noqa: F401
                               check_adapted, is_adapter_name)
from mct.adapters.targets import find_targets, linear_shape  # noqa: F401

__all__ = ["ADAPTER_NAMES", "adapter_parameters", "adapter_summary", "apply_adapters", "check_adapted", "find_targets", "is_adapter_name", "linear_shape"]
