"""Config: every kind of user mistake is a ValueError naming key, value and fix."""

from __future__ import annotations

import re

import pytest

from mct.config import EngineConfig, apply_overrides, load_config, parse_bytes


def test_defaults_are_valid_and_round_trip():
    cfg = EngineConfig()
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("d, fragment", [
    ({"modle": {}}, "unknown config section 'modle'"),
    ({"model": {"n_layers": 2}}, "unknown config key model.n_layers"),
    ({"model": {"n_layer": "4"}}, "model.n_layer = '4' has the wrong type: expected int"),
    ({"model": {"n_layer": 2.5}}, "model.n_layer = 2.5 has the wrong type"),
    ({"train": {"tensorboard": 1}}, "train.tensorboard = 1 has the wrong type: expected bool"),
    ({"model": {"n_layer": 0}}, "model.n_layer = 0 is not allowed: must be >= 1"),
    ({"model": {"d_model": 30, "n_head": 4}}, "must be divisible by model.n_head = 4"),
    ({"model": {"dropout": 1.0}}, "model.dropout = 1.0 is not allowed: must be in [0, 1)"),
    ({"precision": {"mode": "fp8"}}, "precision.mode = 'fp8' is not allowed: choose 'fp32', 'bf16' or 'fp16'"),
    ({"checkpointing": {"policy": "some"}}, "checkpointing.policy = 'some' is not allowed"),
    ({"checkpointing": {"k": 0}}, "checkpointing.k = 0 is not allowed: must be >= 1"),
    ({"zero": {"stage": 4}}, "zero.stage = 4 is not allowed: choose 0, 1, 2, 3 or 'auto'"),
    ({"zero": {"stage": True}}, "zero.stage = True"),
    ({"memory": {"budget": "lots"}}, "memory.budget must be a positive size like '2GiB'"),
    ({"memory": {"enforce": True}}, "memory.enforce = True is not allowed: needs memory.budget"),
    ({"distributed": {"backend": "mpi"}}, "distributed.backend = 'mpi' is not allowed"),
    ({"train": {"lr": 0}}, "train.lr = 0.0 is not allowed: must be > 0.0"),
    ({"model": 3}, "config section [model] must be a table"),
])
def test_bad_config_names_key_value_and_fix(d, fragment):
    with pytest.raises(ValueError) as e:
        EngineConfig.from_dict(d)
    assert fragment in str(e.value)


def test_set_overrides_are_typed_by_field():
    d = apply_overrides({}, ["zero.stage=2", "model.dropout=0.1", "train.tensorboard=true",
                             "checkpointing.blocks=Block,MLP", "memory.budget=2GiB", "seed=7",
                             "zero.stage=auto"])
    cfg = EngineConfig.from_dict(d)
    assert cfg.zero.stage == "auto" and cfg.model.dropout == 0.1 and cfg.train.tensorboard is True
    assert cfg.checkpointing.blocks == ["Block", "MLP"] and cfg.seed == 7
    assert cfg.memory.budget_bytes == 2 * 2**30


@pytest.mark.parametrize("item, want", [
    # TOML's own forms, as a config file writes them
    ('checkpointing.per_block=["all", "none"]', ["all", "none"]),
    ("checkpointing.per_block={all = 2, none = 1}", {"all": 2, "none": 1}),
    ("checkpointing.per_block={all=2,none=1}", {"all": 2, "none": 1}),
    ("checkpointing.blocks=['Block', 'MLP']", ["Block", "MLP"]),
    ("optimizer.betas=[0.9, 0.95]", [0.9, 0.95]),
    ("optimizer.betas=[1e-1, 5e-1]", [0.1, 0.5]),
    ("memory.solver_allow=[]", []),
    # bare words in brackets, as a shell user writes them: strings, as TOML would quote them
    ("checkpointing.per_block=[all,none]", ["all", "none"]),
    ("checkpointing.per_block=[all, \"none\"]", ["all", "none"]),
    ("memory.solver_allow=[micro_batch]", ["micro_batch"]),
    ("zero.units=[Block]", ["Block"]),
    # the forms that worked before stay
    ("checkpointing.per_block=all,none", ["all", "none"]),
    ("checkpointing.per_block=all=2,none=1", {"all": 2, "none": 1}),
    ("memory.solver_allow=micro_batch,offload", ["micro_batch", "offload"]),
    ("memory.solver_allow=", []),
    ("optimizer.betas=0.9,0.95", [0.9, 0.95]),
    ('checkpointing.blocks="Block","MLP"', ["Block", "MLP"]),
])
def test_set_takes_lists_and_tables_the_toml_way(item, want):
    """A list or table key's --set value means what it means in a TOML file (bare words
    in brackets read as strings), and the older comma forms keep working."""
    key, _ = item.split("=", 1)
    section, name = key.split(".")
    got = getattr(getattr(EngineConfig.from_dict(apply_overrides({}, [item])), section), name)
    assert got == want and type(got) is type(want), (item, got)


@pytest.mark.parametrize("item, fragment", [
    ("checkpointing.per_block=[all", "checkpointing.per_block = '[all' is not a TOML list or table: write a list as "
                                     "checkpointing.per_block=[a,b]"),
    ("memory.solver_allow={micro_batch", "is not a TOML list: write a list as memory.solver_allow=[a,b]"),
    ("memory.solver_allow={a=1}", "memory.solver_allow = {'a': 1} has the wrong type: expected list (a list like"),
    ("checkpointing.per_block=[1, 2]", "expected dict or list (a table like {name = 1} or a list like"),
    ("checkpointing.per_block={all=two}", "checkpointing.per_block.all = 'two' has the wrong type: expected int"),
    ("optimizer.betas=[a, b]", "optimizer.betas[0] = 'a' has the wrong type: expected float"),
    ("optimizer.betas={b1=0.9}", "optimizer.betas = {'b1': 0.9} has the wrong type: expected list (a list like [0.9"),
])
def test_a_malformed_list_or_table_on_set_shows_the_accepted_form(item, fragment):
    with pytest.raises(ValueError) as e:
        EngineConfig.from_dict(apply_overrides({}, [item]))
    assert fragment in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("item, fragment", [
    ("zero.stage", "must look like section.key=value"),
    ("stage=2", "the key must be section.key"),
    ("zeroo.stage=2", "unknown section 'zeroo'"),
    ("zero.stages=2", "unknown key zero.stages"),
    ("model.n_layer=two", "model.n_layer = 'two' has the wrong type: expected int"),
    ("train.tensorboard=maybe", "has the wrong type: expected bool"),
])
def test_bad_set_override(item, fragment):
    with pytest.raises(ValueError, match=None) as e:
        apply_overrides({}, [item])
    assert fragment in str(e.value)


def test_toml_file_and_errors(tmp_path):
    good = tmp_path / "c.toml"
    good.write_text('seed = 3\n[zero]\nstage = 1\n[precision]\nmode = "bf16"\n')
    cfg = load_config(good, ["zero.stage=2"])
    assert (cfg.seed, cfg.zero.stage, cfg.precision.mode) == (3, 2, "bf16")
    with pytest.raises(ValueError, match="no such file"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[zero\nstage = 1\n")
    with pytest.raises(ValueError, match="is not valid TOML"):
        load_config(bad)


def test_parse_bytes_units():
    assert parse_bytes("1KiB") == 1024 and parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes(5) == 5
    with pytest.raises(ValueError):
        parse_bytes("-1GiB")


def test_python_api_does_not_clip_but_the_cli_recipe_clips_at_one(tmp_path):
    from mct.config import CLI_RECIPE
    assert EngineConfig.from_dict({}).train.grad_clip == 0.0
    assert EngineConfig().train.grad_clip == 0.0
    assert load_config(None, [], defaults=CLI_RECIPE).train.grad_clip == 1.0
    f = tmp_path / "c.toml"
    f.write_text("[train]\ngrad_clip = 0.5\nsteps = 3\n")
    cfg = load_config(f, [], defaults=CLI_RECIPE)
    assert (cfg.train.grad_clip, cfg.train.steps) == (0.5, 3)  # the file overrides the recipe key by key
    assert load_config(f, ["train.grad_clip=0"], defaults=CLI_RECIPE).train.grad_clip == 0.0


@pytest.mark.parametrize("d,fragment", [
    ({"train": {"lr": float("nan")}}, "train.lr = nan"),
    ({"train": {"weight_decay": float("inf")}}, "train.weight_decay = inf"),
    ({"zero": {"bucket_mb": float("-inf")}}, "zero.bucket_mb = -inf"),
    ({"seed": -1}, "seed = -1"),
    ({"distributed": {"timeout_s": 1e30}}, "distributed.timeout_s"),
    ({"train": {"eval_every": 5, "eval_batches": 0}}, "train.eval_batches = 0"),
    ({"memory": {"budget": "1GiB", "enforce": True, "track": False}}, "memory.track = False"),
    ({"model": {"attention": "flash"}}, "model.attention = 'flash'"),
])
def test_non_finite_and_out_of_range_values_are_refused(d, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        EngineConfig.from_dict(d)


def test_dataclass_construction_refuses_nan_too():
    from mct.config import TrainConfig
    with pytest.raises(ValueError, match="train.lr = nan"):
        TrainConfig(lr=float("nan"))
