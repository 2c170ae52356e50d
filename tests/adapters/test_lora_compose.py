"""LoRA composed with the rest of mct, each against the fp32 reference (``run_verify``) on
one rank: every checkpointing policy (selective, all, per-block, tiled MLPs), chunked loss,
activation offload, low-precision optimizer state, state offload, adapter dropout; the
transformers Llama (tiled RMSNorms) and GPT-2 (Conv1D); ``--init-from`` a base model under
new adapters; exact resume; and the planner: its tensor peak is the engine tracker's to
the byte, and its solver keeps the adapters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mct.config import EngineConfig, with_values
from tests.adapters.test_lora_exact import STEPS, lora_config, write_corpus
from tests.helpers import batches


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("lora") / "corpus.txt")


COMPOSED = {  # name -> sections over lora_config; fp32 unless the state dtype says otherwise
    "selective": {"checkpointing": {"policy": "selective"}},
    "all, stage 3": {"checkpointing": {"policy": "all"}, "zero": {"stage": 3}},
    "per-block": {"checkpointing": {"per_block": ["all", "selective"]}, "zero": {"stage": 2}},
    "tiled MLPs": {"checkpointing": {"policy": "all", "mlp_tile_tokens": 8}},
    "tiled MLPs, no recompute": {"checkpointing": {"mlp_tile_tokens": 8}, "zero": {"stage": 3}},
    "chunked loss": {"train": {"loss_chunk_tokens": 8}},
    "activation offload": {"checkpointing": {"policy": "all", "offload": "disk"}},
    "bf16 state": {"optimizer": {"state_dtype": "bf16"}},
    "int8 state": {"optimizer": {"state_dtype": "int8"}, "zero": {"stage": 1}},
    "state offload": {"zero": {"stage": 3}, "offload": {"optimizer": "cpu", "params": "cpu"}},
    "adapter dropout": {"adapter": {"dropout": 0.1}, "checkpointing": {"policy": "all"}},
    "replay verify, dropout, stage 3": {"adapter": {"dropout": 0.1}, "zero": {"stage": 3},
                                        "checkpointing": {"policy": "selective", "verify": True}},
}


@pytest.mark.parametrize("name", list(COMPOSED))
def test_lora_composes_with_every_technique_within_the_reference_tolerance(corpus, tmp_path, name):
    from mct.verify.compare import run_verify
    sections = {**COMPOSED[name]}
    if "offload" in sections.get("checkpointing", {}):
        sections["offload"] = {"dir": str(tmp_path)}
    cfg = lora_config(corpus, **sections)
    report = run_verify(cfg, STEPS)
    assert report.passed and report.frozen and not report.frozen_changed, report.table()
    if cfg.optimizer.state_dtype == "fp32":
        assert report.max_loss_rel <= 1e-6 and report.param_rel <= 1e-6, report.table()
    if cfg.checkpointing.policy != "none":
        assert report.recomputed_blocks > 0
    if cfg.checkpointing.mlp_tile_tokens:
        assert report.mlp_tiles > 0


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    pytest.importorskip("transformers")
    from tests.task.test_task_hf import save_tiny
    root = tmp_path_factory.mktemp("hf")
    return {k: str(save_tiny(k, root / k)) for k in ("llama", "gpt2")}


def hf_lora(d: dict, kind: str, corpus: str, **sections: dict) -> EngineConfig:
    base = {"model": {"source": f"hf:{d[kind]}", "seq_len": 16},
            "data": {"path": corpus, "micro_batch_size": 2, "grad_accum": 2}, "train": {"warmup_steps": 0},
            "adapter": {"kind": "lora"}}
    for k, v in sections.items():
        base.setdefault(k, {}).update(v)
    return EngineConfig.from_dict(base)


@pytest.mark.parametrize("kind, sections", [
    ("llama", {"zero": {"stage": 3}, "checkpointing": {"policy": "selective", "mlp_tile_tokens": 8}}),
    ("gpt2", {"zero": {"stage": 3}, "checkpointing": {"policy": "all"}}),
    ("gpt2", {"zero": {"stage": 1}, "precision": {"mode": "bf16"}}),
])
def test_lora_on_hf_models_matches_the_reference(hf_dirs, corpus, kind, sections):
    from mct.verify.compare import run_verify
    cfg = hf_lora(hf_dirs, kind, corpus, **sections)
    report = run_verify(cfg, STEPS)
    assert report.passed and report.frozen and not report.frozen_changed, report.table()
    if cfg.precision.mode == "fp32":
        assert report.max_loss_rel <= 1e-6 and report.param_rel <= 1e-6, report.table()


@pytest.mark.parametrize("stage", [0, 3])
def test_init_from_a_base_model_loads_the_base_and_keeps_the_new_adapters(hf_dirs, corpus, stage):
    """The first loss equals plain transformers' on the saved weights (B = 0), and the
    adapters hold their initial values (A as built, B zeros)."""
    from transformers import AutoModelForCausalLM
    import mct
    from mct.adapters import adapter_parameters
    from mct.persistence.init_from import load_pretrained
    from mct.task import build_model, task_for
    plain = AutoModelForCausalLM.from_pretrained(hf_dirs["llama"]).eval()
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(3))
    want = plain(input_ids=x, labels=x).loss.item()
    cfg = hf_lora(hf_dirs, "llama", corpus, zero={"stage": stage})
    task = task_for(cfg)
    fresh, _ = build_model(task, cfg, on_meta=False)
    model, program = build_model(task, cfg, on_meta=stage == 3)
    engine = mct.Engine(model, task.optimizer, cfg, param_groups=task.param_groups(model), init_program=program)
    load_pretrained(engine, hf_dirs["llama"])
    got = engine.eval_loss((x[:, :-1], x[:, 1:]), task.loss_fn)
    assert abs(got - want) <= 1e-6 * abs(want), (got, want)
    state = engine.full_state_dict()
    for name, p in adapter_parameters(fresh).items():
        assert torch.equal(state[name], p), name
    saved = dict(plain.named_parameters())
    assert torch.equal(state["model.layers.0.self_attn.q_proj.weight"], saved["model.layers.0.self_attn.q_proj.weight"])


def test_resume_gives_the_bytes_of_an_uninterrupted_run(corpus, tmp_path):
    """2 steps, then --resume to 4, equals 4 steps in one go, byte for byte (constant LR:
    the schedule does not depend on train.steps)."""
    from safetensors.torch import load_file
    from mct.persistence.resume import resume_config
    from mct.run.trainer import train
    cfg = lora_config(corpus, zero={"stage": 2}, checkpointing={"policy": "selective"},
                      train={"eval_every": 0, "lr_schedule": "constant", "checkpoint_every": 1, "steps": 2})
    train(cfg, tmp_path / "cut", progress=False)
    train(resume_config(str(tmp_path / "cut"), ["train.steps=4"], 1), tmp_path / "cut", progress=False, resume=True)
    train(with_values(cfg, {"train.steps": 4}), tmp_path / "whole", progress=False)
    got, want = (load_file(str(tmp_path / r / "model.safetensors")) for r in ("cut", "whole"))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert any("lora_B" in k and want[k].abs().sum() > 0 for k in want)


@pytest.mark.parametrize("stage, mode", [(0, "fp32"), (1, "bf16"), (2, "fp32"), (3, "bf16")])
def test_the_planned_tensor_peak_is_the_trackers_to_the_byte(stage, mode):
    import mct
    from mct.engine import Engine
    from mct.task import build_model, task_for
    cfg = lora_config("", zero={"stage": stage}, precision={"mode": mode}, checkpointing={"policy": "all"})
    task = task_for(cfg)
    model, program = build_model(task, cfg, on_meta=stage == 3)
    engine = Engine(model, task.optimizer, cfg, param_groups=task.param_groups(model), init_program=program)
    peaks = [engine.train_step(batches(s, 0, 1), task.loss_fn).metrics["peak_bytes"] for s in range(2)]
    assert mct.predict_peak(task.model_fn, task.loss_fn, batches(0, 0, 1)[0], cfg, world_size=1,
                            optimizer=task.optimizer, param_groups=task.param_groups) == peaks[1]


def test_the_solver_plans_adapter_runs_and_keeps_them():
    from mct.planner.auto import resolve_auto
    from mct.task import task_for
    cfg = lora_config("", zero={"stage": "auto"}, memory={"budget": "64MiB", "budget_counts": "tensors"})
    resolved, choice = resolve_auto(cfg, 1, task_for(cfg))
    assert resolved.adapter == cfg.adapter and resolved.zero.stage in (0, 1, 2, 3) and choice is not None


def test_a_diverged_lora_run_rolls_back_and_replays_to_the_clean_runs_bytes(corpus, tmp_path, monkeypatch):
    """corrupt@5 multiplies every master (the adapters) by 1e3 after step 5's update: the loss
    spike rolls back to the step-4 snapshot and the replay ends on the clean run's bytes."""
    from mct.reporting.events import read_events
    from mct.run.trainer import train
    cfg = lora_config(corpus, train={"steps": 8, "eval_every": 0, "log_every": 1, "snapshot_every": 2,
                                     "warmup_steps": 2, "lr": 1e-2})
    train(cfg, tmp_path / "clean", progress=False)
    monkeypatch.setenv("MCT_FAULT", "corrupt@5")
    train(cfg, tmp_path / "faulty", progress=False)
    monkeypatch.delenv("MCT_FAULT")
    events = read_events(tmp_path / "faulty")
    assert [(e["kind"], e["action"]) for e in events] == [("rollback", "replay: restore step 4")], events
    assert (tmp_path / "faulty" / "model.safetensors").read_bytes() == \
        (tmp_path / "clean" / "model.safetensors").read_bytes()


def test_an_hf_adapter_run_writes_merged_hf_weights_and_refuses_an_unmerged_export(hf_dirs, corpus, tmp_path):
    """transformers would load an unmerged RUN_DIR/hf/ as the base model, silently without the
    adapters: the run writes the base with B A merged in, and `--format hf` without --merge
    is refused in one line."""
    from safetensors.torch import load_file
    from mct.persistence.hf_export import export_hf
    from mct.run.trainer import train
    cfg = hf_lora(hf_dirs, "llama", corpus, train={"steps": 2, "eval_every": 0, "init_from": hf_dirs["llama"]})
    train(cfg, tmp_path / "run", progress=False)
    names = [n for f in (tmp_path / "run" / "hf").glob("*.safetensors") for n in load_file(f)]
    assert names and not any("lora_" in n for n in names), names
    with pytest.raises(ValueError, match=r"trained LoRA adapters.* add --merge") as e:
        export_hf(tmp_path / "run", tmp_path / "out")
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()
