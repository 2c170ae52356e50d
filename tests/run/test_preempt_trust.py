"""The checkpoint written on SIGTERM: trusted when the step that made its state passed and
updated (a resume continues from it, bit-identical to the uninterrupted run), not trusted
after a skipped step; set-aside ``.untrusted`` checkpoints go once a newer one is good."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from mct.config import EngineConfig
from mct.persistence.resume import resume_config
from mct.persistence.run_dir import TRUSTED, checkpoints, prune
from mct.run.signals import Preempted, StopRequest
from mct.run.trainer import Trainer, train


def tiny(corpus_dir: Path) -> EngineConfig:
    return EngineConfig.from_dict({
        "seed": 5, "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16, "dropout": 0.1},
        "data": {"path": str(corpus_dir), "micro_batch_size": 2},
        "train": {"steps": 10, "warmup_steps": 2, "eval_every": 0, "log_every": 1, "checkpoint_every": 4,
                  "grad_clip": 1.0}})


def _sigterm_during(monkeypatch, step: int) -> None:
    """SIGTERM arrives while ``step`` runs (the flag the handler sets, set after that step)."""
    original = Trainer._step

    def step_then_signal(self, s):
        outcome = original(self, s)
        if s == step:
            self.stop.signum = signal.SIGTERM
        return outcome
    monkeypatch.setattr(Trainer, "_step", step_then_signal)


def _preempted(cfg: EngineConfig, run: Path) -> None:
    with pytest.raises(Preempted, match="stopped by SIGTERM at step 7"):
        train(cfg, run, progress=False, stop=StopRequest())


def _resume(run: Path, capsys) -> str:
    capsys.readouterr()
    train(resume_config(run, [], 1), run, progress=False, resume=True)
    return capsys.readouterr().err


def test_a_sigterm_checkpoint_of_a_passed_step_is_trusted_and_resumed_bit_identical(tmp_path, corpus_dir,
                                                                                   monkeypatch, capsys):
    train(tiny(corpus_dir), tmp_path / "whole", progress=False)
    run = tmp_path / "run"
    with monkeypatch.context() as m:
        _sigterm_during(m, 6)
        _preempted(tiny(corpus_dir), run)
    assert (run / "checkpoints" / "step_00000007" / TRUSTED).exists()
    err = _resume(run, capsys)
    assert "skipped checkpoint" not in err and "not trusted" not in err, err
    resumes = json.loads((run / "metadata.json").read_text())["resumes"]
    assert [(r["from_step"], r["checkpoint"]) for r in resumes] == [(7, "step_00000007")]
    assert not list((run / "checkpoints").glob("*.untrusted*"))
    assert (run / "model.safetensors").read_bytes() == (tmp_path / "whole" / "model.safetensors").read_bytes()


def test_a_sigterm_checkpoint_after_a_skipped_step_is_not_trusted_and_is_removed_once_superseded(
        tmp_path, corpus_dir, monkeypatch, capsys):
    run = tmp_path / "run"
    with monkeypatch.context() as m:
        _sigterm_during(m, 6)
        m.setenv("MCT_FAULT", "nan@6")  # step 6's gradients are non-finite: skipped, no update
        _preempted(tiny(corpus_dir), run)
    assert not (run / "checkpoints" / "step_00000007" / TRUSTED).exists()
    err = _resume(run, capsys)
    assert "step_00000007 (not trusted" in err and "resuming from step_00000004" in err, err
    # step_00000007.untrusted was set aside by the resume; step 8's checkpoint, confirmed by step 9, supersedes it
    assert not list((run / "checkpoints").glob("*.untrusted*"))
    assert [s for s, _ in checkpoints(run)] == [8, 10]


def _checkpoint(root: Path, name: str, trusted: bool) -> None:
    d = root / "checkpoints" / name
    d.mkdir(parents=True)
    (d / "meta.json").write_text("{}")
    (d / "trainer.json").write_text(json.dumps({"trust": "pending"}))
    if trusted:
        (d / TRUSTED).write_bytes(b"")


def test_prune_removes_untrusted_checkpoints_at_or_below_the_newest_trusted_step(tmp_path):
    for name in ("step_00000003.untrusted", "step_00000006.untrusted", "step_00000006.untrusted1",
                 "step_00000009.untrusted", "step_00000005.diverged"):
        _checkpoint(tmp_path, name, trusted=False)
    _checkpoint(tmp_path, "step_00000004", trusted=True)
    _checkpoint(tmp_path, "step_00000008", trusted=False)
    names = lambda: sorted(p.name for p in (tmp_path / "checkpoints").iterdir())  # noqa: E731
    prune(tmp_path, 2)
    assert names() == ["step_00000004", "step_00000005.diverged", "step_00000006.untrusted",
                       "step_00000006.untrusted1", "step_00000008", "step_00000009.untrusted"]
    (tmp_path / "checkpoints" / "step_00000008" / TRUSTED).write_bytes(b"")
    prune(tmp_path, 2)
    assert names() == ["step_00000004", "step_00000005.diverged", "step_00000008", "step_00000009.untrusted"]
