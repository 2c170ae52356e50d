"""The training loop and the CLI: metrics, metadata, eval isolation, 2-rank parity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mct.config import EngineConfig
from mct.data import build_data
from mct.models.gpt import optimizer_groups
from mct.verify.reference import ReferenceTrainer
from mct.run.schedule import lr_at
from mct.run.trainer import build_gpt, make_optimizer, seeded_gpt_loss, step_batches, train

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    d = tmp_path / "corpus"
    d.mkdir()
    for i in range(12):
        (d / f"f{i:02d}.txt").write_text(f"file {i}: " + "the quick brown fox jumps over the lazy dog. " * 40)
    return d


def tiny(corpus_dir: Path, **train) -> dict:
    return {"seed": 5, "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16},
            "data": {"path": str(corpus_dir), "micro_batch_size": 2, "grad_accum": 2},
            "train": {"steps": 6, "warmup_steps": 2, "eval_every": 3, "eval_batches": 2, "log_every": 1, **train}}


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_metrics_and_metadata_keys(tmp_path, corpus_dir):
    cfg = EngineConfig.from_dict(tiny(corpus_dir))
    summary = train(cfg, tmp_path / "run", progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6))
    for r in rows:
        for key in ("loss", "lr", "step_time_s", "tokens_per_s", "grad_norm", "time_forward_s",
                    "time_backward_s", "time_step_s", "time_comm_s", "time_data_s", "memory", "errors"):
            assert key in r, key
        assert isinstance(r["peak_bytes"], int) and r["peak_bytes"] > 0
        assert set(r["memory"]) >= {"forward", "backward", "optimizer"}
    assert [r["step"] for r in rows if "val_loss" in r] == [0, 3, 5]
    meta = json.loads((tmp_path / "run" / "metadata.json").read_text())
    for key in ("seed", "config", "versions", "world_size", "corpus", "start_time", "backend", "device"):
        assert key in meta, key
    assert meta["seed"] == 5 and meta["config"]["model"]["n_layer"] == 2 and meta["world_size"] == 1
    assert summary.final_val_loss == rows[-1]["val_loss"]
    assert (tmp_path / "run" / "model.safetensors").is_file()


def test_tensorboard_events_are_written_when_asked(tmp_path, corpus_dir):
    cfg = EngineConfig.from_dict(tiny(corpus_dir, steps=2, eval_every=0, tensorboard=True))
    train(cfg, tmp_path / "run", progress=False)
    assert list((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))


def test_evaluation_does_not_change_the_training_trajectory(tmp_path, corpus_dir):
    losses = []
    for eval_every in (1, 0):
        d = tiny(corpus_dir, eval_every=eval_every)
        d["model"]["dropout"] = 0.1  # dropout consumes RNG: eval must not shift it
        train(EngineConfig.from_dict(d), tmp_path / f"run{eval_every}", progress=False)
        rows = (tmp_path / f"run{eval_every}" / "metrics.jsonl").read_text().splitlines()
        losses.append([json.loads(line)["loss"] for line in rows])
    assert losses[0] == losses[1]



def test_rows_logged_every_third_step_carry_the_memory_of_an_every_step_run(tmp_path, corpus_dir):
    # the steps between logged rows run without the tracker's per-op counting: what the
    # rows say (memory peaks included) is what a run that counts every step says
    runs = {}
    for log_every in (1, 3):
        train(EngineConfig.from_dict(tiny(corpus_dir, log_every=log_every, eval_every=4)),
              tmp_path / f"run{log_every}", progress=False)
        rows = [json.loads(line) for line in (tmp_path / f"run{log_every}" / "metrics.jsonl").read_text().splitlines()]
        runs[log_every] = {r["step"]: r for r in rows}
    assert sorted(runs[3]) == [0, 3, 4, 5]  # every third, the validated one, the last
    timed = ("tokens_per_s", "achieved_flops_per_s", "mfu", "page_faults")  # measured; and every key naming a time
    for step, row in runs[3].items():
        every = runs[1][step]
        assert set(row) == set(every), step
        for key, value in row.items():
            if "time" not in key and key not in timed:
                assert value == every[key], (step, key)
        assert isinstance(row["peak_bytes"], int) and row["peak_bytes"] > 0

@pytest.mark.cli
def test_cli_config_error_is_one_line_exit_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mct", "train", "--set", "zero.stage=9"],
                         capture_output=True, text=True, env=_env(), timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr
    assert "zero.stage = 9 is not allowed" in out.stderr


@pytest.mark.cli
def test_cli_bad_data_path_is_one_line_exit_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mct", "train", "--set", f"data.path={tmp_path}/nope"],
                         capture_output=True, text=True, env=_env(), timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "nope" in out.stderr


@pytest.mark.cli
def test_two_rank_cli_run_matches_reference(tmp_path, corpus_dir):
    """`mct train --nproc 2` (fp32, dropout 0) against the reference fed the same
    per-rank micro-batches: per-step losses and final parameters within 1e-6."""
    d = tiny(corpus_dir, eval_every=0, grad_clip=1.0)
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text(_toml(d))
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "mct", "train", "--config", str(cfg_file), "--nproc", "2",
                          "--run-dir", str(run), "--no-progress"],
                         capture_output=True, text=True, env=_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    from safetensors.torch import load_file
    final = load_file(str(run / "model.safetensors"))

    # The workers run one thread each (torchrun's OMP_NUM_THREADS): so must the
    # reference, since CPU kernels round differently with a different thread split.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _compare_with_reference(d, losses, final)
    finally:
        torch.set_num_threads(threads)


def _compare_with_reference(d: dict, losses: list[float], final: dict) -> None:
    cfg = EngineConfig.from_dict(d)
    _, sampler = build_data(cfg, world_size=2)
    model = build_gpt(cfg)
    ref = ReferenceTrainer(model, make_optimizer(cfg), grad_clip=cfg.train.grad_clip,
                           param_groups=optimizer_groups(model, cfg.train.weight_decay))
    for step in range(cfg.train.steps):
        for g in ref.optimizer.param_groups:
            g["lr"] = lr_at(step, cfg.train)
        r = ref.step([step_batches(sampler, cfg, step, rank) for rank in range(2)], seeded_gpt_loss)
        assert abs(r.loss - losses[step]) <= 1e-6 * abs(r.loss), (step, r.loss, losses[step])
    for name, p in ref.state_dict().items():
        rel = float((final[name] - p).norm() / p.norm())
        assert rel <= 1e-6, (name, rel)


def _toml(d: dict) -> str:
    lines = [f"seed = {d['seed']}"]
    for section, values in d.items():
        if isinstance(values, dict):
            lines.append(f"[{section}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def test_cli_train_builds_the_task_once_and_hands_it_to_the_trainer(tmp_path, corpus_dir, monkeypatch):
    """`mct train` checks the model source (task_for) before anything starts; the Trainer
    it runs in the same process takes that Task instead of building its own again."""
    import mct.run.trainer as trainer_module
    import mct.task as task_module
    from mct.cli import main
    calls: list[int] = []

    def counted(cfg):
        calls.append(1)
        return real(cfg)
    real = task_module.task_for
    monkeypatch.setattr(task_module, "task_for", counted)
    monkeypatch.setattr(trainer_module, "task_for", counted)
    (tmp_path / "c.toml").write_text(_toml(tiny(corpus_dir, steps=1, eval_every=0)))
    assert main(["train", "--config", str(tmp_path / "c.toml"), "--run-dir", str(tmp_path / "run"),
                 "--no-progress"]) == 0
    assert len(calls) == 1, calls
