"""Adapters out of a run: `mct export --format peft` loads in peft 0.21 and gives the run's
logits; `--format hf --merge` and `--out FILE.safetensors --merge` give the base with
W + B A * alpha/rank, loadable by transformers / the base model, with the run's logits;
runs without adapters (or adapter runs exported unmerged to --format hf) get one line.

The adapted run is made with the Python API (``mct.adapters.apply_adapters``) on a tiny
transformers Llama (nn.Linear) and GPT-2 (Conv1D: weights stored [in, out], peft's
fan_in_fan_out), so these tests need no CLI run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from mct.adapters import apply_adapters  # noqa: E402
from mct.cli import main  # noqa: E402
from mct.config import AdapterConfig, EngineConfig  # noqa: E402
from mct.engine import Engine  # noqa: E402
from mct.task import task_for  # noqa: E402
from tests.helpers import adamw, checkpointed_run, tiny_config  # noqa: E402
from tests.task.test_task_hf import save_tiny  # noqa: E402

RANK, ALPHA = 4, 8.0
TARGETS = {"llama": ["*q_proj", "*v_proj", "*down_proj"], "gpt2": ["*c_attn", "*mlp.c_proj"]}


def _adapted(base_dir: Path, kind: str) -> nn.Module:
    from transformers import AutoModelForCausalLM
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    apply_adapters(model, AdapterConfig(kind="lora", rank=RANK, alpha=ALPHA, targets=TARGETS[kind]))
    return model.eval()  # GPT-2's dropout off: logits comparable


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(input_ids=x).logits.flatten(0, 1).float(), y.flatten())


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def adapter_run(tmp_path_factory, request) -> dict:
    """A run directory around a 3-step LoRA checkpoint of a tiny Llama or GPT-2 (fp32,
    stage 0), and the logits its trained model gives."""
    kind = request.param
    root = tmp_path_factory.mktemp(f"adapters_{kind}")
    base = save_tiny(kind, root / kind)
    model = _adapted(base, kind)
    engine = Engine(model, adamw, tiny_config())
    for step in range(3):
        engine.train_step((_tokens(step), _tokens(100 + step)), _loss)
    trained = _adapted(base, kind)
    trained.load_state_dict(engine.full_state_dict(), strict=False)
    with torch.no_grad():
        logits = trained(input_ids=_tokens(999)).logits
    run = root / "run"
    engine.save(str(run / "checkpoints" / "step_00000003"))
    config = {"model": {"source": f"hf:{base}", "seq_len": 16},
              "adapter": {"kind": "lora", "rank": RANK, "alpha": ALPHA, "dropout": 0.0, "targets": TARGETS[kind]}}
    (run / "metadata.json").write_text(json.dumps({"config": config, "world_size": 1}))
    (run / "hf").mkdir()  # what a run of an hf: model keeps from its start: the architecture
    (run / "hf" / "config.json").write_bytes((base / "config.json").read_bytes())
    b = [t for n, t in engine.full_state_dict().items() if n.endswith("lora_B.weight")][0]
    assert b.abs().max() > 1e-3  # trained: B moved off zero, so the adapters change the logits
    engine.close()
    return {"root": root, "base": base, "run": run, "logits": logits, "kind": kind}


def _max_diff(model: nn.Module, want: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(input_ids=_tokens(999)).logits - want).abs().max().item()


def test_peft_export_loads_in_peft_with_the_runs_logits(adapter_run, capsys):
    from transformers import AutoModelForCausalLM
    out = adapter_run["root"] / "peft"
    assert main(["export", str(adapter_run["run"]), "--format", "peft", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (RANK, ALPHA,
                                                                                      str(adapter_run["base"]))
    assert len(config["target_modules"]) == 2 * len(TARGETS[adapter_run["kind"]])  # 2 layers
    assert config["fan_in_fan_out"] == (adapter_run["kind"] == "gpt2")
    base = AutoModelForCausalLM.from_pretrained(str(adapter_run["base"]), dtype=torch.float32).eval()
    plain = _max_diff(base, adapter_run["logits"])
    loaded = peft.PeftModel.from_pretrained(base, str(out))
    assert plain > 1e-3  # the base alone is not the run's model
    assert _max_diff(loaded.eval(), adapter_run["logits"]) < 1e-5


def test_peft_export_names_are_the_contracts_with_peft_prefix(adapter_run):
    from safetensors.torch import load_file
    out = adapter_run["root"] / "peft_names"
    assert main(["export", str(adapter_run["run"]), "--format", "peft", "--out", str(out)]) == 0
    got = load_file(str(out / "adapter_model.safetensors"))
    module, hidden = {"llama": ("model.layers.1.mlp.down_proj", 64),
                      "gpt2": ("transformer.h.1.mlp.c_proj", 128)}[adapter_run["kind"]]
    assert got[f"base_model.model.{module}.lora_A.weight"].shape == (RANK, hidden)  # the MLP's hidden width in
    assert got[f"base_model.model.{module}.lora_B.weight"].shape == (32, RANK)
    assert all(k.startswith("base_model.model.") and ".lora_" in k for k in got)


def test_hf_merge_export_loads_in_transformers_with_the_runs_logits(adapter_run):
    from transformers import AutoModelForCausalLM
    out = adapter_run["root"] / "merged"
    assert main(["export", str(adapter_run["run"]), "--format", "hf", "--merge", "--out", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert not any("lora" in n for n, _ in model.named_parameters())
    assert _max_diff(model, adapter_run["logits"]) < 1e-5


def test_safetensors_merge_has_the_base_names_and_the_runs_logits(adapter_run):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    out = adapter_run["root"] / "merged.safetensors"
    assert main(["export", str(adapter_run["run"]), "--merge", "--out", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(str(adapter_run["base"]), dtype=torch.float32).eval()
    got = load_file(str(out))
    assert not any("lora" in n for n in got) and set(got) <= set(model.state_dict())
    model.load_state_dict(got, strict=False)  # (GPT-2's tied head is saved once, as named_parameters)
    assert _max_diff(model, adapter_run["logits"]) < 1e-5


def test_adapter_run_exported_to_hf_without_merge_is_refused_in_one_line(adapter_run, capsys):
    out = adapter_run["root"] / "unmerged"
    assert main(["export", str(adapter_run["run"]), "--format", "hf", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mct: error: --format hf: the run of") and "--merge" in err and "\n" not in err
    assert not out.exists()


@pytest.mark.parametrize("argv", [["--format", "peft", "--out", "{tmp}/p"], ["--merge", "--out", "{tmp}/m.st"],
                                  ["--format", "hf", "--merge", "--out", "{tmp}/h"]], ids=["peft", "merge", "hf"])
def test_run_without_adapters_asking_for_adapters_is_one_line(tmp_path, capsys, argv):
    run, engine, _ = checkpointed_run(tmp_path)
    engine.close()
    (run / "metadata.json").write_text(json.dumps({"config": {"model": {"source": "gpt"},
                                                              "adapter": {"kind": "none"}}, "world_size": 1}))
    assert main(["export", str(run), *[a.format(tmp=tmp_path) for a in argv]]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("mct: error: ")
    assert "adapter" in err
    assert not any(p.name[0] in "pmh" for p in tmp_path.iterdir() if p.name != "run")


@pytest.mark.slow
def test_trained_lora_run_exports_to_peft_with_the_runs_logits(tmp_path):
    """The whole path: a LoRA run of `mct train`'s loop (stage 3, 3 steps) from a tiny Llama's
    weights, exported, loaded by peft: the logits of the run's final model.safetensors."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from mct.run.recipe import train_config
    from mct.run.trainer import train
    base = save_tiny("llama", tmp_path / "llama")
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    sets = {"model.source": f"hf:{base}", "train.init_from": str(base), "data.path": str(tmp_path / "corpus.txt"),
            "model.seq_len": 16, "data.micro_batch_size": 2, "train.steps": 3, "train.eval_every": 3,
            "train.eval_batches": 1, "train.lr": 1e-2, "zero.stage": 3, "adapter.kind": "lora", "adapter.rank": RANK}
    cfg = train_config(None, [f"{k}={v}" for k, v in sets.items()])
    train(cfg, tmp_path / "run", progress=False)
    model = task_for(cfg).model_fn().eval()
    model.load_state_dict(load_file(str(tmp_path / "run" / "model.safetensors")))
    with torch.no_grad():
        want = model(input_ids=_tokens(999)).logits
    assert main(["export", str(tmp_path / "run"), "--format", "peft", "--out", str(tmp_path / "peft")]) == 0
    plain = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    assert _max_diff(plain, want) > 1e-3  # the adapters trained away from the base
    assert _max_diff(peft.PeftModel.from_pretrained(plain, str(tmp_path / "peft")).eval(), want) < 1e-5


def test_builtin_gpt_adapter_run_merges_into_the_gpts_names_and_loads_in_peft(tmp_path):
    """The built-in GPT (model.source = 'gpt'): `--merge --out FILE.safetensors` loads strictly
    into a plain GPT, and the peft export over that GPT base, each with the run's logits."""
    from safetensors.torch import load_file
    from mct.models.gpt import GPT, gpt_loss
    from tests.helpers import TINY_MODEL, batches
    config = {"model": dict(TINY_MODEL), "adapter": {"kind": "lora", "rank": RANK, "alpha": ALPHA}}
    cfg = EngineConfig.from_dict(config)
    torch.manual_seed(0)
    base = GPT(cfg.model)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    model = task_for(cfg).model_fn()
    model.load_state_dict(base_state, strict=False)
    engine = Engine(model, adamw, cfg)
    for step in range(2):
        engine.train_step(batches(step, 0), gpt_loss)
    run = tmp_path / "run"
    engine.save(str(run / "checkpoints" / "step_00000002"))
    (run / "metadata.json").write_text(json.dumps({"config": config, "world_size": 1}))
    trained = task_for(cfg).model_fn().eval()
    _load_tied(trained, engine.full_state_dict())
    engine.close()
    x = batches(9, 0)[0][0]
    with torch.no_grad():
        want = trained(x)
    assert main(["export", str(run), "--merge", "--out", str(tmp_path / "merged.safetensors")]) == 0
    merged = GPT(cfg.model).eval()
    _load_tied(merged, load_file(str(tmp_path / "merged.safetensors")))  # the base's names only
    assert main(["export", str(run), "--format", "peft", "--out", str(tmp_path / "peft")]) == 0
    plain = GPT(cfg.model).eval()
    plain.load_state_dict(base_state)
    loaded = peft.PeftModel.from_pretrained(plain, str(tmp_path / "peft")).eval()
    with torch.no_grad():
        for got in (merged(x), loaded(x)):
            assert (got - want).abs().max() < 1e-5


def _load_tied(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load ``state`` (named_parameters: the GPT's tied head once, as its embedding)."""
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}, result
