"""Adapters out of a run: `mct export --format peft` loads in peft 0.21 and gives the run's
logits; `--format hf --merge` and `--out FILE.safetensors --merge` give the base with
W + B A * alpha/rank, loadable by transformers / the base model, with the run's logits;
runs without adapters (or adapter runs exported unmerged to --format hf) get one line.

The adapted run is made with the Python API on a tiny transformers Llama, adapters put in
as the shared contract states (``inject_lora``), so these tests do not need a CLI run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from mct.cli import main  # noqa: E402
from mct.engine import Engine  # noqa: E402
from tests.helpers import adamw, checkpointed_run, tiny_config  # noqa: E402
from tests.task.test_task_hf import save_tiny  # noqa: E402

RANK, ALPHA = 4, 8.0
TARGETS = ("q_proj", "v_proj", "down_proj")


def inject_lora(model: nn.Module, rank: int, alpha: float, suffixes: tuple[str, ...]) -> list[str]:
    """The adapter contract by hand: each targeted nn.Linear P keeps its (frozen) weight
    and gains P.lora_A [rank, in] (kaiming-uniform), P.lora_B [out, rank] (zeros) and a
    forward hook adding lora_B(lora_A(x)) * alpha / rank. Every other parameter frozen."""
    for p in model.parameters():
        p.requires_grad_(False)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.endswith(suffixes)]
    for n in names:
        m = model.get_submodule(n)
        m.lora_A = nn.Linear(m.in_features, rank, bias=False)
        nn.init.kaiming_uniform_(m.lora_A.weight, a=math.sqrt(5))
        m.lora_B = nn.Linear(rank, m.out_features, bias=False)
        nn.init.zeros_(m.lora_B.weight)
        m.register_forward_hook(lambda mod, args, out: out + mod.lora_B(mod.lora_A(args[0])) * (alpha / rank))
    return names


def _adapted(base_dir: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    inject_lora(model, RANK, ALPHA, TARGETS)
    return model


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(input_ids=x).logits.flatten(0, 1).float(), y.flatten())


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def adapter_run(tmp_path_factory) -> dict:
    """A run directory around a 3-step LoRA checkpoint of a tiny Llama (fp32, stage 0),
    and the logits its trained model gives."""
    root = tmp_path_factory.mktemp("adapters")
    base = save_tiny("llama", root / "llama")
    model = _adapted(base)
    engine = Engine(model, adamw, tiny_config())
    for step in range(3):
        engine.train_step((_tokens(step), _tokens(100 + step)), _loss)
    trained = _adapted(base)
    trained.load_state_dict(engine.full_state_dict(), strict=False)
    with torch.no_grad():
        logits = trained(input_ids=_tokens(999)).logits
    run = root / "run"
    engine.save(str(run / "checkpoints" / "step_00000003"))
    config = {"model": {"source": f"hf:{base}"},
              "adapter": {"kind": "lora", "rank": RANK, "alpha": ALPHA, "dropout": 0.0, "targets": []}}
    (run / "metadata.json").write_text(json.dumps({"config": config, "world_size": 1}))
    (run / "hf").mkdir()  # what a run of an hf: model keeps from its start: the architecture
    (run / "hf" / "config.json").write_bytes((base / "config.json").read_bytes())
    b = engine.full_state_dict()["model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert b.abs().max() > 1e-3  # trained: B moved off zero, so the adapters change the logits
    engine.close()
    return {"root": root, "base": base, "run": run, "logits": logits}


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
    assert len(config["target_modules"]) == 2 * len(TARGETS)  # 2 layers
    base = AutoModelForCausalLM.from_pretrained(str(adapter_run["base"]), dtype=torch.float32)
    plain = _max_diff(base, adapter_run["logits"])
    loaded = peft.PeftModel.from_pretrained(base, str(out))
    assert plain > 1e-3  # the base alone is not the run's model
    assert _max_diff(loaded.eval(), adapter_run["logits"]) < 1e-5


def test_peft_export_names_are_the_contracts_with_peft_prefix(adapter_run):
    from safetensors.torch import load_file
    out = adapter_run["root"] / "peft_names"
    assert main(["export", str(adapter_run["run"]), "--format", "peft", "--out", str(out)]) == 0
    got = load_file(str(out / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in got
    assert got["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (RANK, 32)
    assert all(k.startswith("base_model.model.") and ".lora_" in k for k in got)


def test_hf_merge_export_loads_in_transformers_with_the_runs_logits(adapter_run):
    from transformers import AutoModelForCausalLM
    out = adapter_run["root"] / "merged"
    assert main(["export", str(adapter_run["run"]), "--format", "hf", "--merge", "--out", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert not any("lora" in n for n, _ in model.named_parameters())
    assert _max_diff(model, adapter_run["logits"]) < 1e-5


def test_safetensors_merge_has_the_base_names_and_the_runs_logits(adapter_run):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    out = adapter_run["root"] / "merged.safetensors"
    assert main(["export", str(adapter_run["run"]), "--merge", "--out", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(str(adapter_run["base"]), dtype=torch.float32)
    got = load_file(str(out))
    assert set(got) == set(model.state_dict())  # untied head: every name, no LoRA tensor
    model.load_state_dict(got)
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
