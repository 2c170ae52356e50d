"""A run's checkpoints reference its frozen base by content hash (``base.json``), never its
values (``mct.persistence.base_manifest``): resume rebuilds the base from the run's source
(a tiny transformers Llama, ``--init-from`` its weights, QLoRA's NF4) and checks it; the
export rebuilds it too.

Metrics: the resumed run's final weights byte-identical to an uninterrupted run's (LoRA at
stage 0, QLoRA at stage 3); a changed base file refused in one line naming a tensor; the
export of a checkpoint, and ``--init-from`` the run, equal byte for byte to the run's own
model.safetensors; QLoRA's
stored-byte digests equal at 2 ranks (stage 3), 3 ranks (stage 3) and 1 rank (stage 0).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mct.config import EngineConfig, with_values
from tests.adapters.test_lora_exact import write_corpus
from tests.distributed import run_distributed


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> dict[str, str]:
    pytest.importorskip("transformers")
    from tests.task.test_task_hf import save_tiny
    root = tmp_path_factory.mktemp("base")
    return {"dir": str(save_tiny("llama", root / "llama")), "corpus": write_corpus(root / "corpus.txt")}


def _config(llama: dict[str, str], kind: str, stage: int) -> EngineConfig:
    return EngineConfig.from_dict({
        "model": {"source": f"hf:{llama['dir']}", "seq_len": 16},
        "data": {"path": llama["corpus"], "micro_batch_size": 2, "grad_accum": 2},
        "train": {"warmup_steps": 0, "eval_every": 0, "lr_schedule": "constant", "checkpoint_every": 1, "steps": 2,
                  "init_from": llama["dir"]},
        "adapter": {"kind": kind}, "zero": {"stage": stage}})


def _resume(run: Path, steps: int) -> None:
    from mct.persistence.resume import resume_config
    from mct.run.trainer import train
    train(resume_config(str(run), [f"train.steps={steps}"], 1), run, progress=False, resume=True)


@pytest.mark.parametrize("kind, stage", [("lora", 0), ("qlora", 3)])
def test_resume_rebuilds_the_base_from_its_source_and_gives_the_bytes_of_an_uninterrupted_run(llama, tmp_path,
                                                                                              kind, stage):
    from safetensors.torch import load_file
    from mct.run.trainer import train
    cfg = _config(llama, kind, stage)
    train(cfg, tmp_path / "cut", progress=False)
    ckpt = tmp_path / "cut" / "checkpoints" / "step_00000002"
    info = json.loads((ckpt / "engine.json").read_text())
    assert not any(k.startswith("frozen/") for k in info["tensors"])  # the base is not saved...
    base = json.loads((ckpt / "base.json").read_text())  # ...but referenced: every frozen tensor, by hash
    assert base["source"]["init_from"] == llama["dir"] and "model.safetensors" in "".join(base["source"]["files"])
    assert "model.layers.0.self_attn.q_proj.weight" in base["tensors"]
    if kind == "qlora":
        assert base["tensors"]["model.layers.0.self_attn.q_proj.weight"]["codec"] == "nf4"
    _resume(tmp_path / "cut", 4)
    train(with_values(cfg, {"train.steps": 4}), tmp_path / "whole", progress=False)
    got, want = (load_file(str(tmp_path / r / "model.safetensors")) for r in ("cut", "whole"))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert any("lora_B" in k and want[k].abs().sum() > 0 for k in want)


def test_a_changed_base_file_is_refused_on_resume_in_one_line_naming_a_tensor(llama, tmp_path):
    import shutil
    from safetensors.torch import load_file, save_file
    from mct.run.trainer import train
    own = tmp_path / "llama"
    shutil.copytree(llama["dir"], own)
    train(_config({**llama, "dir": str(own)}, "lora", 0), tmp_path / "run", progress=False)
    weights = load_file(str(own / "model.safetensors"))
    weights["model.layers.1.mlp.up_proj.weight"][0, 0] += 1.0
    save_file(weights, str(own / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        _resume(tmp_path / "run", 3)
    msg = str(e.value)
    assert "tensor 'model.layers.1.mlp.up_proj.weight' sha256" in msg and "restore the base" in msg, msg
    assert "\n" not in msg


def test_export_of_a_checkpoint_rebuilds_the_base_and_equals_the_runs_own_weights(llama, tmp_path):
    from safetensors.torch import load_file
    from mct.cli import main
    from mct.run.trainer import train
    train(_config(llama, "qlora", 3), tmp_path / "run", progress=False)
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "out.safetensors")]) == 0
    got, want = load_file(str(tmp_path / "out.safetensors")), load_file(str(tmp_path / "run" / "model.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def _qlora_digests(rank: int, world: int, corpus: str, path: str, stage: int, save: bool) -> str:
    """Save (a run's checkpoint: the base by hash) or load a QLoRA GPT at ``stage``; the
    whole-base digest of this layout."""
    from mct.persistence.base_manifest import frozen_digests, whole_digest
    from mct.persistence.checkpoint import load_engine_state, save_checkpoint
    from tests.adapters.test_qlora import _engine, qlora_config
    engine, _ = _engine(qlora_config(corpus, zero={"stage": stage}))
    if save:
        save_checkpoint(path, engine, step=0, embed_base=False)
    else:
        load_engine_state(engine, path)  # raises on a digest that differs
    return whole_digest(frozen_digests(engine.frozen))


@pytest.mark.multirank
def test_qlora_stored_byte_digests_are_the_same_at_any_world_size_and_stage(tmp_path):
    corpus, path = write_corpus(tmp_path / "c.txt"), str(tmp_path / "ckpt")
    saved = run_distributed(_qlora_digests, 2, corpus, path, 3, True)
    resharded = run_distributed(_qlora_digests, 3, corpus, path, 3, False)
    alone = _qlora_digests(0, 1, corpus, path, 0, False)
    assert len(set(saved + resharded + [alone])) == 1
    base = json.loads((Path(path) / "base.json").read_text())
    assert base["sha256"] == saved[0] and any(t["codec"] == "nf4" for t in base["tensors"].values())


def test_init_from_a_run_that_references_its_base_loads_the_rebuilt_base_and_the_adapters(llama, tmp_path):
    from safetensors.torch import load_file
    from mct.engine import Engine
    from mct.persistence.init_from import load_pretrained
    from mct.run.trainer import train
    from mct.task import build_model, task_for
    cfg = _config(llama, "lora", 0)
    train(cfg, tmp_path / "run", progress=False)
    fresh = with_values(cfg, {"train.init_from": ""})
    task = task_for(fresh)
    model, _ = build_model(task, fresh, on_meta=False)
    engine = Engine(model, task.optimizer, fresh, param_groups=task.param_groups(model))
    load_pretrained(engine, str(tmp_path / "run"))
    got, want = engine.full_state_dict(), load_file(str(tmp_path / "run" / "model.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_a_reader_given_no_rebuild_refuses_a_referenced_base_in_one_line(tmp_path):
    """The readers below ``init_from`` read a base referenced by hash only through the
    ``rebuild`` they are given; without one it is one ValueError naming the checkpoint."""
    from mct.persistence.base_manifest import need_rebuild
    from mct.persistence.init_from import rebuilt_frozen
    assert need_rebuild(rebuilt_frozen, tmp_path) is rebuilt_frozen
    with pytest.raises(ValueError, match=r"references its frozen base by hash \(base.json\)") as e:
        need_rebuild(None, tmp_path)
    assert str(tmp_path) in str(e.value) and "\n" not in str(e.value)
