"""MFU in a run: every metrics row carries the model FLOPs, achieved FLOP/s and MFU of
its step, the end-of-run summary prints them beside the CPU, metadata.json records how."""

from __future__ import annotations

import json

import pytest
import torch

from mct.config import EngineConfig
from mct.machine import cpu_identity, format_rate
from mct.planner.flops import step_flops
from mct.reporting.report import summary_table
from mct.run.trainer import train
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
