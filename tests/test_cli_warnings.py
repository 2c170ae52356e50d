"""`mct train`'s config warnings print only where they apply, once: memory.budget's
"recorded but not enforced" not for a run that auto planned for the budget (nor its
resume), and not again by the workers of `--nproc` (the launcher printed it)."""

from __future__ import annotations

from pathlib import Path

from mct.cli import _config_warnings, main
from mct.config import EngineConfig

NOT_ENFORCED = "is recorded but not enforced"


def _config(tmp_path: Path) -> Path:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"f{i}.txt").write_text(f"file {i}: " + "the quick brown fox jumps over the lazy dog. " * 20)
    f = tmp_path / "c.toml"
    f.write_text(f'seed = 3\n[model]\nn_layer = 1\nn_head = 2\nd_model = 16\nseq_len = 8\n'
                 f'[data]\npath = "{corpus}"\nmicro_batch_size = 2\n'
                 f'[train]\nsteps = 2\neval_every = 0\ncheckpoint_every = 2\n[memory]\nbudget = "1GiB"\n')
    return f


def test_the_budget_warning_is_printed_once_for_a_run_that_does_not_plan(tmp_path, capsys):
    assert main(["train", "--config", str(_config(tmp_path)), "--run-dir", str(tmp_path / "run"),
                 "--no-progress"]) == 0
    assert capsys.readouterr().err.count(NOT_ENFORCED) == 1


def test_no_budget_warning_for_an_auto_run_nor_its_resume(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--config", str(_config(tmp_path)), "--set", "zero.stage=auto", "--run-dir", str(run),
                 "--no-progress"]) == 0
    assert main(["train", "--resume", str(run), "--set", "train.steps=4", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert NOT_ENFORCED not in err, err


def test_a_worker_of_the_launcher_does_not_repeat_the_budget_warning(monkeypatch, capsys):
    cfg = EngineConfig.from_dict({"memory": {"budget": "1GiB"}})
    _config_warnings(cfg, 1)
    assert capsys.readouterr().err.count(NOT_ENFORCED) == 1
    monkeypatch.setenv("MCT_LAUNCH_DIR", "/nonexistent")
    monkeypatch.setenv("RANK", "0")
    _config_warnings(cfg, 1)
    assert NOT_ENFORCED not in capsys.readouterr().err
