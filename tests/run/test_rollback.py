"""The training loop's feedback loop: each divergence detector with its injected fault,
replay (bit-identical), skip, LR cut, stop; MCT_FAULT parsing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mct.config import EngineConfig
from mct.reporting.events import read_events
from mct.run.faults import Fault, FaultPlan, parse_faults
from mct.run.rollback import DivergenceDetector, TrainingStopped
from mct.run.trainer import train
from tests.distributed import run_distributed



def tiny(corpus_dir: Path, steps: int = 8, precision: str = "fp32", **train_keys) -> EngineConfig:
    return EngineConfig.from_dict({
        "seed": 5, "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16, "dropout": 0.1},
        "data": {"path": str(corpus_dir), "micro_batch_size": 2, "grad_accum": 2},
        "precision": {"mode": precision},
        "train": {"steps": steps, "warmup_steps": 2, "eval_every": 0, "log_every": 1, "snapshot_every": 2,
                  **train_keys}})


@pytest.fixture(scope="module")
def clean(corpus_dir, tmp_path_factory):
    """The uninterrupted run of ``tiny(corpus_dir, precision=...)`` (thresholds do not
    change a run without faults), trained once per module."""
    runs: dict[tuple[str, int], Path] = {}

    def get(precision: str = "fp32", stage: int = 0) -> Path:
        if (precision, stage) not in runs:
            runs[precision, stage] = tmp_path_factory.mktemp(f"clean-{precision}-{stage}")
            cfg = tiny(corpus_dir, precision=precision)
            cfg.zero.stage = stage
            train(cfg, runs[precision, stage], progress=False)
        return runs[precision, stage]
    return get


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def run_with_fault(monkeypatch, cfg: EngineConfig, run: Path, fault: str) -> None:
    monkeypatch.setenv("MCT_FAULT", fault)
    try:
        train(cfg, run, progress=False)
    finally:
        monkeypatch.delenv("MCT_FAULT")


@pytest.mark.parametrize("detector,keys", [("loss spike", {}), ("gradient norm", {"loss_spike_factor": 0.0})])
def test_transient_corruption_is_replayed_bit_identical(tmp_path, corpus_dir, monkeypatch, clean, detector, keys):
    cfg = tiny(corpus_dir, **keys)
    run_with_fault(monkeypatch, cfg, tmp_path / "faulty", "corrupt@5")
    events = read_events(tmp_path / "faulty")
    assert [(e["kind"], e["action"], e["step"]) for e in events] == [("rollback", "replay: restore step 4", 6)]
    assert events[0]["reason"].startswith(detector), events[0]["reason"]
    assert (tmp_path / "faulty" / "model.safetensors").read_bytes() == (clean() / "model.safetensors").read_bytes()
    ref, faulty = rows(clean()), rows(tmp_path / "faulty")
    assert [r["step"] for r in faulty] == list(range(8))  # one clean history: the diverged rows are gone
    assert [r["loss"] for r in faulty] == [r["loss"] for r in ref]
    assert [r["rollbacks"] for r in faulty] == [0] * 4 + [1] * 4


@pytest.mark.parametrize("stage", [0, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("precision,fault,reason", [
    ("bf16", "corrupt@5", r"loss spike \d"),  # the gradients stay finite: an applied step with a spike
    ("fp16", "corrupt@5x10", r"loss spike on a skipped step")])  # the scaled fp16 gradients overflow: skipped
def test_corruption_rolls_back_bit_identical_whether_or_not_its_steps_skip(tmp_path, corpus_dir, monkeypatch,
                                                                           clean, stage, precision, fault, reason):
    # A skipped step is judged too (its finite loss is a spike) and never trusts a snapshot;
    # both kinds roll back to step 4 and replay to the clean run's bytes.
    cfg = tiny(corpus_dir, precision=precision, checkpoint_every=2)
    cfg.zero.stage = stage
    run_with_fault(monkeypatch, cfg, tmp_path / "faulty", fault)
    events = read_events(tmp_path / "faulty")
    assert [(e["kind"], e["action"], e["step"]) for e in events] == [("rollback", "replay: restore step 4", 6)]
    assert re.match(reason, events[0]["reason"]), events[0]["reason"]
    ref = clean(precision, stage)
    assert (tmp_path / "faulty" / "model.safetensors").read_bytes() == (ref / "model.safetensors").read_bytes()
    assert [r["loss"] for r in rows(tmp_path / "faulty")] == [r["loss"] for r in rows(ref)]
    # the checkpoint written from the corrupted state is set aside; the replay wrote it anew
    kept = sorted(p.name for p in (tmp_path / "faulty" / "checkpoints").iterdir())
    assert kept == ["step_00000006", "step_00000006.diverged", "step_00000008"], kept


def test_nonfinite_loss_is_detected_and_replayed(tmp_path, corpus_dir, monkeypatch, clean):
    # fp16 logits of a 1e3-times corrupted model overflow: the loss itself is NaN
    run_with_fault(monkeypatch, tiny(corpus_dir, precision="fp16"), tmp_path / "faulty", "corrupt@2")
    events = read_events(tmp_path / "faulty")
    assert [e["kind"] for e in events] == ["rollback"] and events[0]["reason"].startswith("non-finite loss")
    assert (tmp_path / "faulty" / "model.safetensors").read_bytes() == \
        (clean("fp16") / "model.safetensors").read_bytes()


def test_persistent_fault_replays_then_skips_then_cuts_lr_then_stops(tmp_path, corpus_dir, monkeypatch):
    # A skipped step trusts nothing: the snapshot of step 6 (its first step skipped) stays
    # pending, so every rollback goes back to step 4, before the run of skips.
    cfg = tiny(corpus_dir, steps=10, max_consecutive_skips=2)
    with pytest.raises(TrainingStopped, match=r"after 3 rollbacks .*last good step \(4\).*Try: lower train.lr"):
        run_with_fault(monkeypatch, cfg, tmp_path / "run", "nan@6-9")
    events = read_events(tmp_path / "run")
    assert [(e["kind"], e["action"].split(":")[0]) for e in events] == [
        ("rollback", "replay"), ("rollback", "skip"), ("skip_window", "skip the batches of steps 4-7"),
        ("rollback", "lr_cut"), ("lr_cut", "lr x 0.5"), ("stop", "exit 3")]
    assert all("consecutive skipped steps" in e["reason"] for e in events)
    assert events[2]["data_offset"] == 4
    assert not (tmp_path / "run" / "model.safetensors").exists()


def test_skip_moves_the_data_and_lr_cut_halves_the_lr(tmp_path, corpus_dir, monkeypatch, clean):
    # nan@6 every time step 6 runs; with max_consecutive_skips=1 one skip is a divergence.
    # The good state is that of step 4 (snapshot_every=2): window 4-6.
    cfg = tiny(corpus_dir, max_consecutive_skips=1)
    with pytest.raises(TrainingStopped):
        run_with_fault(monkeypatch, cfg, tmp_path / "run", "nan@6")
    clean, faulty = rows(clean()), rows(tmp_path / "run")
    assert [r["step"] for r in faulty] == [0, 1, 2, 3, 4, 5]  # the diverged step is never logged
    assert [r["loss"] for r in faulty[:4]] == [r["loss"] for r in clean[:4]]
    for r, c in zip(faulty[4:], clean[4:6]):  # the last attempt: the batches of steps 7-8, half the LR
        assert r["lr"] == pytest.approx(0.5 * c["lr"]) and r["loss"] != c["loss"] and r["rollbacks"] == 3
    skip = [e for e in read_events(tmp_path / "run") if e["kind"] == "skip_window"]
    assert skip[0]["action"] == "skip the batches of steps 4-6" and skip[0]["data_offset"] == 3


def test_scale_floor_is_a_divergence_and_rolls_back(tmp_path, corpus_dir, monkeypatch):
    cfg = EngineConfig.from_dict({**tiny(corpus_dir, steps=5, precision="fp16").to_dict(),
                                  "precision": {"mode": "fp16", "initial_scale_power": 3, "min_scale": 8.0,
                                                "hysteresis": 1}})
    with pytest.raises(TrainingStopped, match="loss scale already at its floor"):
        run_with_fault(monkeypatch, cfg, tmp_path / "run", "nan@3-4")
    kinds = [e["kind"] for e in read_events(tmp_path / "run")]
    assert kinds == ["rollback", "rollback", "skip_window", "rollback", "lr_cut", "stop"]


def _two_rank_corrupt(rank: int, world: int, root: str) -> list[bytes] | None:
    import os
    cfg = tiny(Path(root) / "corpus")
    cfg.zero.stage = 2
    out = []
    for fault in ("", "corrupt@5"):
        os.environ["MCT_FAULT"] = fault
        run = Path(root) / f"run-{fault or 'clean'}"
        train(cfg, run, progress=False)
        if rank == 0:  # rank 0 wrote it
            out.append((run / "model.safetensors").read_bytes())
    return out or None


@pytest.mark.multirank
def test_two_ranks_roll_back_together_bit_identical(tmp_path, corpus_dir):
    (tmp_path / "corpus").symlink_to(corpus_dir)
    clean, faulty = run_distributed(_two_rank_corrupt, 2, str(tmp_path))[0]
    assert faulty == clean
    assert [e["kind"] for e in read_events(tmp_path / "run-corrupt@5")] == ["rollback"]


def test_mct_fault_parsing():
    assert parse_faults("corrupt@3, nan@5-7,kill@4:0,kill@9,abort@6:0") == [
        Fault("corrupt", 3, 3), Fault("nan", 5, 7), Fault("kill", 4, 4, 0), Fault("kill", 9, 9, 1),
        Fault("abort", 6, 6, 0)]
    for bad in ("corrupt", "nan@x", "kill@3-4", "corrupt@3:1", "nan@5-2", "flip@3", "abort@2-3", "abort@2x5"):
        with pytest.raises(ValueError, match="MCT_FAULT"):
            parse_faults(bad)
    assert FaultPlan.from_env({"MCT_FAULT": "nan@1"}).faults == [Fault("nan", 1, 1)]
    assert not FaultPlan.from_env({"MCT_FAULT": "nan@1", "TORCHELASTIC_RESTART_COUNT": "1"})


def test_detector_thresholds():
    cfg = EngineConfig.from_dict({"train": {"loss_spike_factor": 2.0, "grad_norm_factor": 10.0,
                                            "max_consecutive_skips": 2, "loss_spike_window": 8}}).train
    det = DivergenceDetector(cfg)
    for loss in (4.0, 3.0, 3.0, 3.0):
        assert det.observe(loss, 1.0, False) == ""
    assert det.observe(30.0, 1.0, False) == ""  # fewer than 5 good steps: no judgement yet
    assert det.observe(3.0, 1.0, False) == ""
    assert det.observe(6.1, 1.0, False) == "loss_spike"  # median of the 6 good losses is 3.0
    assert det.observe(5.9, 1.0, False) == ""
    assert det.observe(3.0, 10.5, False) == "grad_norm"
    assert det.observe(float("nan"), 1.0, False) == "nonfinite_loss"
    assert det.observe(3.0, float("inf"), True) == ""
    assert det.observe(3.0, float("inf"), True) == "consecutive_skips"


@pytest.mark.parametrize("key,value", [("train.max_rollbacks", -1), ("train.lr_cut_factor", 0.0),
                                       ("train.lr_cut_factor", 1.5), ("train.loss_spike_factor", 0.5),
                                       ("train.preempt_timeout_s", 0.0), ("train.max_consecutive_skips", 0)])
def test_bad_thresholds_name_the_key(key, value):
    section, name = key.split(".")
    with pytest.raises(ValueError, match=name):
        EngineConfig.from_dict({section: {name: value}})


@pytest.mark.parametrize("stage, offload", [(3, {"optimizer": "disk", "params": "disk"}), (0, {"optimizer": "cpu"})])
@pytest.mark.slow
def test_offloaded_run_rolls_back_from_snapshots_in_its_store_bit_identical(tmp_path, corpus_dir, monkeypatch,
                                                                             stage, offload):
    """With offload the rollback snapshots live in the offload store (the state is never
    held in memory whole): corrupt@5 is replayed from step 4 and the run ends with the
    bytes of the same run without the fault."""
    def cfg() -> EngineConfig:
        d = tiny(corpus_dir).to_dict()
        d["zero"]["stage"] = stage
        d["offload"] = {**offload, "dir": str(tmp_path), "chunk_mb": 0.002}
        return EngineConfig.from_dict(d)
    train(cfg(), tmp_path / "clean", progress=False)
    run_with_fault(monkeypatch, cfg(), tmp_path / "faulty", "corrupt@5")
    events = read_events(tmp_path / "faulty")
    assert [(e["kind"], e["action"], e["step"]) for e in events] == [("rollback", "replay: restore step 4", 6)]
    assert (tmp_path / "faulty" / "model.safetensors").read_bytes() == \
        (tmp_path / "clean" / "model.safetensors").read_bytes()
    assert [r["loss"] for r in rows(tmp_path / "faulty")] == [r["loss"] for r in rows(tmp_path / "clean")]


def test_resume_never_picks_an_untrusted_checkpoint_over_a_trusted_one(tmp_path, corpus_dir):
    from mct.persistence.run_dir import TRUSTED, newest_usable
    run = tmp_path / "run"
    train(tiny(corpus_dir, steps=4, checkpoint_every=2), run, progress=False)
    ckpts = run / "checkpoints"
    assert (ckpts / "step_00000002" / TRUSTED).exists() and (ckpts / "step_00000004" / TRUSTED).exists()
    (ckpts / "step_00000004" / TRUSTED).unlink()  # as if its state had never stepped cleanly
    path, _, warning = newest_usable(run)
    assert path.name == "step_00000002" and "step_00000004 (not trusted" in warning
    (ckpts / "step_00000002" / TRUSTED).unlink()  # nothing trusted: the newest complete one
    assert newest_usable(run)[0].name == "step_00000004"
