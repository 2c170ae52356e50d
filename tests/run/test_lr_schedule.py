"""``train.lr_schedule``: each schedule's shape, the default unchanged, config errors,
state round trips, a CLI resume mid-decay bit-identical, and the LR in the report plot."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from mct.cli import main
from mct.config import LR_SCHEDULES, EngineConfig, TrainConfig
from mct.persistence.run_dir import step_dir
from mct.run.schedule import LRSchedule, lr_at
from mct.run.trainer import train
from tests.persistence.test_resume import _resume, _rows, _write_corpus, tiny_run


def _lrs(**keys) -> list[float]:
    cfg = TrainConfig(**keys)
    return [lr_at(s, cfg) for s in range(cfg.steps)]


def test_default_is_the_old_warmup_then_cosine_to_a_tenth_bit_for_bit():
    cfg = TrainConfig(steps=50, warmup_steps=7, lr=1e-3)
    assert cfg.lr_schedule == "cosine" and cfg.min_lr_ratio == 0.1

    def old(step: int) -> float:
        if step < 7:
            return 1e-3 * (step + 1) / 7
        return 1e-3 * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - 7) / 43))))
    assert [lr_at(s, cfg) for s in range(60)] == [old(s) for s in range(60)]


def test_constant_gives_the_same_lr_at_every_step_even_with_a_warmup_set():
    assert set(_lrs(lr_schedule="constant", steps=40, warmup_steps=10, lr=2e-3)) == {2e-3}


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_decaying_schedules_warm_up_then_fall_monotonically_towards_min_lr(kind):
    lrs = _lrs(lr_schedule=kind, steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.25)
    assert lrs[:10] == [(s + 1) / 10 for s in range(10)]
    after = lrs[10:]
    assert after[0] == 1.0 and all(a > b for a, b in zip(after, after[1:]))
    assert 0.25 < after[-1] < 0.27
    assert lr_at(100, TrainConfig(lr_schedule=kind, steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.25)) == 0.25
    mid = lrs[55]  # halfway through the decay: linear is at the midpoint, and so is cosine
    assert mid == pytest.approx(0.625, abs=1e-12)
    if kind == "linear":
        steps = [a - b for a, b in zip(after, after[1:])]
        assert max(steps) == pytest.approx(min(steps), rel=1e-9)  # a straight line
    else:
        assert after[5] - after[6] < after[45] - after[46]  # slow start, steepest in the middle


def test_wsd_warms_up_holds_then_decays_linearly_over_its_fraction():
    lrs = _lrs(lr_schedule="wsd", steps=50, warmup_steps=10, lr=1.0, min_lr_ratio=0.0, decay_fraction=0.25)
    assert lrs[:10] == [(s + 1) / 10 for s in range(10)]
    assert lrs[10:40] == [1.0] * 30  # stable: the last round(0.25 * 40) = 10 steps decay
    assert lrs[40:] == pytest.approx([1.0 - k / 10 for k in range(10)], abs=1e-15)
    no_decay = _lrs(lr_schedule="wsd", steps=20, warmup_steps=4, lr=1.0, decay_fraction=0.0)
    assert no_decay[4:] == [1.0] * 16


def test_min_lr_ratio_applies_to_every_decaying_schedule():
    for kind in ("cosine", "linear", "wsd"):
        cfg = TrainConfig(lr_schedule=kind, steps=20, warmup_steps=0, lr=1.0, min_lr_ratio=0.5)
        assert lr_at(20, cfg) == pytest.approx(0.5) and lr_at(0, cfg) == 1.0, kind


@pytest.mark.parametrize("keys,match", [
    ({"lr_schedule": "step"}, "train.lr_schedule = 'step' is not allowed: must be one of cosine, linear, "
                              "constant, wsd"),
    ({"min_lr_ratio": 1.5}, "train.min_lr_ratio = 1.5"),
    ({"min_lr_ratio": -0.1}, "train.min_lr_ratio = -0.1"),
    ({"decay_fraction": 2.0}, "train.decay_fraction = 2.0"),
    ({"decay_fraction": float("nan")}, "train.decay_fraction = nan")])
def test_bad_schedule_keys_are_one_line_errors(keys, match):
    with pytest.raises(ValueError, match="^" + match.replace(".", r"\.").replace("(", r"\(")) as e:
        EngineConfig.from_dict({"train": keys})
    assert "\n" not in str(e.value)


def test_the_cli_names_an_unknown_schedule_and_the_choices(capfd):
    assert main(["train", "--set", "train.lr_schedule=cosine_restarts"]) == 2
    err = capfd.readouterr().err.strip()
    assert err.startswith("mct: error: train.lr_schedule = 'cosine_restarts'") and "wsd" in err and "\n" not in err


@pytest.mark.parametrize("kind", LR_SCHEDULES)
def test_a_restored_schedule_continues_mid_decay_bit_for_bit(kind):
    cfg = TrainConfig(lr_schedule=kind, steps=30, warmup_steps=4, lr=1e-3, min_lr_ratio=0.05, decay_fraction=0.5)
    a = LRSchedule(cfg)
    a.cut(0.5)
    sd = json.loads(json.dumps(a.state_dict()))  # as trainer.json stores it
    b = LRSchedule(TrainConfig(**json.loads(json.dumps(cfg.__dict__))))  # the config as resumed
    b.load_state_dict(sd)
    assert [b.lr(s) for s in range(20, 30)] == [a.lr(s) for s in range(20, 30)]
    assert len({a.lr(s) for s in range(20, 30)}) == (1 if kind == "constant" else 10)  # mid-decay


def test_cli_resume_mid_wsd_decay_is_bit_identical(tmp_path):
    corpus = _write_corpus(tmp_path / "corpus")
    keys = {"lr_schedule": "wsd", "warmup_steps": 1, "decay_fraction": 0.6, "min_lr_ratio": 0.0}
    cfg = EngineConfig.from_dict(tiny_run(corpus, **keys))
    base = tmp_path / "base"
    train(cfg, base, progress=False)
    lrs = [r["lr"] for r in _rows(base)]
    assert lrs == [lr_at(s, cfg.train) for s in range(6)] and lrs[1:3] == [cfg.train.lr] * 2
    assert lrs[3] > lrs[4] > lrs[5] > 0.0  # steps 3-5 decay: the resume below starts inside it
    run = tmp_path / "run"
    shutil.copytree(base, run)
    shutil.rmtree(step_dir(run, 6))
    _resume(run)
    assert (run / "model.safetensors").read_bytes() == (base / "model.safetensors").read_bytes()
    assert [(r["step"], r["loss"], r["lr"]) for r in _rows(run)] == [(r["step"], r["loss"], r["lr"])
                                                                     for r in _rows(base)]
    assert main(["train", "--resume", str(run), "--set", "train.lr_schedule=cosine"]) == 2


def test_report_plot_draws_the_learning_rate(tmp_path):
    from mct.reporting.plots import _lr_axis, _pyplot, plot_run
    rows = [{"step": s, "loss": 3.0 - 0.1 * s, "lr": 1e-3 * (s + 1) / 4} for s in range(4)]
    plt = _pyplot()
    fig, ax = plt.subplots()
    lr_ax = _lr_axis(ax, rows)
    (line,) = lr_ax.get_lines()
    assert list(line.get_ydata()) == [r["lr"] for r in rows] and lr_ax.get_ylabel() == "learning rate"
    assert _lr_axis(ax, [{"step": 0, "loss": 1.0}]) is None  # rows without lr: nothing drawn
    plt.close(fig)
    assert plot_run(rows, [], None, tmp_path / "run.png").read_bytes()[:4] == b"\x89PNG"
