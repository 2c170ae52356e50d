"""SIGKILL at a random moment, then `mct train --resume` (without --nproc: the run's own
rank count): the run ends bit-identical (model.safetensors bytes, per-step losses) to one
never interrupted, at every stage."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mct.config import EngineConfig
from mct.persistence.run_dir import checkpoints
from mct.run.trainer import train
from tests.distributed import run_distributed
from tests.persistence.test_resume import _rows, _write_corpus, tiny_run

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")  # as the in-process run below
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _toml(d: dict) -> str:
    lines = [f"seed = {d['seed']}"]
    for section, values in d.items():
        if isinstance(values, dict):
            lines += [f"[{section}]", *[f"{k} = {json.dumps(v)}" for k, v in values.items()]]
    return "\n".join(lines) + "\n"


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun's workers may sit in their own session)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill_at_random_step(cmd: list[str], run: Path, steps: int, rng: random.Random) -> int:
    """Start ``cmd``, SIGKILL it and all its descendants once ``metrics.jsonl`` has k
    rows (k random in [3, steps]: a checkpoint exists, and the kill may land inside a
    later save). Returns k."""
    k = rng.randint(3, steps)
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.monotonic() + 240
    metrics = run / "metrics.jsonl"
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics.is_file() and metrics.read_text().count("\n") >= k:
            break
        time.sleep(0.005)
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)
    assert proc.returncode in (0, -signal.SIGKILL), proc.stderr.read().decode()[-2000:]
    return k


def _uninterrupted(rank: int, world: int, d: dict, run: str) -> None:
    train(EngineConfig.from_dict(d), run, progress=False)


# Two ranks where sharding makes the files differ most (stage 1: masters are views of the
# working buffer; stage 3: nothing is replicated); stage 2 saves exactly what stage 1 does,
# so one process suffices there, which keeps the suite within its time budget.
# Stage 1 resumes on 2 ranks in tests/persistence/test_resume.py (reshard 1 -> 2); for the suite's
# time one multi-rank kill is kept here.
@pytest.mark.multirank
@pytest.mark.cli
@pytest.mark.parametrize("stage,nproc", [(0, 1), (2, 1), (3, 2)])
def test_sigkill_then_resume_is_bit_identical(tmp_path, stage, nproc):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    d = tiny_run(_write_corpus(tmp_path / "corpus"), steps=10, checkpoint_every=2, keep_checkpoints=2)
    d["zero"] = {"stage": stage}
    (tmp_path / "c.toml").write_text(_toml(d))
    whole = tmp_path / "whole"
    if nproc == 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            _uninterrupted(0, 1, d, str(whole))
        finally:
            torch.set_num_threads(threads)
    else:
        run_distributed(_uninterrupted, nproc, d, str(whole))

    run = tmp_path / "run"
    mct = [sys.executable, "-m", "mct", "train", "--nproc", str(nproc), "--no-progress"]
    k = _kill_at_random_step([*mct, "--config", str(tmp_path / "c.toml"), "--run-dir", str(run)], run, 10, rng)
    assert checkpoints(run), f"no checkpoint after {k} rows (seed {seed})"
    # without --nproc: the run's own rank count (a 2-rank run on 1 rank would not be bit-identical)
    resume = [sys.executable, "-m", "mct", "train", "--no-progress", "--resume", str(run)]
    out = subprocess.run(resume, env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (f"continuing on the run's recorded {nproc} local ranks" in out.stderr) == (nproc > 1), out.stderr
    why = f"killed after {k} metrics rows (random seed {seed})"
    assert (run / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes(), why
    assert [(r["step"], r["loss"], r.get("val_loss")) for r in _rows(run)] == \
        [(r["step"], r["loss"], r.get("val_loss")) for r in _rows(whole)], why
    assert [s for s, _ in checkpoints(run)] == [8, 10]  # train.keep_checkpoints = 2
