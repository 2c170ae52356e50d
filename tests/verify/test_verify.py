"""``mct verify``: passes for ZeRO stages 0-3 in fp32 and bf16 on 2 ranks, fails on a
planted gradient-averaging bug; the CLI prints the table and exits 0 / 1."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from mct.config import EngineConfig
from tests.distributed import run_distributed

TINY = {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16, "vocab_size": 256, "dropout": 0.0}
STEPS = 3


def _write_corpus(path: Path) -> str:
    rnd = random.Random(0)
    path.write_text("".join(rnd.choice("abcdefgh ijkl\n") for _ in range(200_000)))
    return str(path)


def _cfg(data_path: str, stage: int, mode: str) -> EngineConfig:
    return EngineConfig.from_dict({"model": dict(TINY), "data": {"path": data_path, "micro_batch_size": 2, "grad_accum": 2},
                                   "train": {"warmup_steps": 0}, "zero": {"stage": stage},
                                   "precision": {"mode": mode}})


def _verify_all(rank: int, world: int, data_path: str) -> dict:
    from mct.engine import Engine
    from mct.verify.compare import run_verify
    out = {}
    for mode in ("fp32", "bf16"):
        for stage in (0, 1, 2, 3):
            out[(mode, stage)] = run_verify(_cfg(data_path, stage, mode), STEPS)
    # Planted bug: gradients come out twice the mean. AdamW alone would not notice.
    Engine._grad_divisor = lambda self: self.comm.world * self.scaler.scale / 2
    for stage in (0, 3):
        out[("bug", stage)] = run_verify(_cfg(data_path, stage, "fp32"), STEPS)
    return out


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict:
    path = _write_corpus(tmp_path_factory.mktemp("verify") / "corpus.txt")
    return run_distributed(_verify_all, 2, path)[0]


@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_verify_passes_for_every_stage(reports, mode, stage):
    report = reports[(mode, stage)]
    assert report.passed, report.table()
    assert len(report.rows) == STEPS


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [0, 3])
def test_verify_fails_on_a_wrong_gradient_averaging_factor(reports, stage):
    report = reports[("bug", stage)]
    assert not report.passed
    assert report.max_grad_norm_rel > 0.9, report.table()  # norms twice the reference's
    assert "FAIL" in report.table()


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "mct", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=240)


@pytest.mark.cli
def test_cli_verify_prints_the_table_and_exits_by_verdict(tmp_path):
    path = _write_corpus(tmp_path / "corpus.txt")
    sets = [f"model.{k}={v}" for k, v in TINY.items()] + [
        f"data.path={path}", "data.micro_batch_size=2", "train.warmup_steps=0", "zero.stage=3"]
    ok = _cli(["verify", "--nproc", "2", "--steps", "2", *[a for s in sets for a in ("--set", s)]], tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "PASS: precision fp32" in ok.stdout and "grad norm" in ok.stdout
    assert ok.stdout.count("PASS") == 1  # rank 0 prints, once
    bad = _cli(["verify", "--nproc", "2", "--steps", "2", "--set", "zero.stage=7"], tmp_path)
    assert bad.returncode == 2 and "zero.stage" in bad.stderr


def test_cli_verify_exits_1_when_the_engine_disagrees(tmp_path, monkeypatch, capsys):
    from mct.cli import main
    from mct.engine import Engine
    path = _write_corpus(tmp_path / "corpus.txt")
    sets = [f"model.{k}={v}" for k, v in TINY.items()] + [f"data.path={path}", "data.micro_batch_size=2",
                                                           "train.warmup_steps=0"]
    args = ["verify", "--steps", "2", *[a for s in sets for a in ("--set", s)]]
    assert main(args) == 0
    monkeypatch.setattr(Engine, "_grad_divisor", lambda self: self.comm.world * self.scaler.scale / 2)
    assert main(args) == 1
    assert "FAIL: precision fp32" in capsys.readouterr().out


def _rounded_masters(monkeypatch) -> None:
    """Plant the old construction: the master cloned from the low-precision working buffer."""
    import mct.zero.flat as flat
    exact = flat.pack

    def rounded(params, layout, shard_rank, param_dtype, master_is_view, device):
        working, master = exact(params, layout, shard_rank, param_dtype, master_is_view, device)
        lo, hi = layout.shard_range(shard_rank)
        return working, (master if master_is_view else working[lo:hi].float().clone())
    monkeypatch.setattr(flat, "pack", rounded)


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_verify_catches_masters_rounded_to_the_working_dtype(tmp_path, monkeypatch, mode):
    from mct.verify.compare import INIT_TOL, run_verify
    cfg = _cfg(_write_corpus(tmp_path / "corpus.txt"), 0, mode)
    good = run_verify(cfg, STEPS)
    assert good.passed and good.init_rel == 0.0, good.table()
    _rounded_masters(monkeypatch)
    bad = run_verify(cfg, STEPS)
    assert not bad.passed and bad.init_rel > 20 * INIT_TOL, bad.table()
    # the per-step and end-of-run tolerances alone let the rounded masters through
    assert bad.max_loss_rel <= bad.loss_tol and bad.param_rel <= bad.param_tol, bad.table()
