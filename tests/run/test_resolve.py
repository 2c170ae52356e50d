"""``auto`` is solved once per run: by the launcher of ``mct train --nproc N`` (its answer
handed to the workers), else by rank 0; no other process solves."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import mct.run.resolve as resolve_mod
from mct.config import EngineConfig
from mct.dist import DistContext
from mct.run.resolve import RESOLVED_ENV, resolve_once, solve_in_launcher
from mct.task import task_for
from tests.run.test_trainer import _env, _toml, tiny

AUTO = {"zero": {"stage": "auto"}, "checkpointing": {"policy": "auto"}, "memory": {"budget": "64MiB", "budget_counts": "tensors"}}


def _auto_config(corpus_dir) -> EngineConfig:
    return EngineConfig.from_dict({**tiny(corpus_dir, steps=2, eval_every=0), **AUTO})


def test_workers_train_the_launchers_answer_without_solving(corpus_dir, monkeypatch):
    cfg = _auto_config(corpus_dir)
    task = task_for(cfg)
    env = solve_in_launcher(cfg, 2, task, "cpu")
    monkeypatch.setenv(RESOLVED_ENV, env[RESOLVED_ENV])
    monkeypatch.setattr(resolve_mod, "resolve_auto", lambda *a, **k: pytest.fail("a worker solved again"))
    resolved, choice = resolve_once(cfg, task, DistContext(world_size=2))
    assert choice is not None and choice["solved_by"] == "launcher" and choice["solver"]["why"]
    assert resolved.zero.stage == choice["zero.stage"] and resolved.zero.stage != "auto"
    assert resolved.checkpointing.policy != "auto"


@pytest.mark.parametrize("change", ["world", "config", "device", "garbage"])
def test_an_answer_for_another_run_is_not_trusted(corpus_dir, monkeypatch, change):
    cfg = _auto_config(corpus_dir)
    task = task_for(cfg)
    handed = json.loads(solve_in_launcher(cfg, 1, task, "cpu")[RESOLVED_ENV])
    ctx = DistContext(world_size=1)
    if change == "world":
        handed["world"] = 2
    elif change == "config":
        handed["asked"]["seed"] = 6
    elif change == "device":
        handed["device"] = "cuda"
    monkeypatch.setenv(RESOLVED_ENV, "{not json" if change == "garbage" else json.dumps(handed))
    calls = []
    real = resolve_mod.resolve_auto
    monkeypatch.setattr(resolve_mod, "resolve_auto", lambda *a, **k: calls.append(a) or real(*a, **k))
    _, choice = resolve_once(cfg, task, ctx)
    assert len(calls) == 1 and choice["solved_by"] == "rank 0"


def test_nothing_auto_is_not_solved(corpus_dir, monkeypatch):
    cfg = EngineConfig.from_dict(tiny(corpus_dir, steps=2))
    monkeypatch.setattr(resolve_mod, "resolve_auto", lambda *a, **k: pytest.fail("solved"))
    assert resolve_once(cfg, task_for(cfg), DistContext()) == (cfg, None)
    assert solve_in_launcher(cfg, 2, task_for(cfg), "cpu") == {}


@pytest.mark.cli
def test_two_rank_auto_run_is_solved_once_by_the_launcher(tmp_path, corpus_dir):
    """`mct train --nproc 2 ... zero.stage=auto`: metadata.json records the launcher's
    answer, which both ranks trained (rank 0's and rank 1's configs are the recorded one)."""
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text(_toml({**tiny(corpus_dir, steps=2, eval_every=0), **AUTO}))
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "mct", "train", "--config", str(cfg_file), "--nproc", "2",
                          "--run-dir", str(run), "--no-progress"],
                         capture_output=True, text=True, env=_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    meta = json.loads((run / "metadata.json").read_text())
    assert meta["plan"]["solved_by"] == "launcher"
    assert meta["config"]["zero"]["stage"] == meta["plan"]["zero.stage"]
    assert meta["config"]["checkpointing"]["policy"] == meta["plan"]["checkpointing.policy"]
