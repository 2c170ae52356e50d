"""What a training rank lacks of the machine profile is measured in a child process, never in
the rank (whose peak resident set it would raise): the child's command and environment, the
rank reading the cache after it, and the rank measuring itself only when the child failed.
No real measurement: the child is a stub."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

import mct.machine.aside as aside
import mct.machine.cache as cache_mod
from mct.config import EngineConfig
from mct.machine.aside import measure_aside, missing
from mct.run.utilization import Utilization
from mct.task import task_for


class FakeChild:
    """``subprocess.run`` of the child: records its argv and env, copies ``seed`` (a cache
    file) into the cache as the real child would write it, exits ``rc``."""

    def __init__(self, rc: int = 0, seed: Path | None = None, target: Path | None = None) -> None:
        self.rc, self.seed, self.target, self.calls = rc, seed, target, []

    def __call__(self, argv, env, **kw):
        self.calls.append((argv, env))
        if self.rc == 0 and self.seed is not None and self.target is not None:
            self.target.write_text(self.seed.read_text())
        return subprocess.CompletedProcess(argv, self.rc)


@pytest.fixture
def empty_cache(tmp_path, monkeypatch, machine_profile_cache) -> Path:
    """An empty cache dir as MCT_CACHE_DIR; returns the session's seeded (pinned) machine.json."""
    d = tmp_path / "cache"
    d.mkdir()
    monkeypatch.setenv("MCT_CACHE_DIR", str(d))
    return machine_profile_cache / "machine.json"


def test_nothing_is_missing_with_the_seeded_cache_and_no_child_runs(monkeypatch):
    child = FakeChild()
    monkeypatch.setattr(aside.subprocess, "run", child)
    assert missing("cpu", "2") is None
    assert measure_aside("cpu", 2, 2, overhead_key="2") is True and child.calls == []


def test_an_empty_cache_lacks_the_profile_and_the_child_is_no_rank(empty_cache, monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.setenv(name, "1")
    assert missing("cpu", None) == "profile"
    child = FakeChild(rc=0)
    monkeypatch.setattr(aside.subprocess, "run", child)
    assert measure_aside("cpu", 2, 3, overhead_key="3") is True
    (argv, env), = child.calls
    assert argv[-4:] == ["cpu", "2", "3", "1"] and env["OMP_NUM_THREADS"] == "3"
    assert not {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"} & set(env)


def test_a_failed_child_leaves_the_measurement_to_the_rank(empty_cache, monkeypatch):
    monkeypatch.setattr(aside.subprocess, "run", FakeChild(rc=1))
    assert measure_aside("cpu", 1, 2, overhead_key=None) is False

    def hangs(argv, **kw):
        raise subprocess.TimeoutExpired(argv, 1.0)
    monkeypatch.setattr(aside.subprocess, "run", hangs)
    assert measure_aside("cpu", 1, 2, overhead_key=None) is False


def test_a_profile_without_the_ranks_overhead_is_missing_it(empty_cache, monkeypatch, tmp_path):
    entries = json.loads(empty_cache.read_text())
    for profile in entries["profiles"].values():
        profile["extra"]["op_overhead_s"].pop("2")
    target = Path(tmp_path / "cache" / "machine.json")
    target.write_text(json.dumps(entries))
    assert missing("cpu", "2") == "overhead"
    assert missing("cpu", None) is None  # auto's plan gave the step time: no overhead needed


def test_the_rank_measures_nothing_itself_once_the_child_cached_the_profile(empty_cache, monkeypatch, tmp_path):
    child = FakeChild(rc=0, seed=empty_cache, target=tmp_path / "cache" / "machine.json")
    monkeypatch.setattr(aside.subprocess, "run", child)

    def measured_in_the_rank(device: str = "cpu"):
        raise AssertionError("the rank measured the machine itself")
    monkeypatch.setattr(cache_mod, "measure_profile", measured_in_the_rank)
    cfg = EngineConfig.from_dict({"model": {"n_layer": 1, "n_head": 2, "d_model": 32, "seq_len": 16},
                                  "data": {"micro_batch_size": 1}})
    util, warning = Utilization.for_run(task_for(cfg), cfg, 1, "cpu", threads_per_rank=torch.get_num_threads())
    assert len(child.calls) == 1 and warning is None
    assert util.peak_flops is not None and util.predicted_step_s is not None
