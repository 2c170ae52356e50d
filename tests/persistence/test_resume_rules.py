"""Every config key declares what `--resume` may change (its section's ``ON_RESUME``), and
the resume check is that declaration: a walk over the whole schema, at the level of the
check function (no training)."""

from __future__ import annotations

import dataclasses

import pytest

from mct.config import _SECTIONS, EngineConfig, config_value, resume_rules
from mct.persistence.resume import resume_changes

BASE = {"checkpointing": {"policy": "all"}, "zero": {"stage": 3}, "offload": {"optimizer": "cpu"},
        "memory": {"budget": "1GiB"}}
"""A saved config in which each key's other value below is valid on its own."""

OTHER: dict[str, object] = {
    "seed": 7,
    "model.n_layer": 2, "model.n_head": 8, "model.d_model": 64, "model.seq_len": 64, "model.vocab_size": 512,
    "model.dropout": 0.1, "model.attention": "sdpa", "model.source": "hf:./llama",
    "data.path": "corpus2", "data.micro_batch_size": 4, "data.grad_accum": 2, "data.val_fraction": 0.2, "data.packing": "documents",
    "train.steps": 400, "train.lr": 1e-3, "train.warmup_steps": 5, "train.lr_schedule": "wsd",
    "train.min_lr_ratio": 0.0, "train.decay_fraction": 0.5, "train.weight_decay": 0.0, "train.grad_clip": 0.5,
    "train.eval_every": 5, "train.eval_batches": 2, "train.log_every": 2, "train.checkpoint_every": 5,
    "train.keep_checkpoints": 4, "train.tensorboard": True, "train.max_rollbacks": 1, "train.snapshot_every": 0,
    "train.loss_spike_factor": 3.0, "train.loss_spike_window": 10, "train.grad_norm_factor": 0.0,
    "train.max_consecutive_skips": 5, "train.lr_cut_factor": 0.25, "train.preempt_timeout_s": 5.0,
    "train.init_from": "weights.safetensors", "train.loss_chunk_tokens": 64, "train.loss_vocab_slice": 4096,
    "precision.mode": "bf16", "precision.reduce_dtype": "param", "precision.initial_scale_power": 8,
    "precision.growth_interval": 10, "precision.hysteresis": 1, "precision.min_scale": 2.0,
    "precision.cpu_matmul": "native",
    "checkpointing.policy": "sqrt", "checkpointing.k": 3, "checkpointing.blocks": ["Block"],
    "checkpointing.verify": True, "checkpointing.offload": "disk", "checkpointing.mlp_tile_tokens": 64,
    "checkpointing.per_block": {"all": 1},  # with policy 'per_block' (implied when only per_block is set)
    "zero.stage": 2, "zero.bucket_mb": 5.0, "zero.prefetch": False, "zero.persistent_numel": 100,
    "zero.reshard_root_after_forward": False, "zero.units": ["Block"],
    "memory.budget": "2GiB", "memory.budget_counts": "tensors", "memory.enforce": True, "memory.track": False, "memory.host_malloc": "lean",
    "memory.huge_pages": False, "memory.solver_allow": ["offload"],
    "distributed.backend": "gloo", "distributed.timeout_s": 60.0, "distributed.shared_memory": False,
    "offload.optimizer": "disk", "offload.params": "cpu", "offload.dir": "scratch", "offload.chunk_mb": 1.0,
    "offload.buffers": 3,
    "optimizer.name": None,  # one choice ('adamw'): no other value to change it to
    "optimizer.betas": [0.8, 0.9], "optimizer.eps": 1e-6, "optimizer.state_dtype": "int8",
    "adapter.kind": "lora", "adapter.rank": 4, "adapter.alpha": 8.0, "adapter.dropout": 0.1,
    "adapter.targets": ["*q_proj"], "adapter.base_dtype": "nf4",  # the others: on a saved adapter run (_saved)
    "parallel.context": 2, "parallel.context_attention": "all_to_all",
}
"""Another valid value of every key of the schema (a key added without one fails the walk)."""


def _with(d: dict, key: str, value: object) -> dict:
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in d.items()}
    if key == "seed":
        out["seed"] = value
        return out
    section, name = key.split(".")
    out.setdefault(section, {})[name] = value
    if key == "checkpointing.per_block":
        out["checkpointing"]["policy"] = "per_block"
    return out


def _saved(key: str) -> dict:
    """BASE, with adapters on for an [adapter] key other than kind (they configure nothing without)."""
    if not key.startswith("adapter.") or key == "adapter.kind":
        return BASE
    return _with(BASE, "adapter.kind", "qlora" if key == "adapter.base_dtype" else "lora")


def test_every_key_of_the_schema_declares_what_a_resume_may_change():
    """Each section's ON_RESUME names exactly its fields (no key undeclared, none stale),
    and a refused key says why and what to do."""
    for name, klass in _SECTIONS.items():
        assert set(klass.ON_RESUME) == {f.name for f in dataclasses.fields(klass)}, name
    rules = resume_rules()
    assert set(rules) == set(OTHER), "every key needs another value in OTHER (and a declaration)"
    for key, rule in rules.items():
        assert rule.effect and (rule.allowed or rule.fix), key
    assert all(not rules[f"optimizer.{k}"].allowed for k in ("name", "betas", "eps", "state_dtype"))


@pytest.mark.parametrize("key", sorted(OTHER))
def test_a_change_on_resume_is_refused_in_one_line_or_recorded_as_the_schema_declares(key):
    rule, value = resume_rules()[key], OTHER[key]
    if value is None:
        return  # a key with one valid value cannot change (its declaration is checked above)
    saved = _saved(key)
    new = _with(saved, key, value)
    was = config_value(EngineConfig.from_dict(saved), key)
    now = config_value(EngineConfig.from_dict(new), key)
    assert was != now, key
    if rule.allowed:
        changes = resume_changes(saved, new)
        assert changes[key] == [was, now]
        assert set(changes) <= {key, "checkpointing.policy"}  # per_block implies its policy
        return
    with pytest.raises(ValueError) as e:
        resume_changes(saved, new)
    msg = str(e.value)
    assert "\n" not in msg and f"--resume cannot change {key} from {was!r} to {now!r}" in msg, msg
    assert rule.fix.format(old=was, new=now) in msg
    assert resume_changes(saved, new, refuse=False) == {}  # the trainer's record leaves it out


def test_an_unchanged_or_defaulted_key_is_no_change():
    """A saved config that omits a key (an older run) and a new one that spells out its
    default are the same config."""
    assert resume_changes({}, EngineConfig().to_dict()) == {}
    assert resume_changes(BASE, _with(BASE, "train.steps", 300)) == {}
