"""LoRA injection (``mct.adapters``): the ``[adapter]`` section's checks, which layers the
default targets pick in the built-in GPT, a transformers Llama and GPT-2 (Conv1D) and a
``module:factory`` model, the names and initial values of the adapters, the frozen base,
one-line errors for patterns, and logits bit-identical to the base's at init."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from mct.adapters import adapter_parameters, apply_adapters
from mct.config import AdapterConfig, EngineConfig
from mct.models.gpt import GPT
from mct.task import task_for
from mct.task.build import build_model
from tests.helpers import TINY_MODEL

LORA = AdapterConfig(kind="lora", rank=4, alpha=8.0)


@pytest.mark.parametrize("key, value, words", [
    ("kind", "lorra", "choose 'none', 'lora' or 'qlora'"),
    ("rank", 0, "must be an integer >= 1"),
    ("alpha", 0.0, "must be > 0"),
    ("dropout", 1.0, "must be in [0, 1)"),
    ("dropout", -0.1, "must be in [0, 1)"),
    ("base_dtype", "int4", "choose 'auto' or 'nf4'"),
    ("targets", ["*q_proj", " "], "drop the empty one"),
])
def test_adapter_config_mistakes_name_the_key_and_the_choices(key, value, words):
    with pytest.raises(ValueError) as e:
        EngineConfig.from_dict({"adapter": {"kind": "lora", key: value}})
    assert f"adapter.{key} = {value!r}" in str(e.value) and words in str(e.value) and "\n" not in str(e.value)


def test_nf4_base_needs_qlora():
    with pytest.raises(ValueError, match=r"adapter.base_dtype = 'nf4' .* set adapter.kind = 'qlora'"):
        EngineConfig.from_dict({"adapter": {"kind": "lora", "base_dtype": "nf4"}})


def test_adapter_keys_are_fixed_on_resume():
    from mct.config import resume_rules
    rules = resume_rules()
    assert all(not rules[f"adapter.{k}"].allowed for k in ("kind", "rank", "alpha", "dropout", "targets", "base_dtype"))


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(EngineConfig.from_dict({"model": TINY_MODEL}).model)


def test_gpt_default_targets_are_the_block_projections_and_everything_else_is_frozen():
    model = _gpt()
    names = apply_adapters(model, LORA)
    assert names == [f"blocks.{i}.{p}" for i in range(2) for p in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(adapter_parameters(model)) == {f"{n}.lora_{x}.weight" for n in names for x in "AB"}
    qkv = model.blocks[0].attn.qkv
    assert qkv.lora_A.weight.shape == (4, 32) and qkv.lora_B.weight.shape == (96, 4)
    assert qkv.lora_B.weight.abs().sum() == 0 and qkv.lora_A.weight.abs().sum() > 0
    assert qkv.lora_A.bias is None and not qkv.weight.requires_grad and not qkv.bias.requires_grad


def test_adapters_at_init_leave_the_logits_bit_identical():
    x = torch.randint(0, 256, (2, 16))
    base = _gpt()
    adapted = _gpt()
    apply_adapters(adapted, AdapterConfig(kind="lora", rank=4, alpha=8.0, dropout=0.1))
    with torch.no_grad():
        want, got = base(x), adapted(x)
    assert torch.equal(want, got)
    adapted.train()
    got_train = adapted(x)  # dropout on the adapter's input only: B = 0 still adds exactly nothing
    assert torch.equal(base.train()(x), got_train)


def test_adapter_output_is_the_scaled_low_rank_update():
    model = _gpt()
    apply_adapters(model, LORA)
    layer = model.blocks[1].mlp.fc
    nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(3, 32)
    want = x @ layer.weight.T + layer.bias + (x @ layer.lora_A.weight.T @ layer.lora_B.weight.T) * (8.0 / 4)
    torch.testing.assert_close(layer(x), want, rtol=1e-6, atol=1e-6)


def test_a_deep_copy_uses_its_own_adapters():
    model = _gpt()
    apply_adapters(model, LORA)
    twin = copy.deepcopy(model)
    nn.init.normal_(twin.blocks[0].attn.qkv.lora_B.weight)
    x = torch.randn(2, 32)
    assert not torch.equal(twin.blocks[0].attn.qkv(x), model.blocks[0].attn.qkv(x))


def test_patterns_select_layers_by_name():
    model = _gpt()
    assert apply_adapters(model, AdapterConfig(kind="lora", targets=["*.attn.qkv"])) == ["blocks.0.attn.qkv",
                                                                                          "blocks.1.attn.qkv"]


def test_a_pattern_that_matches_nothing_names_what_it_could_match():
    with pytest.raises(ValueError) as e:
        apply_adapters(_gpt(), AdapterConfig(kind="lora", targets=["*.attn.qkv", "*q_proj"]))
    msg = str(e.value)
    assert "'*q_proj' matches no linear layer" in msg and "blocks.0.attn.qkv" in msg and "\n" not in msg


def test_the_output_head_takes_no_adapter():
    with pytest.raises(ValueError, match="'lm_head' selects the output head"):
        apply_adapters(_gpt(), AdapterConfig(kind="lora", targets=["lm_head"]))


def test_adapters_cannot_be_applied_twice():
    model = _gpt()
    apply_adapters(model, LORA)
    with pytest.raises(ValueError, match="already has adapters"):
        apply_adapters(model, LORA)


def test_kind_none_changes_nothing():
    model = _gpt()
    assert apply_adapters(model, AdapterConfig()) == [] and all(p.requires_grad for p in model.parameters())


def test_task_for_builds_adapted_models_normally_and_on_meta():
    cfg = EngineConfig.from_dict({"model": TINY_MODEL, "adapter": {"kind": "lora", "rank": 2}})
    task = task_for(cfg)
    model, _ = build_model(task, cfg, on_meta=False)
    meta, program = build_model(task, cfg, on_meta=True)
    program.materialize(list(meta.parameters()))
    real, rebuilt = dict(model.named_parameters()), dict(meta.named_parameters())
    assert set(real) == set(rebuilt) and all(torch.equal(real[n], rebuilt[n]) for n in real)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(adapter_parameters(model))


def factory() -> nn.Module:
    """A ``module:factory`` model: two blocks of a linear layer each, and a head."""
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(256, 16)
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(2))
            self.lm_head = nn.Linear(16, 256)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x)
            for layer in self.layers:
                h = h + layer(h)
            return self.lm_head(h)
    return Net()


def test_module_factory_models_get_adapters():
    cfg = EngineConfig.from_dict({"model": {"source": "tests.adapters.test_lora:factory", "seq_len": 16},
                                  "adapter": {"kind": "lora"}})
    model = task_for(cfg).model_fn()
    assert sorted(adapter_parameters(model)) == [f"layers.{i}.0.lora_{x}.weight" for i in range(2) for x in "AB"]


@pytest.mark.parametrize("kind, expected", [
    ("llama", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj"]),
    ("gpt2", ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]),
])
def test_hf_default_targets_are_attention_and_mlp_projections(tmp_path, kind, expected):
    pytest.importorskip("transformers")
    from tests.task.test_task_hf import save_tiny
    d = save_tiny(kind, tmp_path / kind, weights=False)
    cfg = EngineConfig.from_dict({"model": {"source": f"hf:{d}", "seq_len": 16}, "adapter": {"kind": "lora"}})
    task = task_for(cfg)
    model = task.model_fn()
    prefix = "model.layers" if kind == "llama" else "transformer.h"
    adapted = sorted({n.rsplit(".lora_", 1)[0] for n in adapter_parameters(model)})
    assert adapted == sorted(f"{prefix}.{i}.{p}" for i in range(2) for p in expected)
    torch.manual_seed(0)
    base = copy.deepcopy(model)
    for m in base.modules():
        m._forward_hooks.clear()
    x = torch.randint(0, 256, (2, 16))
    model.eval(), base.eval()
    with torch.no_grad():
        assert torch.equal(model(x).logits, base(x).logits)  # B = 0: Conv1D's [in, out] weight included
    layer = dict(model.named_modules())[f"{prefix}.0.{expected[0]}"]
    nn.init.normal_(layer.lora_B.weight)
    h = torch.randn(3, layer.lora_A.in_features)
    with torch.no_grad():
        delta = layer(h) - base.get_submodule(f"{prefix}.0.{expected[0]}")(h)
        want = h @ layer.lora_A.weight.T @ layer.lora_B.weight.T * (16.0 / 8)
    torch.testing.assert_close(delta, want, rtol=1e-5, atol=1e-5)


def test_adapter_keys_without_adapters_are_refused():
    with pytest.raises(ValueError, match=r"adapter.rank = 4 .* adapter.kind = 'none' trains without them"):
        EngineConfig.from_dict({"adapter": {"rank": 4}})


def test_the_summary_line_counts_adapters_against_every_parameter():
    from mct.adapters import adapter_summary
    model = _gpt()
    assert adapter_summary(model, AdapterConfig()) == ""
    apply_adapters(model, LORA)
    line = adapter_summary(model, LORA)
    trainable = sum(p.numel() for p in adapter_parameters(model).values())
    assert line.startswith("lora rank 4, alpha 8 on 8 layers: ") and f"{trainable:,} trainable of " in line


def test_an_engine_told_to_train_adapters_refuses_a_model_without_them():
    from mct.engine import Engine
    cfg = EngineConfig.from_dict({"model": TINY_MODEL, "adapter": {"kind": "lora"}})
    with pytest.raises(ValueError, match=r"the model has no adapters: call mct.adapters.apply_adapters") as e:
        Engine(_gpt(), config=cfg)
    assert "\n" not in str(e.value)
    model = _gpt()
    apply_adapters(model, cfg.adapter)
    assert Engine(model, config=cfg).optimizer is not None  # the Python API's way


def test_a_model_without_blocks_needs_patterns_and_is_told_which():
    with pytest.raises(ValueError, match=r"has no nn.ModuleList of blocks: name the layers, e.g. adapter.targets = "
                                         r"\[\"\*0\", \"\*2\"\]"):
        apply_adapters(nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4)), LORA)
