"""A machine profile that checks itself: the load is watched and recorded while it is
measured (a busy pass measured again, each rate the best of the passes), a run whose steps
disagree with it says so in one line and marks it suspect, and the next measuring command
measures it again with the line first. No real measurement: the passes are stubs."""

from __future__ import annotations

import json

import pytest
import torch

import mct.machine.cache as cache_mod
import mct.machine.passes as passes_mod
from mct.cli import main
from mct.config import EngineConfig
from mct.machine import MachineProfile, calibrate, cpu_identity, current_key, usable_cores
from mct.machine.load import Load, LoadWatch, busy_cpu_seconds, quiet_now
from mct.machine.trust import STATED_ERROR, check_run
from mct.planner.overhead import machine_rates
from mct.run.trainer import train
from tests.helpers import SEEDED_EXTRA, FakeWatch


def _profile(fp32: float = 50e9, **kw) -> MachineProfile:
    ident = cpu_identity()
    return MachineProfile(device="cpu", name=ident["model"], flags=ident["flags"], torch_version=torch.__version__,
                          threads=usable_cores(), matmul_one={"fp32": fp32}, matmul_all={"fp32": 2 * fp32},
                          matmul_size={"fp32": 1024}, memcpy_bytes_per_s=5e9, measured_at="2026-01-01T00:00:00Z",
                          seconds=3.0, extra={**SEEDED_EXTRA, "elementwise_curve": [[65536.0, 1e9 + fp32 / 1e3]]},
                          **kw)


@pytest.fixture
def passes(monkeypatch) -> list[MachineProfile]:
    """Each measured pass (a stub: fp32 rate 60, 50, 40 GFLOP/s ... in turn), every pass
    seen as quiet unless a test scripts the load (``FakeWatch``)."""
    measured: list[MachineProfile] = []

    def measure(device: str = "cpu") -> MachineProfile:
        measured.append(_profile(60e9 - 10e9 * len(measured)))
        return measured[-1]
    monkeypatch.setattr(cache_mod, "measure_profile", measure)
    monkeypatch.setattr(passes_mod, "LoadWatch", FakeWatch([0.02]))
    return measured


def test_load_watch_counts_other_processes_busy_time(tmp_path):
    stat = tmp_path / "stat"
    # columns: user nice system idle iowait irq softirq steal; ticks of 1/100 s
    stat.write_text("cpu  0 0 0 0 0 0 0 0\ncpu0 100 0 50 900 30 0 0 0\ncpu1 10 0 0 990 0 0 0 0\ncpu7 500 0 0 0 0 0 0 0\n")
    assert busy_cpu_seconds({0, 1}, stat) == pytest.approx(1.6)  # cpu7 is not ours; iowait is not busy
    assert busy_cpu_seconds({0}, tmp_path / "absent") is None
    with LoadWatch() as watch:
        sum(i * i for i in range(200_000))  # this process's own CPU time is not "other"
    load = watch.load()
    assert load.cores == usable_cores() and load.seconds > 0
    assert load.other_cores is None or load.other_cores >= 0
    assert Load(1.2, 2, 3.0, 10.0).busy and not Load(0.1, 2, 0.5, 10.0).busy and not Load(None, 2, None, 1).busy
    assert Load.from_dict(Load(1.2, 2, 3.0, 10.0).to_dict()) == Load(1.2, 2, 3.0, 10.0)


def test_a_quiet_measurement_is_one_pass_with_its_load_recorded(tmp_path, passes, capsys):
    cal = calibrate(path=tmp_path / "machine.json")
    assert len(passes) == 1 and cal.profile.load == {"other_cores": 0.02, "cores": 2, "loadavg": 1.0,
                                                     "seconds": 5.0, "passes": 1}
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("mct: first use: no profile of this machine in ")
    assert "measuring this machine now, about 15 s" in err[0]
    cached = json.loads((tmp_path / "machine.json").read_text())["profiles"][current_key("cpu")]
    assert cached["load"]["other_cores"] == 0.02 and cached["suspect"] == ""


def test_a_busy_measurement_is_repeated_and_keeps_each_rates_best(tmp_path, passes, monkeypatch):
    monkeypatch.setattr(passes_mod, "LoadWatch", FakeWatch([1.4, 0.9, 0.1]))
    said: list[str] = []
    p = calibrate(path=tmp_path / "machine.json", say=said.append).profile
    assert len(passes) == 3 and p.load["passes"] == 3 and p.load["other_cores"] == 0.1  # the quietest pass's
    assert p.matmul_one["fp32"] == 60e9 and p.matmul_all["fp32"] == 120e9  # the best of 60, 50, 40
    assert p.extra["elementwise_curve"] == [[65536.0, 1e9 + 60e6]]  # curves pointwise
    assert not p.load_busy and len(said) == 3  # the first-use line, then one per extra pass
    assert "busy" in said[1] and "1.40 of 2 cores" in said[1] and "pass 2 of 3" in said[1]


def test_a_measurement_busy_throughout_is_recorded_as_such_in_one_line(tmp_path, passes, monkeypatch):
    monkeypatch.setattr(passes_mod, "LoadWatch", FakeWatch([1.5]))
    said: list[str] = []
    p = calibrate(path=tmp_path / "machine.json", say=said.append).profile
    assert len(passes) == 3 and p.load_busy and p.load["other_cores"] == 1.5
    assert "measured under load" in said[-1] and "mct calibrate --force" in said[-1]


@pytest.mark.parametrize("damage", ["truncated", "threads a string", "rate a string", "load not an object",
                                    "load cores a float", "suspect a number", "pinned a string"])
def test_a_damaged_profile_is_measured_again_with_the_line_first(tmp_path, passes, damage):
    path = tmp_path / "machine.json"
    good = _profile().to_dict()
    entry = {"truncated": None, "threads a string": {"threads": "2"}, "rate a string": {"memcpy_bytes_per_s": "5e9"},
             "load not an object": {"load": [0.1]}, "load cores a float": {"load": {**Load(0.1, 2, 1.0, 1.0).to_dict(),
                                                                                    "cores": 2.0}},
             "suspect a number": {"suspect": 3}, "pinned a string": {"pinned": "yes"}}[damage]
    text = json.dumps({"version": 1, "profiles": {current_key("cpu"): {**good, **(entry or {})}}})
    path.write_text(text[:60] if entry is None else text)
    said: list[tuple[str, int]] = []
    cal = calibrate(path=path, say=lambda line: said.append((line, len(passes))))
    assert cal.source == "measured" and len(passes) == 1
    line, measured_before = said[0]
    assert measured_before == 0 and line.startswith("warning: ") and str(path) in line
    assert "measuring this machine now" in line
    assert calibrate(path=path).profile == cal.profile  # rewritten whole, readable


def test_cache_dir_naming_a_file_is_one_line_before_the_measurement(tmp_path, passes, monkeypatch, capsys):
    (tmp_path / "cache").write_text("not a directory")
    monkeypatch.setenv("MCT_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["calibrate"]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines() == [f"mct: warning: {tmp_path / 'cache'} (MCT_CACHE_DIR) is not a directory: the "
                                f"profile is not cached; set MCT_CACHE_DIR to a directory; measuring this machine "
                                f"now, about 15 s (up to 3x that on a busy machine)"]
    assert out.startswith("machine  ") and (tmp_path / "cache").read_text() == "not a directory"


def test_calibrate_and_plan_say_when_and_under_what_load_it_was_measured(tmp_path, passes, monkeypatch, capsys):
    monkeypatch.setenv("MCT_CACHE_DIR", str(tmp_path))
    assert main(["calibrate"]) == 0
    assert "quiet (other processes used 0.02 of 2 cores), 1 pass" in capsys.readouterr().out.splitlines()[1]
    assert main(["calibrate"]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert line.startswith(f"profile  cached in {tmp_path / 'machine.json'} (measured 2026-01-01T00:00:00Z in ")
    assert "quiet (other processes used 0.02 of 2 cores)" in line
    rates, _ = machine_rates(1, "cpu")  # what `mct plan` prints as its first step-time note
    assert rates.notes[0].startswith("machine profile measured 2026-01-01T00:00:00Z")
    assert "quiet (other processes used 0.02 of 2 cores)" in rates.notes[0]


def test_a_run_3x_its_prediction_says_so_and_marks_the_profile_suspect(tmp_path, passes):
    path = tmp_path / "machine.json"
    calibrate(path=path)
    profile = MachineProfile.from_dict({**_profile().to_dict(), "load": {}})  # load unknown: it may be at fault
    path.write_text(json.dumps({"version": 1, "profiles": {profile.key: profile.to_dict()}}))
    assert check_run(profile, 0.29, 0.2, steady_steps=5, path=path) is None  # within the stated 1.5x
    assert check_run(profile, 0.6, 0.2, steady_steps=2, path=path) is None  # too few steady steps to judge
    line = check_run(profile, 0.6, 0.2, steady_steps=5, path=path)
    assert "\n" not in line and "steps took 3.00x the predicted 0.2 s" in line and f"{STATED_ERROR}x" in line
    assert profile.key in line and "marked suspect" in line and "mct calibrate --force" in line
    cached = json.loads(path.read_text())["profiles"][profile.key]
    assert cached["suspect"].startswith("steps took 3.00x the predicted 0.2 s")
    said: list[tuple[str, int]] = []
    again = calibrate(path=path, say=lambda s: said.append((s, len(passes))))  # the next plan / auto
    assert again.source == "measured" and len(passes) == 2 and not again.profile.suspect
    assert said[0][1] == 1 and "is suspect (steps took 3.00x" in said[0][0] and "measuring" in said[0][0]
    assert calibrate(path=path).source == "cache"  # measured again once, then trusted


def test_mfu_above_peak_marks_it_and_a_pinned_or_quiet_profile_is_not_marked(tmp_path, passes):
    path = tmp_path / "machine.json"
    profile = _profile()
    path.write_text(json.dumps({"version": 1, "profiles": {profile.key: profile.to_dict()}}))
    line = check_run(profile, 0.2, 0.2, steady_steps=5, over_peak=True, path=path)
    assert "exceeded the profile's matmul peak" in line and "marked suspect" in line
    quiet = MachineProfile.from_dict({**profile.to_dict(), "load": {**Load(0.02, 2, 0.1, 5.0).to_dict(), "passes": 1}})
    pinned = MachineProfile.from_dict({**profile.to_dict(), "pinned": True})
    path.write_text(json.dumps({"version": 1, "profiles": {profile.key: quiet.to_dict()}}))
    line = check_run(quiet, 0.6, 0.2, 5, run_load=Load(1.3, 2, 2.0, 9.0), path=path)
    assert "the run shared the machine" in line and "not marked" in line
    line = check_run(quiet, 0.6, 0.2, 5, run_load=Load(0.01, 2, 0.1, 9.0), path=path)
    assert "the time model is off for this configuration" in line
    assert "pinned, not marked" in check_run(pinned, 0.6, 0.2, 5, path=path)
    assert json.loads(path.read_text())["profiles"][profile.key]["suspect"] == ""


def test_training_run_far_off_its_prediction_prints_one_line(tmp_path, corpus_dir, monkeypatch, capsys,
                                                             machine_profile_cache):
    """The trainer's end-of-run check, wired: a prediction far below the steps (a profile a
    loaded machine measured reads the other way round alike) is one warning line, and the
    cached profile (unpinned) is marked suspect."""
    entries = json.loads((machine_profile_cache / "machine.json").read_text())
    for entry in entries["profiles"].values():
        entry["pinned"] = False
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "machine.json").write_text(json.dumps(entries))
    monkeypatch.setenv("MCT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("mct.run.utilization.predict_step_s", lambda *a, **k: 1e-6)
    cfg = EngineConfig.from_dict({"seed": 1, "model": {"n_layer": 1, "n_head": 2, "d_model": 16, "seq_len": 8},
                                  "data": {"path": str(corpus_dir), "micro_batch_size": 2},
                                  "train": {"steps": 5, "eval_every": 0, "log_every": 1}})
    train(cfg, tmp_path / "run", progress=False)
    err = [line for line in capsys.readouterr().err.splitlines() if "machine profile" in line]
    assert len(err) == 1 and err[0].startswith("mct: warning: steps took ") and "marked suspect" in err[0]
    suspect = json.loads((tmp_path / "cache" / "machine.json").read_text())["profiles"][current_key("cpu")]["suspect"]
    assert suspect.startswith("steps took ")


def test_report_shows_the_ratio_flags_it_and_says_when_the_profile_was_measured(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": i, "loss": 1.0, "step_time_s": 0.6, "predicted_step_s": 0.2} for i in range(4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    profile = {**_profile().to_dict(), "load": {**Load(1.3, 2, 2.5, 9.0).to_dict(), "passes": 3}}
    (run / "metadata.json").write_text(json.dumps({"utilization": {"machine_profile": profile}}))
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[-1] == "3.00"  # measured / predicted per row
    timing = next(line for line in out if line.startswith("step time: "))
    assert "(measured / predicted 3.00; outside the time model's stated 1.5x" in timing
    assert "mct calibrate --force" in timing
    assert ("machine profile: measured 2026-01-01T00:00:00Z in 3.0 s, under load (other processes used 1.30 of 2 "
            "cores), 3 passes") in out
    rows = [{**r, "step_time_s": 0.25} for r in rows]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(run)]) == 0
    timing = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("step time: "))
    assert timing.endswith("(measured / predicted 1.25)")


def test_overheads_measured_under_load_are_measured_again_keeping_the_smaller(monkeypatch, capsys):
    import mct.planner.overhead as overhead
    got = [(3e-5, 1e-3, 4e-10), (2e-5, 2e-3, 1e-10)]  # the busy measurement, then the one after it
    monkeypatch.setattr(overhead, "measure_op_overhead", lambda rates, threads, ranks=1: got.pop(0))
    monkeypatch.setattr(overhead, "LoadWatch", FakeWatch([1.4, 0.3]))
    monkeypatch.setattr(overhead, "remember", lambda p, key, value: (MachineProfile.from_dict(
        {**p.to_dict(), "extra": {**p.extra, key: {**p.extra.get(key, {}), **value}}}), None))
    profile = MachineProfile.from_dict({**_profile().to_dict(), "extra": {}})
    profile, warning = overhead._with_overhead(profile, 1, 1)
    assert warning is None and not got  # measured twice
    assert profile.extra["op_overhead_s"]["1"] == 2e-5 and profile.extra["byte_overhead_s"]["1"] == 1e-10
    assert profile.extra["overhead_load"]["1"]["other_cores"] == 0.3  # the quieter of the two
    assert "measuring the per-op overhead of 1 rank(s)" in capsys.readouterr().err  # said before


def test_auto_in_a_training_rank_says_why_a_suspect_profile_is_not_measured(tmp_path, passes, monkeypatch, capsys):
    from mct.planner.solver import timing
    from mct.task import task_for
    path = tmp_path / "machine.json"
    profile = MachineProfile.from_dict({**_profile().to_dict(), "suspect": "steps took 3.00x the predicted 0.2 s"})
    path.write_text(json.dumps({"version": 1, "profiles": {profile.key: profile.to_dict()}}))
    monkeypatch.setenv("MCT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("RANK", raising=False)
    cfg = EngineConfig.from_dict({"model": {"n_layer": 1, "n_head": 2, "d_model": 16, "seq_len": 8}})
    assert timing(task_for(cfg), cfg, 1, measure=False)["rates"] is not None and not passes  # nothing measured
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("mct: warning: the machine profile is suspect (steps took 3.00x")
    assert "a training rank measures nothing" in err[0] and "mct calibrate --force" in err[0]
    monkeypatch.setenv("RANK", "1")
    timing(task_for(cfg), cfg, 1, measure=False)
    assert capsys.readouterr().err == ""  # rank 0 says it, once


def test_a_profile_measured_under_load_is_measured_again_once_the_machine_is_quiet(tmp_path, passes, monkeypatch):
    path = tmp_path / "machine.json"
    busy = MachineProfile.from_dict({**_profile().to_dict(), "load": {**Load(1.6, 2, 7.0, 9.0).to_dict(), "passes": 3}})
    path.write_text(json.dumps({"version": 1, "profiles": {busy.key: busy.to_dict()}}))
    monkeypatch.setattr(cache_mod, "quiet_now", lambda: False)
    assert calibrate(path=path).profile == busy and not passes  # still busy: measuring now would be no better
    monkeypatch.setattr(cache_mod, "quiet_now", lambda: True)
    said: list[str] = []
    cal = calibrate(path=path, say=said.append)
    assert cal.source == "measured" and len(passes) == 1 and not cal.profile.load_busy
    assert said[0].startswith("warning: the machine profile was measured 2026-01-01T00:00:00Z under load (1.60 of 2")
    assert "the machine is quiet now; measuring this machine now" in said[0]


def test_quiet_now_is_what_other_processes_used_while_it_slept(monkeypatch):
    import mct.machine.load as load_mod
    for used, quiet in ((0.0, True), (0.005, True), (0.05, False)):  # CPU seconds others used in 0.1 s
        readings = iter([100.0, 100.0 + used])
        monkeypatch.setattr(load_mod, "busy_cpu_seconds", lambda cpus, stat: next(readings))
        assert quiet_now(0.1) is quiet, used
    monkeypatch.setattr(load_mod, "busy_cpu_seconds", lambda cpus, stat: None)
    assert quiet_now(0.01) is False  # unknown is not quiet
