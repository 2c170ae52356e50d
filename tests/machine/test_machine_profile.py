"""The machine profile: measured, cached by key, a damaged cache measured again, and
``mct calibrate``'s output (in-process)."""

from __future__ import annotations

import json

import pytest
import torch

import mct.machine.cache as cache_mod
import mct.machine.passes as passes_mod
import mct.machine.profile as profile_mod
from mct.cli import main
from mct.machine import MachineProfile, cache_file, calibrate, cpu_identity, current_key, usable_cores
from tests.helpers import FakeWatch


@pytest.fixture
def quick(monkeypatch):
    """Matmuls timed at 256 x 256 (no growing), the time model's rates at two matmul widths
    and one elementwise size: a real measurement in about a second."""
    monkeypatch.setattr(profile_mod, "MIN_CALL_S", 0.0)
    monkeypatch.setattr(profile_mod, "MATMUL_DIMS", (16, 64))
    monkeypatch.setattr(profile_mod, "ELEMENTWISE_SIZES", (2**16,))
    monkeypatch.setattr(profile_mod, "THREADED_MATMUL_SIZES", (64,))
    monkeypatch.setattr(passes_mod, "MAX_PASSES", 1)  # one pass even when the suite's other worker loads the machine


MEASURES = pytest.mark.xdist_group("machine-measurement")
"""On one worker, one after the other: each times matmuls on every core, and two such
measurements at once (one per worker) spin OpenMP's threads against each other on a 2-core
machine; a quick measurement then took over 300 s instead of 13."""


@pytest.fixture
def stub(monkeypatch) -> list[MachineProfile]:
    """No measurement: this machine's key with fixed rates; the list holds every profile
    'measured'."""
    measured: list[MachineProfile] = []

    def measure(device: str = "cpu") -> MachineProfile:
        ident = cpu_identity()
        p = MachineProfile(device="cpu", name=ident["model"], flags=ident["flags"], torch_version=torch.__version__,
                           threads=usable_cores(), matmul_one={"fp32": 4e10 + len(measured), "bf16": 8e10},
                           matmul_all={"fp32": 7e10, "bf16": 1.5e11}, matmul_size={"fp32": 2048, "bf16": 2048},
                           memcpy_bytes_per_s=6e9, measured_at="2026-01-01T00:00:00Z", seconds=2.5)
        measured.append(p)
        return p
    monkeypatch.setattr(cache_mod, "measure_profile", measure)
    monkeypatch.setattr(passes_mod, "LoadWatch", FakeWatch([0.0]))  # one pass, whatever else runs
    return measured


@MEASURES
def test_calibrate_measures_once_then_reads_the_cache(tmp_path, quick):
    path = tmp_path / "machine.json"
    first = calibrate(path=path)
    assert first.source == "measured" and first.warning is None and path.is_file()
    p = first.profile
    assert p.key == current_key("cpu") and p.threads >= 1 and p.memcpy_bytes_per_s > 0
    assert p.matmul_one["fp32"] > 0 and p.matmul_all["fp32"] > 0 and p.matmul_size["fp32"] == 256
    again = calibrate(path=path)
    assert again.source == "cache" and again.profile == p
    assert calibrate(path=path, force=True).source == "measured"
    assert MachineProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p


@pytest.mark.parametrize("damage", ["truncated", "not an object", "old version", "damaged entry", "kinds not an object",
                                    "kind curve not pairs", "dtype curve negative", "mode cost a string",
                                    "random rate infinite", "selective cost negative"])
def test_damaged_cache_is_measured_again_not_a_traceback(tmp_path, stub, damage):
    path = tmp_path / "machine.json"
    good = calibrate(path=path).profile.to_dict()
    text = {"truncated": path.read_text()[:40], "not an object": "[1, 2]",
            "old version": json.dumps({"version": 0, "profiles": {}}),
            "damaged entry": json.dumps({"version": 1, "profiles": {current_key("cpu"): {**good, "matmul_one": {}}}}),
            "kinds not an object": _with_extra(good, elementwise_by_kind=[1, 2]),
            "kind curve not pairs": _with_extra(good, elementwise_by_kind={"light": {"fp32": [[1.0, "fast"]]}}),
            "dtype curve negative": _with_extra(good, elementwise_by_dtype={"bf16": [[65536.0, -1.0]]}),
            "mode cost a string": _with_extra(good, python_mode_op_s="fast"),
            "random rate infinite": _with_extra(good, random_elements_per_s=float("inf")),
            "selective cost negative": _with_extra(good, selective_mode_op_s=-1e-5),
            }[damage]
    path.write_text(text)
    said: list[tuple[str, int]] = []
    cal = calibrate(path=path, say=lambda line: said.append((line, len(stub))))
    assert cal.source == "measured" and cal.warning is None and len(stub) == 2
    line, measured_before = said[0]
    assert line.startswith("warning: ") and str(path) in line and "measuring this machine now" in line
    assert measured_before == 1  # said before the measurement, never after minutes of silence
    assert calibrate(path=path).profile == cal.profile  # rewritten whole


def _with_extra(good: dict, **extra) -> str:
    """A cache whose one entry is ``good`` with ``extra`` overwritten (the profile's version)."""
    entry = {**good, "extra": {**good["extra"], **extra}}
    return json.dumps({"version": 1, "profiles": {current_key("cpu"): entry}})


def test_unwritable_cache_warns_and_still_gives_the_profile(tmp_path, stub):
    (tmp_path / "file").write_text("")
    said: list[str] = []
    cal = calibrate(path=tmp_path / "file" / "machine.json", say=said.append)  # its folder is a file
    assert cal.source == "measured" and cal.profile.matmul_one["fp32"] > 0 and cal.warning is None
    assert len(said) == 1 and "MCT_CACHE_DIR" in said[0] and "not a directory" in said[0]


def test_cache_file_follows_mct_cache_dir_then_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("MCT_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "b"))
    assert cache_file() == tmp_path / "a" / "machine.json"
    monkeypatch.delenv("MCT_CACHE_DIR")
    assert cache_file() == tmp_path / "b" / "mct" / "machine.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_file() == tmp_path / "home" / ".cache" / "mct" / "machine.json"


def test_peak_is_per_core_rate_times_threads_times_ranks():
    kw = dict(name="x", flags=(), torch_version="t", threads=8, matmul_one={"fp32": 1e9, "bf16": 3e9},
              matmul_all={"fp32": 6e9}, matmul_size={"fp32": 1024}, memcpy_bytes_per_s=1e9)
    cpu, gpu = MachineProfile(device="cpu", **kw), MachineProfile(device="cuda", **kw)
    assert cpu.peak_flops("bf16", threads_per_rank=2, ranks=3) == 18e9
    assert gpu.peak_flops("bf16", threads_per_rank=2, ranks=3) == 9e9  # a device is not per thread
    assert cpu.peak_flops("fp16", 1, 1) is None


def test_calibrate_command_prints_the_table_then_json(tmp_path, monkeypatch, capsys, stub):
    monkeypatch.setenv("MCT_CACHE_DIR", str(tmp_path))
    assert main(["calibrate"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("machine  ") and "measured now in 2.5 s" in out[1]
    assert out[2].split() == ["dtype", "matmul", "1", "thread", "matmul", str(usable_cores()), "threads", "size"]
    assert out[3].split() == ["fp32", "40", "GFLOP/s", "70", "GFLOP/s", "2048"]
    assert out[4].split() == ["bf16", "80", "GFLOP/s", "150", "GFLOP/s", "2048"]
    assert out[5] == "copy (1 thread): 6.00 GB/s"
    assert main(["calibrate", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["source"] == "cache" and got["key"] == current_key("cpu") and got["path"] == str(tmp_path / "machine.json")
    assert got["profile"] == {**stub[0].to_dict(), "load": {"other_cores": 0.0, "cores": 2, "loadavg": 1.0,
                                                           "seconds": 5.0, "passes": 1}} and len(stub) == 1
    assert main(["calibrate", "--force", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["source"] == "measured" and len(stub) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA device")
def test_calibrate_cuda_without_a_device_is_one_line_exit_2(capsys):
    assert main(["calibrate", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mct: error: device 'cuda'") and "--device cpu" in err and "\n" not in err


@MEASURES
def test_an_older_profile_is_measured_again_with_the_new_rates(tmp_path, quick):
    """Version 3 added the random-number rate (and the per-op overhead and wait at a world
    size), version 4 the elementwise curves of bf16 and fp16, version 5 the per-op overhead
    and wait from two models' steps with the per-byte cost, version 6 the elementwise
    curves by kind of op, version 7 the cost of an op through mct's Python dispatch mode
    (and the overheads from median steps at the rank's threads), version 8 the cost of an op
    through torch's selective-checkpoint modes and through the memory tracker: a cached entry of an older
    version, as the previous mct wrote it, is measured again whole, never half-used, and
    the new entry has the rates."""
    path = tmp_path / "machine.json"
    old = calibrate(path=path).profile.to_dict()
    assert old["extra"]["random_elements_per_s"] > 0  # bernoulli_ elements per second, one thread
    assert set(old["extra"]["elementwise_by_dtype"]) == set(old["matmul_one"]) - {"fp32"}
    kinds = old["extra"]["elementwise_by_kind"]
    assert set(kinds) == {"light", "softmax", "safe_softmax", "layer_norm"}
    assert all(set(by) == set(old["matmul_one"]) for by in kinds.values())
    assert 0 < old["extra"]["python_mode_op_s"] < 1e-3  # an op through mct's Python dispatch mode
    assert 0 < old["extra"]["selective_mode_op_s"] < 1e-3  # an op through selective checkpointing's modes
    assert 0 < old["extra"]["tracker_op_s"] < 1e-3  # an op through the memory tracker
    old["version"] = 3
    del old["extra"]["random_elements_per_s"], old["extra"]["elementwise_by_dtype"], old["extra"]["elementwise_by_kind"]
    del old["extra"]["python_mode_op_s"], old["extra"]["selective_mode_op_s"], old["extra"]["tracker_op_s"]
    path.write_text(json.dumps({"version": 1, "profiles": {current_key("cpu"): old}}))
    cal = calibrate(path=path)
    assert cal.source == "measured" and cal.profile.version == profile_mod.PROFILE_VERSION == 10
    assert cal.profile.extra["random_elements_per_s"] > 0 and cal.profile.extra["elementwise_by_dtype"]
    assert cal.profile.extra["elementwise_by_kind"] and cal.profile.extra["python_mode_op_s"] > 0
    assert cal.profile.extra["selective_mode_op_s"] > 0 and cal.profile.extra["tracker_op_s"] > 0
