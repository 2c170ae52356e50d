"""Every config under examples/ is one a user can run: it loads with the loader `mct train
--config` uses (the recipe included), every key it sets reaches the run's config, and it
trains two steps through `mct train` itself on a tiny model, sizes and steps overridden
with --set as a user would. finetune_hf.toml runs against a tiny Llama with its own BPE
tokenizer, made here, on data prepared with `mct prepare --tokenizer DIR`. An example that
stops loading or training fails here; a new example is picked up without a new test."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from mct.cli import main
from mct.reporting.metrics import read_jsonl
from mct.run.recipe import train_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
FILES = sorted(EXAMPLES.glob("*.toml"))
EXPECTED = {"bf16", "finetune_hf", "gpt", "lora_hf", "low_memory", "packing"}

TINY_GPT = ["model.n_layer=2", "model.n_head=2", "model.d_model=32", "model.seq_len=16"]
TWO_STEPS = ["train.steps=2", "train.eval_every=2", "train.eval_batches=1", "train.log_every=1",
             "train.checkpoint_every=0", "data.micro_batch_size=2"]


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _recorded(cfg: Any, key: str) -> Any:
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _same(recorded: Any, written: Any) -> bool:
    """A key's typed value (a Name, a ByteSize: its repr is the text it was parsed from)
    equals what the file wrote."""
    return recorded == written or (isinstance(written, str) and repr(recorded).strip("'") == written)


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> dict[str, str]:
    """A tiny Llama with a BPE tokenizer and a dataset prepared with that tokenizer."""
    pytest.importorskip("transformers")
    from tests.task.test_hf_own_tokens import _documents, save_tiny_llama_with_tokenizer
    root = tmp_path_factory.mktemp("example_hf")
    model = save_tiny_llama_with_tokenizer(root / "llama")
    (root / "jsonl").mkdir()
    for i in range(2):
        lines = [json.dumps({"text": t}) for t in _documents(40, i)]
        (root / "jsonl" / f"part{i}.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["prepare", str(root / "jsonl"), "--tokenizer", str(model), "--out", str(root / "ds")]) == 0
    return {"model": str(model), "data": str(root / "ds")}


def _user_args(name: str, tmp_path: Path, corpus_dir: Path, request) -> list[str]:
    """What a user adds to `mct train --config examples/NAME.toml` for a two-step try."""
    if name in ("finetune_hf", "lora_hf"):
        d = request.getfixturevalue("hf")
        sets = ["model.seq_len=16", f"data.path={d['data']}", *TWO_STEPS, "data.grad_accum=2"]
        return ["--model", f"hf:{d['model']}", "--init-from", d["model"], *[a for s in sets for a in ("--set", s)]]
    sets = [*TINY_GPT, f"data.path={corpus_dir}", *TWO_STEPS]
    if name == "low_memory":
        sets.append(f"offload.dir={tmp_path / 'offload'}")
    return [a for s in sets for a in ("--set", s)]


def test_the_examples_directory_holds_the_common_jobs():
    assert {p.stem for p in FILES} == EXPECTED


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_every_key_an_example_sets_reaches_the_config_mct_train_builds(path):
    cfg = train_config(path, [])
    for key, value in _flat(tomllib.loads(path.read_text())).items():
        assert _same(_recorded(cfg, key), value), (path.name, key, _recorded(cfg, key))


def test_gpt_example_is_the_job_make_train_runs():
    assert train_config(EXAMPLES / "gpt.toml", []) == train_config(None, [])


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_every_example_trains_two_steps_through_mct_train(path, tmp_path, corpus_dir, request, capsys):
    run = tmp_path / "run"
    args = ["train", "--config", str(path), "--run-dir", str(run), "--no-progress",
            *_user_args(path.stem, tmp_path, corpus_dir, request)]
    assert main(args) == 0, capsys.readouterr().err
    rows, damaged = read_jsonl(run / "metrics.jsonl")
    assert not damaged and [r["step"] for r in rows] == [0, 1]
    assert rows[-1]["val_loss"] is not None and rows[-1]["val_loss"] == rows[-1]["val_loss"]  # finite
    recorded = json.loads((run / "metadata.json").read_text())["config"]
    toml = _flat(tomllib.loads(path.read_text()))
    for key in ("zero.stage", "precision.mode", "checkpointing.policy", "data.packing", "offload.optimizer",
                "adapter.kind"):
        if key in toml and toml[key] != "auto":
            section, name = key.split(".")
            assert recorded[section][name] == toml[key], (path.name, key)


def test_the_readme_is_a_front_door_whose_links_and_examples_exist():
    root = EXAMPLES.parent
    text = (root / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    named = set(re.findall(r"\]\(([^)#\s]+)\)", text)) | set(re.findall(r"(?<![\w/])((?:docs|examples)/[\w./-]+)", text))
    assert {"docs/performance.md", "CONTRIBUTING.md", "examples/finetune_hf.toml"} <= named
    assert [p for p in sorted(named) if not (root / p).exists()] == []
    assert {f"examples/{p.name}" for p in FILES} <= named  # every example is on the front door
