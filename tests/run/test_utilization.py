"""MFU in a run: every metrics row carries the model FLOPs, achieved FLOP/s and MFU of
its step, the end-of-run summary prints them beside the CPU, metadata.json records how."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from mct.config import EngineConfig
from mct.machine import cpu_identity, format_rate
from mct.planner.flops import step_flops
from mct.planner.flops import StepFlops
from mct.reporting.report import load_run, report_table, summary_table, utilization_lines
from mct.run.components import StepLog
from mct.run.trainer import train
from mct.run.utilization import Utilization
from mct.task import task_for
from tests.helpers import SEEDED_RATES


def test_rows_and_summary_carry_model_flops_and_mfu(tmp_path, corpus_dir):
    cfg = EngineConfig.from_dict({"seed": 1, "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16},
                                  "data": {"path": str(corpus_dir), "micro_batch_size": 2, "grad_accum": 2},
                                  "checkpointing": {"policy": "all"},
                                  "train": {"steps": 3, "eval_every": 0, "log_every": 1}})
    summary = train(cfg, tmp_path / "run", progress=False)
    counted = step_flops(task_for(cfg), cfg, world_size=1)
    peak = SEEDED_RATES["fp32"] * torch.get_num_threads()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for r in rows:
        assert r["model_flops_per_step"] == counted.model > 0
        assert r["hardware_flops_per_step"] == counted.hardware > counted.model  # policy 'all' recomputes
        assert r["achieved_flops_per_s"] == pytest.approx(counted.model / r["step_time_s"])
        assert r["mfu"] == pytest.approx(r["achieved_flops_per_s"] / peak)
        assert r["predicted_step_s"] > 0 and r["predicted_step_s"] == rows[0]["predicted_step_s"]  # a dry run at start
    u = summary.utilization
    assert u["step_time_s"] == pytest.approx((rows[1]["step_time_s"] + rows[2]["step_time_s"]) / 2)  # first: warm-up
    text = summary_table(summary)
    mfu_line = next(line for line in text.splitlines() if line.startswith("MFU"))
    assert mfu_line == (f"MFU           {100 * u['mfu']:.3g}% of {format_rate(peak)} (fp32 matmul peak "
                        f"{format_rate(SEEDED_RATES['fp32'])} per core x {torch.get_num_threads()} thread(s) x 1 rank(s))")
    assert "model FLOPs" in text and "with recompute" in text and "FlopCounterMode" in text
    assert f"machine       {cpu_identity()['model']}" in text
    meta = json.loads((tmp_path / "run" / "metadata.json").read_text())["utilization"]
    assert meta["flops"]["method"] == "flop_counter" and meta["flops"]["model_flops_per_step"] == counted.model
    assert meta["machine_profile"]["matmul_one"]["fp32"] == SEEDED_RATES["fp32"]
    assert meta["predicted_step_s"] == rows[0]["predicted_step_s"] == u["predicted_step_s"]
    assert "predicted (measured / predicted" in text
    report = report_table(load_run(tmp_path / "run"))
    assert "s/step" in report.splitlines()[0] and "predicted" in report.splitlines()[0]
    ratio = rows[2]["step_time_s"] / rows[2]["predicted_step_s"]
    assert report.splitlines()[3].split()[-1] == f"{ratio:.2f}"
    assert "step time: measured median" in report


def test_step_faster_than_the_measured_peak_prints_no_mfu_but_one_warning(capsys):
    """A profile measured on a busy machine has a low peak: a step above it gets no MFU
    (never > 100%) and one warning naming `mct calibrate --force`, on the first such step only."""
    flops = StepFlops(model=10 ** 9, hardware=10 ** 9, micro_batches=1, method="flop_counter")
    util = Utilization(flops, peak_flops=1e9, peak_note="fp32 matmul peak", machine="m", profile={},
                       predicted_step_s=0.4)
    log = StepLog(EngineConfig.from_dict({}), 1, 0, None, util)
    out = SimpleNamespace(loss=1.0, grad_norm=1.0, skipped=False, loss_scale=1.0, metrics={"peak_bytes": 1})
    first, second = (log.record(i, out, 1e-3, 0.0, 0.5, 0) for i in range(2))  # 2e9 FLOP/s > 1e9
    assert first["mfu"] is None and second["mfu"] is None and first["predicted_step_s"] == 0.4
    assert "mct calibrate --force" in first["mfu_warning"] and "mfu_warning" not in second
    assert capsys.readouterr().err.count("mct calibrate --force") == 1
    assert log.record(2, out, 1e-3, 0.0, 4.0, 0)["mfu"] == pytest.approx(0.25)  # below the peak: MFU as before
    lines = utilization_lines(util.summary(0.5))
    assert any("mct calibrate --force" in line for line in lines if line.startswith("MFU"))
