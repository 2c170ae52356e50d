"""A configuration the planner chose, as values: the offload choice (``OffloadChoice``),
one configuration of a grid or a solve (``Choice``), ``apply`` (a config with a choice in
it, by ``dataclasses.replace``: every section re-validated as at load) and the plan row
(``PlanRow``: a choice's prediction, fields, serialized with the exact keys of
``mct plan --json``).

A ``PlanRow`` is also a read-only mapping of those keys (``row["peak"]``, ``row.get``), as
the rows of ``mct.plan`` and ``mct plan --json`` have always been read from outside; inside
mct rows are read by field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from mct.config import EngineConfig, PrecisionMode, with_values

TIERS = ("cpu", "disk")
"""Where state can be offloaded to."""


@dataclass(frozen=True)
class OffloadChoice:
    """Where the fp32 master and optimizer state (``optimizer``) and the stage-3 parameter
    shards (``params``) live between steps: 'none', 'cpu' or 'disk' each. Its ``label``
    ('none', 'optimizer=disk', 'optimizer+params=disk', 'optimizer=cpu,params=disk') is how
    a user writes it (``mct plan --offloads``) and how plan rows serialize it."""

    optimizer: str = "none"
    params: str = "none"

    @classmethod
    def parse(cls, label: str) -> "OffloadChoice":
        """The choice a label names. Raises ValueError naming the label and the forms."""
        if label == "none":
            return cls()
        parts = dict(p.split("=", 1) for p in label.split(",") if "=" in p)
        if parts.get("optimizer") in TIERS and set(parts) <= {"optimizer", "params"} \
                and parts.get("params", "none") in (*TIERS, "none"):
            return cls(parts["optimizer"], parts.get("params", "none"))
        if set(parts) == {"optimizer+params"} and parts["optimizer+params"] in TIERS:
            return cls(parts["optimizer+params"], parts["optimizer+params"])
        raise ValueError(f"offload choice {label!r}: use none, optimizer=cpu|disk or optimizer+params=cpu|disk")

    @classmethod
    def of(cls, cfg: EngineConfig) -> "OffloadChoice":
        """The choice ``cfg``'s [offload] section makes."""
        return cls(cfg.offload.optimizer, cfg.offload.params)

    @property
    def label(self) -> str:
        if self.optimizer == "none":
            return "none"
        if self.params == "none":
            return f"optimizer={self.optimizer}"
        if self.params == self.optimizer:
            return f"optimizer+params={self.optimizer}"
        return f"optimizer={self.optimizer},params={self.params}"

    @property
    def kind(self) -> str:
        """'none', 'optimizer' or 'optimizer+params' (what is offloaded, whatever the tiers)."""
        return "none" if self.optimizer == "none" else "optimizer" if self.params == "none" else "optimizer+params"

    def settings(self) -> str:
        """As --set arguments ('' for none)."""
        return " ".join(f"offload.{k}={v}" for k, v in (("optimizer", self.optimizer), ("params", self.params))
                        if v != "none")

    def __str__(self) -> str:
        return self.label

    def __eq__(self, other: object) -> bool:  # equal to its label, as a label always compared
        if isinstance(other, str):
            return self.label == other
        if isinstance(other, OffloadChoice):
            return (self.optimizer, self.params) == (other.optimizer, other.params)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.label)


NO_OFFLOAD = OffloadChoice()


@dataclass(frozen=True)
class Choice:
    """One configuration: the keys a plan or a solve varies. None leaves the config's own
    value. ``per_block``: checkpointing.per_block for policy 'per_block' (None: the config's
    own; a uniform policy drops it); ``micro_batch``: data.micro_batch_size, the batch per
    rank (micro-batch x data.grad_accum) kept; ``reshard_root``: zero.reshard_root_after_forward."""

    stage: int
    policy: str
    precision: PrecisionMode | None = None
    offload: OffloadChoice | None = None
    act_offload: str | None = None
    loss_chunk: int | None = None
    mlp_tile: int | None = None
    per_block: dict[str, int] | list[str] | None = None
    micro_batch: int | None = None
    reshard_root: bool | None = None
    context: int | None = None
    """parallel.context; the global batch kept: data.grad_accum scaled by the new degree over the old."""


def apply(cfg: EngineConfig, choice: Choice) -> EngineConfig:
    """``cfg`` with ``choice``'s keys set (``with_values``: each value and section checked as at load).
    Raises ValueError for policy 'per_block' with no per_block anywhere, or a micro-batch
    that does not divide the batch per rank."""
    c = choice
    per_block = c.per_block if c.per_block is not None else cfg.checkpointing.per_block
    if c.policy == "per_block" and not per_block:
        raise ValueError("checkpointing policy 'per_block' plans the config's checkpointing.per_block, and it sets "
                         "none: set it (e.g. --set checkpointing.per_block=all=8,selective=8) or plan other policies")
    values: dict[str, Any] = {"zero.stage": c.stage, "checkpointing.policy": c.policy,
                              "checkpointing.per_block": _copy(per_block) if c.policy == "per_block" else []}
    optional = {"checkpointing.offload": c.act_offload, "checkpointing.mlp_tile_tokens": c.mlp_tile,
                "zero.reshard_root_after_forward": c.reshard_root, "precision.mode": c.precision,
                "train.loss_chunk_tokens": c.loss_chunk}
    values.update((k, v) for k, v in optional.items() if v is not None)
    if c.offload is not None:
        values.update({"offload.optimizer": c.offload.optimizer, "offload.params": c.offload.params})
    per_rank = cfg.data.micro_batch_size * cfg.data.grad_accum
    if c.context is not None and c.context != cfg.parallel.context:
        per_rank = _per_rank_at(per_rank, cfg.parallel.context, c.context)
        values["parallel.context"] = c.context
    micro = c.micro_batch if c.micro_batch is not None else cfg.data.micro_batch_size
    if micro < 1 or per_rank % micro:
        raise ValueError(f"micro-batch {micro} does not divide the batch per rank ({per_rank} = "
                         f"data.micro_batch_size x data.grad_accum)")
    values.update({"data.micro_batch_size": micro, "data.grad_accum": per_rank // micro})
    return with_values(cfg, values)


def _per_rank_at(per_rank: int, old: int, new: int) -> int:
    """The batch per rank (windows a step) at context degree ``new`` that keeps the global batch
    of ``per_rank`` at ``old`` (world / degree data-parallel ranks). Raises ValueError when it is no integer."""
    if (per_rank * new) % old:
        raise ValueError(f"parallel.context {new}: the batch per rank ({per_rank} windows at parallel.context = "
                         f"{old}) x {new} / {old} is no whole number of windows; change data.grad_accum")
    return per_rank * new // old


def _copy(spec: dict[str, int] | list[str]) -> dict[str, int] | list[str]:
    return dict(spec) if isinstance(spec, dict) else list(spec)


def need_of(row: Mapping[str, Any]) -> int:
    """The bytes a row (a ``PlanRow``, or its ``to_dict``) needs of a budget: the largest of
    its steady-state, first-step and init tensor peaks; where the row's budget counts the
    process (``budget_counts``), that plus its runtime baseline, allocator overhead and
    rollback snapshots."""
    tensors = max(row["peak"], row["first_step_peak"], row["init_peak"])
    if row.get("budget_counts") != "process":
        return tensors
    return tensors + row["runtime_baseline"] + row["allocator_overhead"] + (row.get("rollback_snapshots") or 0)


def figure_of(row: Mapping[str, Any]) -> int:
    """The steady-state figure a row's budget is compared with: ``process_peak`` where the
    budget counts the process (``budget_counts``), else the tensor ``peak``."""
    return row["process_peak"] if row.get("budget_counts") == "process" else row["peak"]


def counts_text(counts: str) -> str:
    """What a budget counting ``counts`` ('process' | 'tensors') is compared with, in words."""
    return "process peak, resident set" if counts == "process" else "tensor bytes"


def seconds_of(row: Mapping[str, Any]) -> float:
    """What a recommendation and the solver rank a row (a ``PlanRow``, or its ``to_dict``)
    by: ``step_s`` when the plan has a time model, else the relative ``cost``."""
    step_s = row.get("step_s")
    return float(step_s) if step_s is not None else float(row["cost"])


_SOLVER_KEYS = ("micro_batch_size", "grad_accum", "n_params", "reshard_root_after_forward", "context")


@dataclass(frozen=True, eq=False)
class PlanRow(Mapping):
    """One dry-run configuration and its prediction: the configuration (stage, policy,
    per_block of a 'per_block' row, precision, offload, act_offload, loss_chunk_tokens,
    mlp_tile_tokens, world), the steady-state ``peak`` (tensor bytes) in ``phase`` with the
    bytes per category there (``breakdown``), each phase's peak (``phases``), the
    ``first_step_peak`` and ``init_peak``, the bytes offload keeps off the device per tier
    (``offloaded``), whether it ``fits`` the budget, its relative ``cost``, and with a time
    model ``step_s`` (predicted seconds per step), ``time`` (its terms) and ``tokens_per_s``.
    A solver's rows also carry ``micro_batch_size``, ``grad_accum``, ``n_params`` and
    ``reshard_root_after_forward`` (None in a grid plan's). Beside ``peak`` (tensor bytes),
    ``process_peak`` predicts what the kernel counts (resident set; on CUDA, device memory);
    ``budget_counts`` says which of the two the budget is compared with."""

    stage: int
    policy: str
    per_block: dict[str, int] | list[str] | None
    precision: PrecisionMode
    offload: OffloadChoice
    act_offload: str
    loss_chunk_tokens: int
    mlp_tile_tokens: int
    world: int
    peak: int
    phase: str
    breakdown: dict[str, int]
    phases: dict[str, int]
    first_step_peak: int
    init_peak: int
    offloaded: dict[str, int]
    fits: bool
    cost: float
    step_s: float | None = None
    time: dict[str, Any] | None = None
    tokens_per_s: float | None = None
    micro_batch_size: int | None = None
    grad_accum: int | None = None
    n_params: int | None = None
    reshard_root_after_forward: bool | None = None
    context: int | None = None
    """parallel.context of a solver row (None: the config's own)."""
    process_peak: int | None = None
    """The process's predicted peak (``mct.memory.process_peak``): ``runtime_baseline`` +
    ``peak`` + ``allocator_overhead``, counted as ``process_counts`` says; None where no runtime
    baseline is known (none cached and the plan measures nothing)."""
    runtime_baseline: int | None = None
    allocator_overhead: int | None = None
    process_counts: str | None = None
    process_at: str | None = None
    """Where the process peaks: 'step', or 'save' (the checkpoint save: then ``process_peak`` is
    ``runtime_baseline`` + the state it reads + ``allocator_overhead``; ``mct.memory.process_peak``)."""
    rollback_snapshots: int | None = None
    """Host bytes of the rollback snapshots (``train.snapshot_every``) held at the process peak,
    counted in ``process_peak`` (``mct.memory.process_peak.snapshots_held``)."""
    budget_counts: str = "tensors"
    """What ``fits`` and ``need`` compare with the budget (``memory.budget_counts``): 'process'
    (``process_peak``; the need adds the process terms to the largest tensor peak) or 'tensors'
    (``peak``)."""

    @property
    def need(self) -> int:
        """The bytes it needs of a budget (``need_of``)."""
        return need_of(self)

    @property
    def seconds(self) -> float:
        """What a recommendation and the solver rank by (``seconds_of``)."""
        return seconds_of(self)

    @property
    def choice(self) -> Choice:
        """The configuration as a ``Choice`` (``apply`` sets it in a config)."""
        return Choice(self.stage, self.policy, self.precision, self.offload, self.act_offload,
                      self.loss_chunk_tokens, self.mlp_tile_tokens, self.per_block, self.micro_batch_size,
                      self.reshard_root_after_forward, self.context)

    def to_dict(self) -> dict[str, Any]:
        """Plain data with ``mct plan --json``'s keys (the solver's four only on its rows)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["offload"] = self.offload.label
        if self.micro_batch_size is None:
            for k in _SOLVER_KEYS:
                del d[k]
        return d

    def __getitem__(self, key: str) -> Any:
        if key in _SOLVER_KEYS and self.micro_batch_size is None or key not in self._keys():
            raise KeyError(key)
        return self.offload.label if key == "offload" else getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(k for k in self._keys() if self.micro_batch_size is not None or k not in _SOLVER_KEYS)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    @classmethod
    def _keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    __hash__ = object.__hash__
