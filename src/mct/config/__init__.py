"""Configuration: keyword-only dataclasses, one per TOML section (the schema: ``values``,
``run``, ``techniques``, ``schema``), and the loader that reads TOML and ``--set`` into
them (``loader``). Values are converted once, at load: a size to bytes (``ByteSize``),
a precision mode to a ``PrecisionMode``.

Every user mistake raises ``ValueError`` naming the key, the value and what is
allowed. ``EngineConfig.from_dict`` accepts the same nested dict shape as the TOML
file; ``apply_overrides`` applies ``section.key=value`` strings typed by the field.
"""

from mct.config.values import (ByteSize, NEW_RUN, Name, OnResume, PrecisionMode, check_int, fixed, may,
                               parse_bytes, _check_range, _fail)  # noqa: F401
from mct.config.run import (DataConfig, GPT_ONLY_KEYS, LR_SCHEDULES, ModelConfig, TrainConfig)  # noqa: F401
from mct.config.techniques import (ADAPTER_KINDS, AdapterConfig, BASE_DTYPES, BLOCK_POLICIES, CheckpointingConfig, DistributedConfig, HOST_MALLOC,
                                   MAX_SEED, MAX_TIMEOUT_S, MemoryConfig, OFFLOAD_TIERS, OPTIMIZER_NAMES,
                                   OffloadConfig, OptimizerConfig, POLICIES, PrecisionConfig, SOLVER_LEVERS,
                                   STATE_DTYPES, ZeroConfig)  # noqa: F401
from mct.config.schema import (EngineConfig, config_value, resume_rules, with_values, _SECTIONS,
                               _build_section, _coerce, _refused)  # noqa: F401
from mct.config.loader import (CLI_RECIPE, FINETUNE_RECIPE, FINETUNE_WARMUP_FRACTION, apply_overrides,
                               load_config, _parse_text, _read_config_file)  # noqa: F401
