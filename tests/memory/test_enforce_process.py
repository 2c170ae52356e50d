"""``mct train --nproc 2`` with ``memory.enforce`` and a budget counting the process (the
default): every worker stays under the budget or stops with the clear error, and a budget
below what any process needs is refused in one line before any worker starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mct.memory.baseline import baseline_key

pytestmark = [pytest.mark.cli, pytest.mark.multirank,
              pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")]
MiB = 2**20
SRC = Path(__file__).resolve().parents[2] / "src"
TINY = ["--set", "model.n_layer=1", "--set", "model.n_head=2", "--set", "model.d_model=32", "--set",
        "model.seq_len=16", "--set", "data.micro_batch_size=2", "--set", "train.steps=3", "--set",
        "train.eval_every=0", "--set", "memory.enforce=true"]


def _train(tmp_path: Path, corpus: Path, budget: int, cache: Path | None = None) -> subprocess.CompletedProcess:
    run = tmp_path / f"run-{budget}"
    env = dict(os.environ, PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    if cache is not None:
        env["MCT_CACHE_DIR"] = str(cache)
    argv = [sys.executable, "-m", "mct", "train", "--nproc", "2", "--no-progress", "--run-dir", str(run), *TINY,
            "--set", f"data.path={corpus}", "--set", f"memory.budget={budget}"]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=400)


def test_two_ranks_under_an_enforced_process_budget_stay_under_it(tmp_path, corpus_dir):
    budget = 450 * MiB  # the tiny model's workers hold about 330 MiB each here (docs/memory.md)
    out = _train(tmp_path, corpus_dir, budget)
    assert out.returncode == 0, out.stderr
    resident = json.loads((tmp_path / f"run-{budget}" / "metadata.json").read_text())["resident"]
    assert len(resident["workers"]) == 2 and all(0 < w <= budget for w in resident["workers"]), resident


def test_a_budget_below_any_process_is_one_line_before_any_worker_starts(tmp_path, corpus_dir):
    out = _train(tmp_path, corpus_dir, 100 * MiB)  # the suite's cached runtime baseline is 300 MiB
    assert out.returncode == 2
    err = out.stderr.strip()
    assert err.count("\n") == 0 and err.startswith("mct: error: memory.budget = 100.00 MiB is below"), err
    assert "memory.budget_counts=tensors" in err and not (tmp_path / "run-104857600").exists()


def test_a_budget_the_workers_pass_stops_them_with_the_clear_error(tmp_path, corpus_dir):
    """The cached baseline says 100 MiB (so the launcher's check lets 200 MiB through); torch
    alone is about 220 MiB resident, so each worker's watch stops it at its first phase."""
    cache = tmp_path / "cache"
    cache.mkdir()
    seeded = Path(os.environ["MCT_CACHE_DIR"])
    (cache / "machine.json").write_text((seeded / "machine.json").read_text())
    (cache / "baseline.json").write_text(json.dumps({baseline_key(): 100 * MiB}))
    out = _train(tmp_path, corpus_dir, 200 * MiB, cache)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and "memory budget exceeded" in out.stderr, out.stderr
    assert "resident set (VmRSS)" in out.stderr and "of budget 200.00 MiB" in out.stderr
