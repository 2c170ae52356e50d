"""The whole configuration: ``EngineConfig`` (its sections, one per TOML table), built from
the nested dict of a TOML file (``from_dict``: each value checked against its field's
type, ``_coerce``), edited by value (``with_values``), and what a resume may change
(``resume_rules``)."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mct.config.run import DataConfig, ModelConfig, TrainConfig
from mct.config.techniques import (MAX_SEED, AdapterConfig, CheckpointingConfig, DistributedConfig, MemoryConfig, OffloadConfig,
                                   OptimizerConfig, PrecisionConfig, ZeroConfig)
from mct.config.values import ByteSize, Name, OnResume, _check_range, _fail, fixed


_SECTIONS: dict[str, type] = {
    "model": ModelConfig, "data": DataConfig, "train": TrainConfig,
    "precision": PrecisionConfig, "checkpointing": CheckpointingConfig,
    "zero": ZeroConfig, "memory": MemoryConfig, "distributed": DistributedConfig,
    "offload": OffloadConfig, "optimizer": OptimizerConfig, "adapter": AdapterConfig,
}


@dataclass(kw_only=True)
class EngineConfig:
    seed: int = 1337
    """Seeds model init, data order and dropout; recorded in metadata.json."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)

    ON_RESUME: ClassVar[dict[str, OnResume]] = {
        "seed": fixed("it seeds the run's data order and dropout")}

    def __post_init__(self) -> None:
        _check_range("seed", self.seed, 0, MAX_SEED)
        self._check_tensor_sizes()
        if self.offload.params != "none" and self.zero.stage not in (3, "auto"):
            _fail("offload.params", self.offload.params,
                  f"offloads stage-3 parameter shards; zero.stage = {self.zero.stage!r} keeps whole parameters "
                  f"on every rank: set zero.stage = 3 or offload.params = 'none'")

    def check_resolved(self) -> None:
        """ValueError when zero.stage or checkpointing.policy is still 'auto' (an engine needs them chosen)."""
        for key, value in (("zero.stage", self.zero.stage), ("checkpointing.policy", self.checkpointing.policy)):
            if value == "auto":
                raise ValueError(f"{key} = 'auto' must be resolved before the engine is built: `mct train` does it; "
                                 f"from Python call mct.planner.resolve_auto(config, world_size, workload), which "
                                 f"returns the config with the planner's choice (it needs memory.budget)")

    def _check_tensor_sizes(self) -> None:
        """Raise ValueError when the sizes make a tensor of the built-in GPT (logits,
        embedding, MLP weight, attention scores; or all its parameters) too large for
        64-bit byte counts: torch
        would fail deep inside with an overflow, not name the key."""
        m, b = self.model, self.data
        for keys, numel in ((("data.micro_batch_size", "model.seq_len", "model.vocab_size"),
                             b.micro_batch_size * m.seq_len * m.vocab_size),
                            (("model.vocab_size", "model.d_model"), m.vocab_size * m.d_model),
                            (("model.d_model",), 4 * m.d_model * m.d_model),
                            (("model.n_layer", "model.d_model"), 12 * m.n_layer * m.d_model * m.d_model),
                            (("data.micro_batch_size", "model.n_head", "model.seq_len"),
                             b.micro_batch_size * m.n_head * m.seq_len * m.seq_len)):
            if numel >= 2**60:
                values = ", ".join(f"{k} = {getattr(getattr(self, k.split('.')[0]), k.split('.')[1])}" for k in keys)
                raise ValueError(f"{values} need {numel:.3g} elements in one tensor (or all parameters), beyond 64-bit sizes: "
                                 f"use realistic sizes (`mct plan` shows what a configuration needs)")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "EngineConfig":
        """Build from the nested dict shape of the TOML file. Raises ValueError on
        unknown sections or keys, wrong types, and out-of-range values."""
        d = dict(d or {})
        kwargs: dict[str, Any] = {}
        if "seed" in d:
            kwargs["seed"] = _coerce("seed", d.pop("seed"), int)
        for name, sub in d.items():
            if name not in _SECTIONS:
                allowed = ", ".join(["seed", *_SECTIONS])
                raise ValueError(f"unknown config section {name!r}; allowed: {allowed}")
            if not isinstance(sub, dict):
                raise ValueError(f"config section [{name}] must be a table, got {sub!r}; "
                                 f"write it as [{name}] with key = value lines")
            kwargs[name] = _build_section(name, _SECTIONS[name], sub)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def resume_rules() -> dict[str, OnResume]:
    """Every config key of the schema ('seed', 'section.key', in schema order) with what
    ``--resume`` does when it changes: each section's ``ON_RESUME``. A field without a
    declaration is an AssertionError (the schema's invariant; tests/test_config.py walks it)."""
    rules = {"seed": EngineConfig.ON_RESUME["seed"]}
    for name, klass in _SECTIONS.items():
        for f in dataclasses.fields(klass):
            assert f.name in klass.ON_RESUME, f"{name}.{f.name} declares nothing in {klass.__name__}.ON_RESUME"
            rules[f"{name}.{f.name}"] = klass.ON_RESUME[f.name]
    return rules


def config_value(config: EngineConfig, key: str) -> Any:
    """The value of ``key`` ('seed' or 'section.key') in ``config``."""
    if key == "seed":
        return config.seed
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


def _refused(section: str, key: str) -> str:
    """Why ``section.key`` is refused although it reads like a key ('' when it is not)."""
    if section == "optimizer" and key in ("lr", "weight_decay"):
        return (f"optimizer.{key} is not a key: set train.{key} (its one home, read by the LR schedule and "
                f"the param groups)")
    return ""


def _build_section(name: str, klass: type, values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(klass)
    fields = {f.name for f in dataclasses.fields(klass)}
    out = {}
    for key, value in values.items():
        if _refused(name, key):
            raise ValueError(_refused(name, key))
        if key not in fields:
            raise ValueError(f"unknown config key {name}.{key}; allowed in [{name}]: {', '.join(sorted(fields))}")
        out[key] = _coerce(f"{name}.{key}", value, hints[key])
    if name == "checkpointing" and out.get("per_block") and "policy" not in out:
        out["policy"] = "per_block"  # per_block alone says what every block does
    return klass(**out)


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Check ``value`` against the annotation ``typ``; ints are accepted for floats."""
    options = typing.get_args(typ) if isinstance(typ, types.UnionType) else (typ,)
    for t in options:
        origin = typing.get_origin(t)
        if origin is list:
            item = (typing.get_args(t) or (str,))[0]
            if isinstance(value, list) and all(isinstance(v, str) for v in value) and item is str:
                return list(value)
            if isinstance(value, list) and item is float:
                return [_coerce(f"{key}[{i}]", v, float) for i, v in enumerate(value)]
            continue
        if origin is dict:
            if isinstance(value, dict) and all(isinstance(k, str) for k in value):
                return {k: _coerce(f"{key}.{k}", v, typing.get_args(t)[1]) for k, v in value.items()}
            continue
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ValueError(f"{key} = {value!r} is not allowed: must be a finite number")
            return float(value)
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            if not -2**63 <= value < 2**63:  # torch sizes and seeds are 64-bit; beyond is a typo, not a size
                raise ValueError(f"{key} = {value!r} is not allowed: must fit in 64 bits (|value| < 2**63)")
            return value
        if t in (str, bool) and type(value) is t:
            return value
        if t is ByteSize and isinstance(value, (str, int)) and not isinstance(value, bool):
            return value  # the section converts it
        if t is type(None) and value is None:
            return None
        if isinstance(t, type) and issubclass(t, Name) and isinstance(value, str):
            return value  # the section's __post_init__ converts it (naming the key when it is not a member)
    names = " or ".join(_type_name(t) for t in options if t is not type(None))
    shapes = [("a table like {name = 1}" if typing.get_origin(t) is dict else
               "a list like [0.9, 0.95]" if typing.get_args(t) == (float,) else 'a list like ["a", "b"]')
              for t in options if typing.get_origin(t) in (list, dict)]
    raise ValueError(f"{key} = {value!r} has the wrong type: expected {names}"
                     + (f" ({' or '.join(shapes)})" if shapes else ""))


def _type_name(t: Any) -> str:
    return "a size like '2GiB' or a byte count" if t is ByteSize else getattr(t, "__name__", str(t))


def with_values(cfg: EngineConfig, values: dict[str, Any]) -> EngineConfig:
    """``cfg`` with ``{"section.key": value}`` replaced (``dataclasses.replace``: each value
    checked against its field's type as at load, then each changed section and the whole
    config validated again). Values are typed (not text: ``apply_overrides`` types a
    user's). Raises ValueError as at load."""
    sections: dict[str, dict[str, Any]] = {}
    for path, value in values.items():
        section, key = path.split(".")
        hint = typing.get_type_hints(_SECTIONS[section])[key]
        sections.setdefault(section, {})[key] = _coerce(path, value, hint)
    return dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **kv)
                                       for name, kv in sections.items()})
