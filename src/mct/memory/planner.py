"""Memory estimator: per-rank peak bytes of one training step, before anything exists.

Two halves, matching how the engine spends memory:

* **Model state** (params, master, grads, optimizer) is arithmetic on the flat-unit
  layout: the model is built on the ``meta`` device (no storage), its trainable
  parameters are cut into the engine's units (one per block and optimizer group, plus
  ``root``), each padded exactly as ``zero.partition.build_layout`` pads them.
* **Transients** (activations saved for backward, recompute, stage-3 gathered blocks,
  the stage 2/3 full-gradient buffers in flight, the logits and loss) are *measured*:
  the model's forward and backward run on ``FakeTensorMode`` tensors (shapes only,
  nothing allocated) under the memory tracker, with hooks that allocate and free fake
  buffers on the same schedule as ``zero.sharded`` and ``zero.stage3``.

The optimizer step's temporaries are modelled for ``torch.optim.Adam(W)`` (see
``optimizer_transient``). ``docs/planner.md`` lists what is and is not modelled.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from mct.checkpointing import find_blocks
from mct.config import EngineConfig
from mct.zero.partition import build_layout
from mct.zero.sharded import assign_units

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
ADAM_STATE_BYTES = 8
"""Adam/AdamW keep exp_avg and exp_avg_sq in fp32 per master element (+ a step scalar)."""


@dataclass(frozen=True)
class ModelSource:
    """How to build the model (any ``nn.Module`` mapping int64 [B, T] to logits [B, T, V]).

    ``build`` is called under ``torch.device('meta')``: it must not allocate real
    storage by itself (``.to('cpu')``, loading weights). ``blocks``: class names, as
    ``checkpointing.blocks``; () = children of the longest ModuleList.
    """

    build: Callable[[], nn.Module]
    vocab_size: int
    seq_len: int
    blocks: tuple[str, ...] = ()
    label: str = "gpt"

    @classmethod
    def from_config(cls, cfg: EngineConfig, factory: str | None = None) -> "ModelSource":
        """The reference GPT of ``cfg.model``, or ``factory`` ('module:function'),
        which is called with no arguments. Raises ValueError for a bad import path."""
        blocks = tuple(cfg.checkpointing.blocks)
        if not factory:
            from mct.models.gpt import GPT
            return cls(build=lambda: GPT(cfg.model), vocab_size=cfg.model.vocab_size,
                       seq_len=cfg.model.seq_len, blocks=blocks, label="gpt")
        return cls(build=load_factory(factory), vocab_size=cfg.model.vocab_size,
                   seq_len=cfg.model.seq_len, blocks=blocks, label=factory)


def load_factory(path: str) -> Callable[[], nn.Module]:
    """'package.module:function' -> the function. Raises ValueError naming the path."""
    mod_name, _, attr = path.partition(":")
    if not mod_name or not attr:
        raise ValueError(f"--model {path!r} must look like 'package.module:factory'")
    try:
        fn = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--model {path!r}: cannot import it ({e}); is the module on PYTHONPATH?") from None
    if not callable(fn):
        raise ValueError(f"--model {path!r} is not callable: point it at a function returning an nn.Module")
    return fn


@dataclass(frozen=True)
class Unit:
    """One flat unit as the engine builds it: ``owner`` is a block name or 'root'."""

    owner: str
    group: int
    numel: int
    padded: int
    shard: int
    n_params: int


@dataclass
class ModelLayout:
    n_params: int
    units: list[Unit]
    blocks: list[str]
    world: int
    stage_world: dict[int, list[Unit]] = field(default_factory=dict)


def build_units(model: nn.Module, blocks: list[tuple[str, nn.Module]], world: int,
                weight_decay: float = 0.1) -> list[Unit]:
    """The engine's flat units for ``world`` shards, in its order (root, then blocks;
    per unit the trainer's AdamW groups: matrices, then vectors)."""
    from mct.models.gpt import optimizer_groups
    groups = [g["params"] for g in optimizer_groups(model, weight_decay)]
    unit_of = assign_units(model, blocks)
    out = []
    for owner in ["root"] + [b for b, _ in blocks]:
        for gi, params in enumerate(groups):
            mine = [p for p in params if unit_of.get(id(p), "root") == owner]
            if mine:
                lay = build_layout([str(i) for i in range(len(mine))], [p.shape for p in mine], world)
                out.append(Unit(owner, gi, lay.numel, lay.padded_numel, lay.shard_numel, len(mine)))
    return out


def meta_layout(source: ModelSource, world: int) -> ModelLayout:
    """Build the model on the meta device and cut it into units for stage 0 (world 1)
    and stages 1-3 (``world``). Raises ValueError if ``build`` does not give a Module."""
    with torch.device("meta"):
        model = source.build()
    if not isinstance(model, nn.Module):
        raise ValueError(f"model factory {source.label!r} returned {type(model).__name__}, not an nn.Module")
    blocks = find_blocks(model, list(source.blocks))
    n = sum(p.numel() for p in model.parameters())
    layout = ModelLayout(n_params=n, units=build_units(model, blocks, world), blocks=[b for b, _ in blocks],
                         world=world)
    layout.stage_world = {1: build_units(model, blocks, 1), world: layout.units}
    return layout


def model_state_bytes(units: list[Unit], stage: int, precision: str, reduce_dtype: str = "fp32",
                      persistent_numel: int = 0, state_bytes: int = ADAM_STATE_BYTES,
                      grad_bytes: int | None = None) -> dict[str, int]:
    """Per-rank model-state bytes held during a step, by category, as
    ``Engine.model_state_bytes`` reports them after the first step (at stages 2/3 the
    gradient shards count, though they exist only from backward to the step's end).
    ``units`` must be cut for world 1 at stage 0.
    ``grad_bytes``: hold gradients in that many bytes per element with no separate fp32
    shard (the ZeRO paper's 16-bit gradients); None = this engine's fp32 accumulators."""
    pb = DTYPE_BYTES[precision]
    rb = 4 if reduce_dtype == "fp32" else pb
    if grad_bytes is not None:
        out = model_state_bytes(units, stage, precision, reduce_dtype, persistent_numel, state_bytes)
        out["grads"] = sum((u.padded if stage < 2 else u.shard) * grad_bytes for u in units)
        return out
    out = {"params": 0, "master": 0, "grads": 0, "optimizer": 0}
    for u in units:
        persistent = stage < 3 or u.padded <= persistent_numel
        out["params"] += u.padded * pb if persistent else 0
        if pb != 4:
            out["master"] += u.shard * 4
        elif not persistent:
            out["params"] += u.shard * 4  # fp32 stage 3: the master shard is the only copy
        if stage < 2:
            out["grads"] += u.padded * rb
        if not (stage < 2 and rb == 4):  # else the reduced shard lives inside grad_full
            out["grads"] += u.shard * 4
        out["optimizer"] += u.shard * state_bytes + 4  # + the step counter, one per master
    return out


def optimizer_transient(units: list[Unit], stage: int, precision: str, device: str = "cpu") -> int:
    """Peak extra bytes of the optimizer stage for Adam(W). On CPU torch runs the
    per-tensor loop: ``denom = (exp_avg_sq.sqrt() / bc).add_(eps)`` holds two temps
    while the previous master's ``denom`` is still bound, so the peak is the largest
    ``prev + 2 x cur`` over consecutive masters (group order). On CUDA the foreach
    path keeps one sqrt temp per master: the sum. Stage 1/2 then all-gather each
    master slice from a temporary copy in the working dtype (one at a time)."""
    order = [u for g in sorted({u.group for u in units}) for u in units if u.group == g]
    sizes = [u.shard * 4 for u in order]
    if device == "cuda":
        adam = sum(sizes)
    else:
        adam = max((2 * s + (sizes[i - 1] if i else 0) for i, s in enumerate(sizes)), default=0)
    publish = max((u.shard * DTYPE_BYTES[precision] for u in units), default=0) if stage in (1, 2) else 0
    return max(adam, publish)


def zero_paper_bytes(n_params: int, world: int, stage: int, k: int = 12, param_bytes: int = 2,
                     grad_bytes: int = 2) -> float:
    """The ZeRO paper's model-state bytes per rank: (2 + 2 + K) * psi at stage 0,
    2 * psi + 2 * psi + K * psi / N at 1, 2 * psi + (2 + K) * psi / N at 2, all / N at 3.
    ``grad_bytes = 4`` gives this engine's fp32 gradient accumulators instead."""
    p, g, o = param_bytes * n_params, grad_bytes * n_params, k * n_params
    return {0: p + g + o, 1: p + g + o / world, 2: p + (g + o) / world, 3: (p + g + o) / world}[stage]


def profile_transients(source: ModelSource, layout: ModelLayout, *, policy: str, precision: str, stage: int,
                       batch: int, seq: int, reduce_dtype: str = "fp32", exact: bool = False,
                       memo: dict | None = None) -> dict[str, dict[str, int]]:
    """Peaks {'forward'|'backward': {category: bytes, 'total': bytes}} of what one
    micro-batch's forward + backward allocates beyond the persistent model state,
    measured on fake tensors (nothing real is allocated; see ``simulate.fake_step``).
    ``memo``: a dict shared between calls to reuse fake runs.

    Models with up to 4 blocks (or blocks named by class, or policies other than
    none/all/sqrt, or ``exact``) run whole, with the stage's own buffer schedule: exact.
    Deeper models run truncated (fake dispatch costs ~1 ms per op), see ``_deep``."""
    from mct.memory.simulate import fake_step
    memo = {} if memo is None else memo

    def run(pol: str, kind: int, keep: int | None, region: bool = False) -> dict[str, dict[str, int]]:
        # truncated runs (keep set) serve every stage: they use the sharded layout
        world = 1 if kind == 0 or (keep is None and stage == 0) else layout.world
        key = (pol, precision, kind, keep, region, batch, seq, reduce_dtype, world)
        if key not in memo:
            memo[key] = fake_step(source, layout.stage_world[world], policy=pol, precision=precision, stage=kind,
                                  world=world, batch=batch, seq=seq, reduce_dtype=reduce_dtype, keep=keep,
                                  region=region)
        return memo[key]
    L = len(layout.blocks)
    if exact or L <= 4 or source.blocks or policy not in ("none", "all", "sqrt"):
        return run(policy, stage, None)
    return _deep(run, layout, policy, stage, precision)


def _deep(run, layout: ModelLayout, policy: str, stage: int, precision: str) -> dict[str, dict[str, int]]:
    """Deep models: runs with the stage-2 schedule of 2 and 3 blocks, extrapolated
    linearly in depth (every block saves the same bytes); 'sqrt' (regions of s blocks)
    is one region of s blocks plus the other regions' saved inputs. Then the stage's
    own buffers: stages 0/1 have no gradient buffers in flight (subtracted), stage 3
    adds two gathered blocks (current + prefetch) at the peak."""
    L = len(layout.blocks)
    grow = lambda pol: {k: _line(run(pol, 2, 2)[k], run(pol, 2, 3)[k], L - 3) for k in ("forward", "backward")}
    if policy == "sqrt":
        s = math.ceil(math.sqrt(L))
        R = math.ceil(L / s)
        alls = grow("all")
        per_input = run("all", 2, 3)["forward"]["total"] - run("all", 2, 2)["forward"]["total"]
        one = run("sqrt", 2, s, True)
        out = {"forward": _line(run("all", 2, 2)["forward"], run("all", 2, 3)["forward"], R - 3),
               "backward": _add(one["backward"], "activations", (R - 1) * per_input)}
        out["backward"] = max(out["backward"], alls["backward"], key=lambda d: d["total"])
    else:
        out = grow(policy)
    units = layout.stage_world[1 if stage == 0 else layout.world]
    block = max((sum(u.padded for u in units if u.owner == b) for b in layout.blocks), default=0)
    for k in out:
        if stage < 2:
            out[k] = _add(out[k], "grads", -out[k].get("grads", 0))
        if stage == 3:
            out[k] = _add(out[k], "params", 2 * block * DTYPE_BYTES[precision])
    return out


def _line(two: dict[str, int], three: dict[str, int], extra: int) -> dict[str, int]:
    """``three`` plus ``extra`` more blocks' growth in total bytes, as activations."""
    return _add(three, "activations", extra * (three["total"] - two["total"]))


def _add(snap: dict[str, int], category: str, nbytes: int) -> dict[str, int]:
    out = dict(snap)
    out[category] = out.get(category, 0) + nbytes
    out["total"] = out.get("total", 0) + nbytes
    return out


@dataclass
class Prediction:
    """Predicted per-rank peak of one configuration. ``stages``: total bytes at the
    forward/backward/optimizer peaks; ``breakdown``: bytes by kind at the overall peak."""

    stage: int
    policy: str
    precision: str
    world: int
    peak: int
    stage_name: str
    stages: dict[str, int]
    breakdown: dict[str, int]


BREAKDOWN = ("params", "master", "grads", "optimizer", "activations", "buffers", "gathered")
"""params/master/grads/optimizer: model state held during a step; activations: saved for
backward, recomputed, logits/loss and activation gradients; buffers: gradients in flight
and the optimizer step's temporaries; gathered: stage-3 parameters gathered (root +
blocks). Stages 2/3 hold no gradients in forward; in backward ``grads`` is what exists
at the peak: the shards reduced so far and the full gradients in flight."""


def predict(layout: ModelLayout, source: ModelSource, *, stage: int, policy: str, precision: str, batch: int,
            seq: int, reduce_dtype: str = "fp32", persistent_numel: int = 0, device: str = "cpu",
            profile: dict[str, dict[str, int]] | None = None, memo: dict | None = None) -> Prediction:
    """Peak per-rank bytes of one step of ``stage``/``policy``/``precision`` with
    micro-batch ``batch`` x ``seq`` tokens, as the engine's tracker would measure it.
    ``profile``: a ``profile_transients`` result to reuse (else it is measured)."""
    world = 1 if stage == 0 else layout.world
    units = layout.stage_world[world]
    state = model_state_bytes(units, stage, precision, reduce_dtype, persistent_numel)
    # stage 3 gathers the root unit, like the blocks, inside the model's forward and
    # backward only (the profile measures it); it is freed by the optimizer step
    if profile is None:
        profile = profile_transients(source, layout, policy=policy, precision=precision, stage=stage,
                                     batch=batch, seq=seq, reduce_dtype=reduce_dtype, memo=memo)
    base = sum(state.values())
    # Stages 2/3 create the fp32 gradient shards in backward (the profile measures them
    # there, with the full gradients in flight) and drop them after the optimizer step.
    lazy = stage >= 2
    kinds: dict[str, dict[str, int]] = {}
    for name in ("forward", "backward"):
        p = profile.get(name, {})
        grads = {"grads": p.get("grads", 0), "buffers": 0} if lazy else {"buffers": p.get("grads", 0)}
        kinds[name] = {**state, "activations": p.get("activations", 0) + p.get("other", 0),
                       "gathered": p.get("params", 0), **grads}
    kinds["optimizer"] = {**state, "activations": 0, "gathered": 0,
                          "buffers": optimizer_transient(units, stage, precision, device)}
    totals = {k: sum(v.values()) for k, v in kinds.items()}
    worst = max(totals, key=totals.get)
    assert totals[worst] >= base
    return Prediction(stage=stage, policy=policy, precision=precision, world=world, peak=totals[worst],
                      stage_name=worst, stages=totals, breakdown={k: kinds[worst].get(k, 0) for k in BREAKDOWN})
