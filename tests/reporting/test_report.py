"""Metrics survive non-finite values; ``mct report`` reads damaged files line by line
and draws a run; ``mct plan --plot`` draws a plan."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mct.cli import main
from mct.reporting.metrics import MetricsWriter, decode_row, encode_row, read_jsonl
from mct.reporting.plots import _markers, plot_plan
from mct.reporting.report import TrainSummary, load_run, summary_table

PNG = b"\x89PNG\r\n\x1a\n"


def test_nonfinite_values_become_null_with_their_keys_listed():
    rec = {"step": 3, "loss": math.nan, "grad_norm": math.inf, "lr": 0.1,
           "memory": {"forward": {"total": -math.inf, "params": 4}}}
    row = encode_row(rec)
    text = json.dumps(row, allow_nan=False)  # strict JSON: no NaN/Infinity tokens
    assert row["loss"] is None and row["grad_norm"] is None and row["lr"] == 0.1
    assert row["nonfinite"] == ["loss", "grad_norm", "memory.forward.total"]
    assert math.isnan(rec["loss"]) and "nonfinite" not in rec  # input untouched
    back = decode_row(json.loads(text))
    assert math.isnan(back["loss"]) and math.isnan(back["grad_norm"])
    assert math.isnan(back["memory"]["forward"]["total"]) and back["memory"]["forward"]["params"] == 4


def test_legacy_string_nan_is_read_as_a_float():
    back = decode_row({"step": 1, "loss": "nan", "grad_norm": "inf"})
    assert math.isnan(back["loss"]) and back["grad_norm"] == math.inf


def test_writer_and_reader_round_trip_a_diverged_step(tmp_path):
    w = MetricsWriter(tmp_path)
    w.log({"step": 0, "loss": 5.0})
    w.log({"step": 1, "loss": float("nan"), "grad_norm": float("inf")})
    w.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[1]) == {"step": 1, "loss": None, "grad_norm": None, "nonfinite": ["loss", "grad_norm"]}
    rows, skipped = read_jsonl(tmp_path / "metrics.jsonl")
    assert skipped == [] and rows[0]["loss"] == 5.0 and math.isnan(rows[1]["loss"])


def _damaged_run(d: Path) -> Path:
    d.mkdir()
    good = [{"step": s, "loss": 5.0 - 0.1 * s, "tokens_per_s": 1000.0 + s, "peak_bytes": 2**20,
             "rollbacks": int(s >= 4), "skipped": s == 2,
             "memory": {"forward": {"params": 2**20, "activations": 2**21, "total": 3 * 2**20},
                        "backward": {"params": 2**20, "grads": 2**20, "total": 2**21}},
             "time_forward_s": 0.1, "time_backward_s": 0.2, "time_step_s": 0.05, "time_data_s": 0.01,
             "time_comm_s": 0.0} for s in range(6)]
    good[3]["val_loss"] = 4.5
    lines = [json.dumps(encode_row(r)) for r in good]
    lines.insert(3, '{"step": 99, "loss": 4.')  # truncated by a crash
    lines.append(json.dumps({"step": 6, "loss": "nan", "tokens_per_s": "inf"}))  # the old writer's form
    lines.append(json.dumps(encode_row({"step": 7, "loss": math.nan, "tokens_per_s": 10.0})))
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n[1, 2]\n")
    (d / "events.jsonl").write_text(json.dumps({"time": "t", "step": 4, "kind": "rollback",
                                                "action": "restore step_00000002", "reason": "nan"}) + "\n{bad\n")
    (d / "metadata.json").write_text(json.dumps({"config": {"memory": {"budget": "8MiB"}},
                                                 "resumes": [{"time": "t", "from_step": 5, "world_size": 1,
                                                              "zero_stage": 0}]}))
    return d


def test_report_skips_damaged_lines_names_them_and_reports_the_rest(tmp_path, capsys):
    run = _damaged_run(tmp_path / "run")
    assert main(["report", str(run)]) == 0
    out, err = capsys.readouterr()
    warnings = err.strip().splitlines()
    assert all(w.startswith("mct: warning: ") for w in warnings)
    assert any(f"{run / 'metrics.jsonl'}:4: skipped, not JSON" in w for w in warnings)
    assert any(f"{run / 'metrics.jsonl'}:10: skipped, a JSON list" in w for w in warnings)
    assert any(f"{run / 'events.jsonl'}:2: skipped" in w for w in warnings)
    table = out.splitlines()
    assert len([line for line in table if line.split() and line.split()[0].isdigit()]) == 8
    assert any(line.split()[:2] == ["6", "nan"] for line in table)
    assert "skipped steps: 1; rollbacks: 1; resumes: 1; events: 1" in out
    assert "non-finite values at logged steps: 6, 7" in out


def test_report_plot_writes_a_png_with_every_marker(tmp_path, capsys):
    run = _damaged_run(tmp_path / "run")
    data = load_run(run)
    marks = _markers(data.rows, data.events, data.meta)
    assert marks == {"skipped": [2], "rollbacks": [4], "resumes": [5], "nonfinite": [6, 7]}
    assert data.budget == 8 * 2**20
    out = tmp_path / "run.png"
    assert main(["report", str(run), "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG and out.stat().st_size > 20_000
    assert not list(tmp_path.glob(".*.tmp*"))


@pytest.mark.slow
def test_plan_plot_draws_every_configuration(tmp_path, capsys):
    out = tmp_path / "plan.png"
    rc = main(["plan", "--set", "model.n_layer=1", "--set", "model.d_model=32", "--set", "model.n_head=2",
               "--set", "model.seq_len=16", "--set", "data.micro_batch_size=2", "--budget", "1GiB",
               "--plot", str(out)])
    assert rc == 0
    assert out.read_bytes()[:8] == PNG


def test_plot_plan_from_plain_rows(tmp_path):
    rows = [{"stage": s, "policy": "none", "precision": "fp32", "peak": (4 - s) * 2**20, "fits": s >= 2,
             "breakdown": {"params": 2**19, "activations": (4 - s) * 2**20 - 2**19}} for s in range(4)]
    plan = {"rows": rows, "budget": int(2.5 * 2**20), "world": 2, "n_params": 1000,
            "recommended": rows[2]}
    assert plot_plan(plan, tmp_path / "p.png").read_bytes()[:8] == PNG
    with pytest.raises(ValueError, match="no configuration"):
        plot_plan({"rows": []}, tmp_path / "q.png")


def test_summary_prints_mfu_lines_and_dashes_where_nothing_was_counted():
    base = {"hardware_flops_per_step": 3.0e9, "step_time_s": 0.5, "peak_flops_per_s": 2e10,
            "peak_note": "fp32 matmul peak 10 GFLOP/s per core x 1 thread(s) x 2 rank(s)", "machine": "CPU X (avx2), 2 cores"}
    counted = {**base, "model_flops_per_step": 2.0e9, "achieved_flops_per_s": 4.0e9, "mfu": 0.2,
               "flops_method": "counted with torch FlopCounterMode on fake tensors, no recompute"}
    text = summary_table(TrainSummary(steps=2, final_loss=1.0, final_val_loss=None, first_val_loss=None,
                                      tokens_per_s=10.0, skipped_steps=0, utilization=counted)).splitlines()
    assert ("model FLOPs   2 GFLOP per step (counted with torch FlopCounterMode on fake tensors, no recompute); "
            "3 GFLOP with recompute") in text
    assert "achieved      4 GFLOP/s (model FLOPs / median step time 0.5 s)" in text
    assert f"MFU           20% of 20 GFLOP/s ({base['peak_note']})" in text
    assert "machine       CPU X (avx2), 2 cores" in text
    none = {**base, "model_flops_per_step": None, "achieved_flops_per_s": None, "mfu": None,
            "hardware_flops_per_step": None, "flops_method": "not counted (why)"}
    text = summary_table(TrainSummary(steps=2, final_loss=1.0, final_val_loss=None, first_val_loss=None,
                                      tokens_per_s=10.0, skipped_steps=0, utilization=none)).splitlines()
    assert "model FLOPs   - (not counted (why))" in text and f"MFU           - ({base['peak_note']})" in text


@pytest.mark.parametrize("faults,mode,hint,env", [
    (30_000, "default", True, {}), (30_000, "cache", False, {}), (500, "default", False, {}),
    (None, "default", None, {}), (30_000, "default", False, {"MALLOC_MMAP_THRESHOLD_": "1073741824"}),
    (30_000, "default", False, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=4294967295"})])
def test_summary_prints_page_faults_and_names_the_cache_only_where_it_would_help(faults, mode, hint, env,
                                                                                monkeypatch):
    """The hint names the cache mode only under glibc's defaults: not when the run already
    caches, nor when the user tuned malloc in the environment."""
    for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    text = summary_table(TrainSummary(steps=2, final_loss=1.0, final_val_loss=None, first_val_loss=None,
                                      tokens_per_s=10.0, skipped_steps=0, page_faults=faults, host_malloc=mode))
    lines = [x for x in text.splitlines() if x.startswith("page faults")]
    if hint is None:
        assert lines == []
        return
    [line] = lines
    assert line.startswith(f"page faults   {faults:,} per step (median, this process; host_malloc {mode})")
    assert ('memory.host_malloc = "cache"' in line) is hint


def test_summary_and_report_print_each_process_resident_peak_beside_the_tensor_peak(tmp_path, capsys):
    job = {"workers": [300 * 2**20, 290 * 2**20], "launcher": 22 * 2**20, "agent": None,
           "total": 612 * 2**20}
    text = summary_table(TrainSummary(steps=2, final_loss=1.0, final_val_loss=None, first_val_loss=None,
                                      tokens_per_s=10.0, skipped_steps=0, peaks={"forward": {"total": 2048},
                                                                                 "backward": {"total": 4096}},
                                      resident=job)).splitlines()
    expected = ["tensor peak   4.00 KiB (tensor bytes: tracked tensors, rank 0)",
                "resident      rank 0 300.00 MiB, rank 1 290.00 MiB, launcher 22.00 MiB (resident (VmHWM): each "
                "process's peak resident set)",
                "job resident  612.00 MiB (resident (VmHWM): workers + launcher + agent on rank 0's machine)"]
    assert [x for x in text if x.startswith(("tensor peak", "resident ", "job resident"))] == expected
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0, "peak_bytes": p}) + "\n"
                                               for s, p in ((0, 1024), (1, 4096))))
    (run / "metadata.json").write_text(json.dumps({"config": {}, "resident": job}))
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [x for x in out if x.startswith(("tensor peak", "resident ", "job resident"))] == expected


def test_summary_names_what_auto_resolved_to_second_and_nothing_without_auto():
    from mct.reporting.report import solver_pick
    choice = {"zero.stage": 2, "checkpointing.policy": "selective", "checkpointing.offload": "none",
              "train.loss_chunk_tokens": 0, "offload": "optimizer=cpu", "data.micro_batch_size": 4,
              "data.grad_accum": 1, "predicted_peak_bytes": 10, "solver": {"why": "fastest"}}
    pick = solver_pick(choice)
    assert pick == ("zero.stage=2 checkpointing.policy=selective offload=optimizer=cpu data.micro_batch_size=4 "
                    "data.grad_accum=1")
    base = dict(steps=2, final_loss=1.0, final_val_loss=None, first_val_loss=None, tokens_per_s=10.0,
                skipped_steps=0, run_dir="r", recipe="fine-tune")
    text = summary_table(TrainSummary(**base, auto=pick)).splitlines()
    assert text[2] == f"auto          {pick} (solved for memory.budget at the start; mct report RUN_DIR says why)"
    assert solver_pick(None) == "" and not any(x.startswith("auto") for x in summary_table(TrainSummary(**base))
                                               .splitlines())


def test_a_single_process_run_has_no_job_total_line_and_an_unreadable_record_prints_none():
    from mct.reporting.report import memory_lines
    assert memory_lines(None, {"workers": [5 * 2**20], "launcher": None, "agent": None, "total": 5 * 2**20}) == [
        "resident      rank 0 5.00 MiB (resident (VmHWM): each process's peak resident set)"]
    assert memory_lines(None, {"workers": "x", "total": "y"}) == [] and memory_lines(None, None) == []
