"""`mct train --model hf:DIR` end to end with a tiny HF GPT-2 (tied head, dropout) and
Llama: killed with SIGKILL and resumed bit-identical; the run's
RUN_DIR/hf/ and `mct export --format hf` load with `from_pretrained` and give the run's
logits; `mct sample` prints text from the run's weights."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from mct.config import EngineConfig  # noqa: E402
from mct.persistence.resume import resume_config  # noqa: E402
from mct.run.recipe import train_config  # noqa: E402
from mct.run.trainer import train  # noqa: E402
from tests.task.test_task_hf import save_tiny  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
STEPS = 4


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hfrun")
    save_tiny("gpt2", root / "gpt2")
    save_tiny("llama", root / "llama")
    (root / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    return root


def _cfg(root: Path, kind: str = "gpt2", **train_keys) -> dict:
    return {"seed": 3, "model": {"source": f"hf:{root / kind}", "seq_len": 16},
            "data": {"path": str(root / "corpus.txt"), "micro_batch_size": 2},
            "train": {"steps": STEPS, "warmup_steps": 1, "eval_every": 2, "eval_batches": 1, "log_every": 1,
                      "checkpoint_every": 1, "keep_checkpoints": 5, "grad_clip": 1.0,
                      "init_from": str(root / kind), **train_keys},
            "zero": {"stage": 3}, "checkpointing": {"policy": "selective"}}


@pytest.fixture(scope="module")
def base(root) -> Path:
    run = root / "base"
    with _one_thread():  # as the CLI run it is compared with: bit-identity is per thread count
        # the config `mct train` makes of these flags (its recipe: fine-tune, since init_from is set)
        train(train_config(None, _flags(_cfg(root))[1::2]), run, progress=False)
    return run


@contextlib.contextmanager
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _flags(d: dict) -> list[str]:
    out = [f"seed={d['seed']}"]
    for section, values in d.items():
        if isinstance(values, dict):
            out += [f"{section}.{k}={v}" for k, v in values.items()]
    return [a for s in out for a in ("--set", s)]


@pytest.mark.cli
def test_killed_hf_run_resumes_bit_identical(root, base):
    run = root / "killed"
    env = dict(os.environ, OMP_NUM_THREADS="1", MCT_FAULT="kill@2:0",
               PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "mct", "train", "--run-dir", str(run), "--no-progress",
                           *_flags(_cfg(root))], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    with _one_thread():
        train(resume_config(run, [], 1), run, progress=False, resume=True)
    assert (run / "model.safetensors").read_bytes() == (base / "model.safetensors").read_bytes()


def test_hf_export_and_run_hf_dir_give_the_runs_logits(root, base, capsys):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from mct.cli import main
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    own = AutoModelForCausalLM.from_pretrained(str(root / "gpt2")).eval()
    own.load_state_dict(load_file(str(base / "model.safetensors")), strict=False)
    with torch.no_grad():
        want = own(x).logits
        run_hf = AutoModelForCausalLM.from_pretrained(str(base / "hf")).eval()
        assert torch.equal(run_hf(x).logits, want)
        assert main(["export", str(base), "--format", "hf", "--out", str(root / "bf16"), "--dtype", "bf16",
                     "--max-shard-size", "40KB"]) == 0
        assert (root / "bf16" / "model.safetensors.index.json").is_file()
        bf16 = AutoModelForCausalLM.from_pretrained(str(root / "bf16")).eval()
        assert bf16.dtype == torch.bfloat16
        got = bf16.float()(x).logits
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert main(["export", str(base), "--format", "hf", "--out", str(root / "bf16")]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    # --force replaces an earlier export whole (fp32 over the bf16 one; no shard of it left)
    assert main(["export", str(base), "--format", "hf", "--out", str(root / "bf16"), "--force"]) == 0
    assert sorted(p.name for p in (root / "bf16").glob("*.safetensors")) == ["model.safetensors"]
    assert not list(root.glob(".bf16.*"))  # no temporary or set-aside directory left


def test_sample_continues_the_prompt_with_the_runs_greedy_tokens(root, base, capsys):
    from transformers import AutoModelForCausalLM
    from mct.cli import main
    assert main(["sample", str(base), "--prompt", "the quick", "--tokens", "5", "--temperature", "0"]) == 0
    text = capsys.readouterr().out[:-1]  # print's newline
    ids = list(b"the quick")
    model = AutoModelForCausalLM.from_pretrained(str(base / "hf")).eval()
    with torch.no_grad():
        for _ in range(5):
            ids.append(int(model(torch.tensor([ids[-16:]])).logits[0, -1].argmax()))
    assert text == bytes(ids).decode("utf-8", errors="replace")
    assert main(["sample", str(base), "--tokens", "0"]) == 2
    assert main(["sample", str(base), "--tokens", "8", "--seed", "1"]) == 0
    capsys.readouterr()


def test_init_from_a_run_a_safetensors_file_and_a_sharded_hf_dir(root, base):
    """Fine-tuning sources: an mct run dir (its newest checkpoint), a .safetensors file,
    and a sharded HF directory (model.safetensors.index.json), each read slice by slice."""
    import mct
    from safetensors.torch import load_file
    from mct.cli import main
    from mct.persistence.init_from import load_pretrained
    from mct.task import build_model, task_for
    final = load_file(str(base / "model.safetensors"))
    sharded = root / "sharded"
    assert main(["export", str(base), "--format", "hf", "--out", str(sharded), "--max-shard-size", "30KB"]) == 0
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    for source in (base, base / "model.safetensors", sharded):
        cfg = EngineConfig.from_dict({"model": {"source": f"hf:{root / 'gpt2'}", "seq_len": 16},
                                      "zero": {"stage": 3}, "offload": {"optimizer": "cpu"}})
        task = task_for(cfg)
        model, program = build_model(task, cfg, on_meta=True)
        engine = mct.Engine(model, lambda g: torch.optim.SGD(g, lr=0.0), cfg, init_program=program)
        load_pretrained(engine, source)
        got = engine.full_state_dict()
        assert set(got) == set(final) and all(torch.equal(got[k], final[k]) for k in final), source
        engine.close()
