"""A packed run end to end: its metrics rows say what the windows held, `mct report`
shows it, a resume continues with the recorded packing (and cannot change it), and a
run recorded before `data.packing` existed resumes as the stream it trained on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mct.config import EngineConfig
from mct.persistence.resume import recorded_packing, resume_config
from mct.persistence.run_dir import step_dir
from mct.reporting.report import load_run, report_table
from mct.run.trainer import train
from tests.helpers import one_thread  # noqa: F401 (one_thread: autouse fixture)


def _corpus(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for i in range(60):
        (d / f"f{i:02d}.txt").write_text(f"{i}:" + "ab " * (i % 4))  # 3..14 bytes: several a window
    return d


def _run(corpus: Path, packing: str) -> dict:
    return {"seed": 5, "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16, "dropout": 0.1},
            "data": {"path": str(corpus), "micro_batch_size": 2, "packing": packing},
            "train": {"steps": 4, "warmup_steps": 1, "eval_every": 2, "eval_batches": 1, "log_every": 1,
                      "checkpoint_every": 2, "keep_checkpoints": 3}}


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("packing")
    corpus = _corpus(root / "corpus")
    out = {}
    for packing in ("documents", "stream"):
        out[packing] = root / packing
        train(EngineConfig.from_dict(_run(corpus, packing)), out[packing], progress=False)
    return out


def test_packed_rows_count_real_and_padding_tokens_and_documents_per_window(runs):
    rows = _rows(runs["documents"])
    assert len(rows) == 4
    for r in rows:
        assert r["real_tokens"] == 2 * 16 and r["padding_tokens"] == 0
        assert r["docs_per_window"] > 1.0 and r["target_tokens"] < r["real_tokens"]
    assert "docs_per_window" not in _rows(runs["stream"])[0]  # stream rows keep their keys
    assert "packing: documents" in report_table(load_run(runs["documents"]))
    assert "packing:" not in report_table(load_run(runs["stream"]))


def test_packing_changes_what_is_trained(runs):
    assert [r["loss"] for r in _rows(runs["documents"])] != [r["loss"] for r in _rows(runs["stream"])]


def test_a_resumed_packed_run_continues_with_its_packing_and_cannot_change_it(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["documents"], run)
    shutil.rmtree(step_dir(run, 4))
    cfg = resume_config(run, [], 1)
    assert cfg.data.packing == "documents"
    train(cfg, run, progress=False, resume=True)
    assert [r["loss"] for r in _rows(run)] == [r["loss"] for r in _rows(runs["documents"])]
    with pytest.raises(ValueError, match="--resume cannot change data.packing"):
        resume_config(run, ["data.packing=stream"], 1)


def test_a_run_recorded_without_the_packing_key_resumes_as_stream(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["stream"], run)
    trainer = step_dir(run, 4) / "trainer.json"
    state = json.loads(trainer.read_text())
    del state["config"]["data"]["packing"]  # as every run written before the key existed
    trainer.write_text(json.dumps(state))
    assert resume_config(run, [], 1).data.packing == "stream"
    assert recorded_packing(state["config"])["data"]["packing"] == "stream"  # whatever the default
    assert "packing" not in state["config"]["data"]  # not mutated
    assert recorded_packing({**state["config"], "data": {"packing": "documents"}})["data"]["packing"] == "documents"
