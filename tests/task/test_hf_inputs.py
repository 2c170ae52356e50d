"""An `hf:` run under inputs that used to give silent wrong results or lost data: the run's
Hugging Face directory and `mct export --format hf` carry the tokenizer the model was
trained with (not the model directory's); `mct sample` encodes with the run's own
tokenizer.json (not data.path's) and never falls back to bytes; `--resume` builds the
model from RUN_DIR/hf/config.json (an edited or removed source changes nothing); an
export never lands in a run's own tree; Ctrl-C under `mct sample` keeps the text.

``probe_runs`` (also used by tests/test_cli_errors.py) trains one tiny GPT-2 run on a
dataset prepared with a word-level tokenizer and derives damaged copies of it."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from mct.cli import main  # noqa: E402

CORPUS = "the quick brown fox jumps over the lazy dog ."


def _word_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(dict.fromkeys(CORPUS.split()))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def probe_runs(root: Path) -> dict[str, str]:
    """A tiny GPT-2 dir (vocab 128, its own word-level tokenizer.json), a dataset made by
    `mct prepare` with that tokenizer (which adds an EOS: another tokenizer.json), a
    2-step run on it, and copies of the run: byte tokenizer (prompt-beyond-vocab),
    truncated / wrong-shaped model.safetensors, no tokenizer.json, a non-UTF-8 one; a sharded export
    missing a shard, a truncated HF dir. Returns the placeholders of the paths."""
    from transformers import GPT2Config
    from mct.config import EngineConfig
    from mct.data.pipeline import prepare
    from mct.data.tokenizer import bytes_tokenizer_json
    from mct.run.trainer import train
    src = root / "gpt2"
    GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=1, n_head=2).save_pretrained(src)
    _word_tokenizer(src / "tokenizer.json")
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": f"{CORPUS} " * (3 + i % 4)}) + "\n"
                                             for i in range(60)))
    prepare([str(root / "docs.jsonl")], str(root / "dataset"), tokenizer=str(src / "tokenizer.json"),
            progress=False)
    run = root / "run"
    cfg = {"seed": 0, "model": {"source": f"hf:{src}", "seq_len": 16},
           "data": {"path": str(root / "dataset"), "micro_batch_size": 2},
           "train": {"steps": 2, "eval_every": 0, "checkpoint_every": 1, "log_every": 1}}
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        train(EngineConfig.from_dict(cfg), run, progress=False)
    (root / "train_stderr.txt").write_text(err.getvalue())
    lora_run = root / "lora_run"  # adapters: what --format peft and --merge export
    with contextlib.redirect_stderr(io.StringIO()):
        train(EngineConfig.from_dict({**cfg, "train": {**cfg["train"], "steps": 1},
                                      "adapter": {"kind": "lora", "rank": 2}}), lora_run, progress=False)
    copies = {}
    for name in ("bytes_run", "truncated_run", "wrong_run", "notok_run", "badtok_run"):
        copies[name] = root / name
        shutil.copytree(run, copies[name], ignore=shutil.ignore_patterns("checkpoints"))
    (copies["bytes_run"] / "tokenizer.json").write_text(bytes_tokenizer_json(eos=False))
    weights = (run / "model.safetensors").read_bytes()
    (copies["truncated_run"] / "model.safetensors").write_bytes(weights[:len(weights) // 2])
    from safetensors.torch import load_file, save_file
    state = load_file(str(run / "model.safetensors"))
    state["transformer.wte.weight"] = torch.zeros(100, 32)
    save_file(state, str(copies["wrong_run"] / "model.safetensors"))
    (copies["notok_run"] / "tokenizer.json").unlink()
    (copies["badtok_run"] / "tokenizer.json").write_bytes(b'{"model": "\xff"}')
    assert main(["export", str(run), "--format", "hf", "--out", str(root / "sharded"), "--max-shard-size",
                 "20KB"]) == 0
    shards = sorted((root / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    (root / "truncated_hf").mkdir()
    shutil.copyfile(run / "hf" / "config.json", root / "truncated_hf" / "config.json")
    (root / "truncated_hf" / "model.safetensors").write_bytes(weights[:len(weights) // 2])
    (root / "a_file").write_text("not a directory\n")
    (root / "link").symlink_to(root / "nowhere")
    (root / "damaged_meta_run").mkdir()
    (root / "damaged_meta_run" / "metadata.json").write_text('{"world_size": 1}')
    (root / "deep_meta_run" / "checkpoints").mkdir(parents=True)
    (root / "deep_meta_run" / "metadata.json").write_text("[" * 100_000)
    return {"run": str(run), "lora_run": str(lora_run), "src": str(src), "dataset": str(root / "dataset"), "root": str(root),
            **{k: str(v) for k, v in copies.items()}, "sharded": str(root / "sharded"),
            "truncated_hf": str(root / "truncated_hf"), "a_file": str(root / "a_file"),
            "damaged_meta_run": str(root / "damaged_meta_run"), "deep_meta_run": str(root / "deep_meta_run")}


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict[str, str]:
    return probe_runs(tmp_path_factory.mktemp("hfprobe"))


def test_the_runs_hf_dir_and_export_carry_the_tokenizer_it_trained_with(probe, tmp_path, capsys):
    run, src = Path(probe["run"]), Path(probe["src"])
    trained = (run / "tokenizer.json").read_bytes()  # the dataset's (the word-level one plus EOS)
    assert trained == (Path(probe["dataset"]) / "tokenizer.json").read_bytes()
    assert trained != (src / "tokenizer.json").read_bytes()
    assert (run / "hf" / "tokenizer.json").read_bytes() == trained
    warned = Path(probe["root"], "train_stderr.txt").read_text()  # the warning at the start of the run
    assert "mct: warning:" in warned and "the tokenizer.json the model is trained with" in warned, warned
    assert main(["export", str(run), "--format", "hf", "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == trained
    capsys.readouterr()


def _greedy(run: Path, prompt: str, n: int) -> str:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM
    tok = Tokenizer.from_file(str(run / "tokenizer.json"))
    ids = tok.encode(prompt, add_special_tokens=False).ids
    model = AutoModelForCausalLM.from_pretrained(str(run / "hf")).eval()
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids[-16:]])).logits[0, -1].argmax()))
    return tok.decode(ids, skip_special_tokens=False)


def test_sample_encodes_with_the_runs_own_tokenizer_when_the_dataset_moved(probe, capsys):
    dataset = Path(probe["dataset"])
    moved = dataset.with_name("dataset.moved")
    dataset.rename(moved)
    try:
        assert main(["sample", probe["run"], "--prompt", "the quick brown", "--tokens", "6",
                     "--temperature", "0"]) == 0
    finally:
        moved.rename(dataset)
    assert capsys.readouterr().out[:-1] == _greedy(Path(probe["run"]), "the quick brown", 6)


def test_sample_without_the_runs_tokenizer_is_an_error_not_bytes(probe, capsys):
    assert main(["sample", probe["notok_run"], "--tokens", "3"]) == 2
    err = capsys.readouterr().err
    assert "has no tokenizer.json" in err and err.count("\n") == 1, err


def test_ctrl_c_under_sample_keeps_the_text_generated(probe, capsys, monkeypatch):
    from mct.task import sample as generate
    real, calls = generate._Collect.put, []

    def put(self, value):  # generate hands its streamer the prompt, then each token: Ctrl-C after 3
        if len(calls) == 4:
            raise KeyboardInterrupt
        calls.append(1)
        real(self, value)
    monkeypatch.setattr(generate._Collect, "put", put)
    assert main(["sample", probe["run"], "--prompt", "the quick brown", "--tokens", "50",
                 "--temperature", "0"]) == 130
    out, err = capsys.readouterr()
    assert out[:-1] == _greedy(Path(probe["run"]), "the quick brown", 3)
    assert "interrupted after 3 of 50 tokens" in err


def test_export_never_writes_into_a_runs_own_tree(probe, capsys):
    run = Path(probe["run"])
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    for out, fmt in ((run / "hf" / "exported", "hf"), (run / "checkpoints" / "mine", "hf"), (run / "hf", "hf"),
                     (run / "hf" / "w.safetensors", "safetensors"), (run / "tokenizer.json", "safetensors")):
        assert main(["export", str(run), "--format", fmt, "--out", str(out), "--force"]) == 2
        err = capsys.readouterr().err
        assert err.count("mct: error:") == 1 and ("own files" in err or "not an empty directory" in err), err
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


def test_resume_builds_the_model_from_the_runs_own_config(probe, tmp_path):
    """Source edited (another activation) for one copy, removed for the other: both
    resumes build RUN_DIR/hf's model and end with the same weights."""
    from mct.persistence.resume import resume_config
    from mct.run.trainer import train
    src = Path(probe["src"])
    away = src.with_name("gpt2.away")
    runs = [tmp_path / "edited", tmp_path / "removed"]
    for r in runs:
        shutil.copytree(probe["run"], r)
    src.rename(away)
    try:
        shutil.copytree(away, src)
        config = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**config, "activation_function": "relu", "n_layer": 2}))
        train(resume_config(runs[0], ["train.steps=3"], 1), runs[0], progress=False, resume=True)
        shutil.rmtree(src)
        train(resume_config(runs[1], ["train.steps=3"], 1), runs[1], progress=False, resume=True)
    finally:
        shutil.rmtree(src, ignore_errors=True)
        away.rename(src)
    assert (runs[0] / "model.safetensors").read_bytes() == (runs[1] / "model.safetensors").read_bytes()
    assert json.loads((runs[0] / "hf" / "config.json").read_text())["activation_function"] != "relu"


def test_init_from_reads_a_safetensors_file_whatever_the_case_of_its_suffix(probe, tmp_path):
    from mct.persistence.init_from import open_source
    upper = tmp_path / "weights.SAFETENSORS"
    shutil.copyfile(Path(probe["run"]) / "model.safetensors", upper)
    assert "transformer.wte.weight" in open_source(upper).shapes
