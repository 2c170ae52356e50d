"""``mct.memory.baseline``: the runtime baseline, measured in a fresh interpreter, cached by key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mct.memory import baseline
from mct.memory.baseline import baseline_key, measure_baseline, runtime_baseline

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")


def test_the_baseline_is_measured_once_per_key_then_read_from_the_cache(tmp_path, monkeypatch):
    calls: list[tuple[str, ...]] = []
    monkeypatch.setattr(baseline, "measure_baseline",
                        lambda modules=(), writer=True: calls.append(modules) or 300 + len(modules) - (not writer))
    path = tmp_path / "baseline.json"
    assert runtime_baseline(path=path) == (300, "measured")
    assert runtime_baseline(path=path) == (300, "cache")
    assert runtime_baseline(("json",), path=path) == (301, "measured")  # another library set: its own entry
    assert runtime_baseline(path=path, force=True) == (300, "measured")
    assert runtime_baseline(path=path, writer=False) == (299, "measured")  # without the writer: its own entry
    assert calls == [(), ("json",), (), ()]
    assert set(json.loads(path.read_text())) == {baseline_key(), baseline_key(("json",)), baseline_key((), False)}
    path.write_text("{not json")  # a damaged cache counts as absent
    assert runtime_baseline(path=path) == (300, "measured")


def test_the_key_names_python_torch_the_libraries_and_the_modules():
    key = baseline_key(("json.decoder",))
    assert key.startswith("python ") and "| torch " in key and "| json ?" in key
    assert key.endswith("modules json.decoder") and baseline_key().endswith("modules -")


@pytest.mark.slow
def test_a_real_baseline_holds_torch_and_more_and_a_missing_library_is_one_value_error():
    measured = measure_baseline()
    assert 150 * 2**20 < measured < 2 * 2**30
    with pytest.raises(ValueError, match="'no_such_library_xyz.models' cannot be imported"):
        measure_baseline(("no_such_library_xyz.models",))


def test_calibrate_warns_and_keeps_its_table_when_the_baseline_cannot_be_measured(tmp_path, monkeypatch, capsys):
    from mct.cli import main

    def fail(modules=(), writer=True):
        raise RuntimeError("the runtime baseline is read from /proc/self/status (Linux); none here")
    monkeypatch.setattr(baseline, "measure_baseline", fail)
    monkeypatch.setattr(baseline, "baseline_file", lambda: tmp_path / "baseline.json")
    assert main(["calibrate"]) == 0
    out, err = capsys.readouterr()
    assert "runtime baseline:" not in out and out.strip()
    assert err.strip() == ("mct: warning: runtime baseline not measured: the runtime baseline is read from "
                           "/proc/self/status (Linux); none here")
