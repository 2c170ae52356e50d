"""``mct.memory.process_peak`` and the plan rows that carry it: the process peak is the runtime
baseline + the tensor peak + the allocator's overhead, beside (never instead of) the tensor peak."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mct
from mct.config import CLI_RECIPE, load_config
from mct.memory.baseline import measure_baseline
from mct.memory.process_peak import CACHE_SAVE, CUDA_CONTEXT, RETAINED, SAVE_HELD, STEP_FIXED, ProcessModel, state_bytes
from mct.models.gpt import GPT
from tests.conftest import SEEDED_BASELINE
from mct.planner import make_plan
from mct.planner.plan import predict
from mct.planner.grid import Grid
from mct.task import task_for
from mct.task.spec import Task
from tests.helpers import batches, gpt_loss, tiny_config

MiB = 2**20
BREAKDOWN = {"params": 3 * MiB, "grads": 3 * MiB, "optimizer": 6 * MiB, "activations": 60 * MiB, "other": 4 * MiB}
PHASES = {"forward": {**BREAKDOWN, "other": 0}, "backward": BREAKDOWN, "optimizer": {"params": 3 * MiB, "other": MiB}}
OLD_KEYS = {"stage", "policy", "per_block", "precision", "offload", "act_offload", "loss_chunk_tokens",
            "mlp_tile_tokens", "world", "peak", "phase", "breakdown", "phases", "first_step_peak", "init_peak",
            "offloaded", "fits", "cost", "step_s", "time", "tokens_per_s"}


def test_cpu_overhead_counts_the_step_transients_retained_under_each_malloc_mode():
    peak = sum(BREAKDOWN.values())
    for mode in ("default", "lean", "frugal", "cache"):
        p = ProcessModel(300 * MiB, "cpu", mode).predict(peak, PHASES, offload=False)
        r = RETAINED[mode]
        # 'cache' never trims: its save comes on top of the step's peak
        added = CACHE_SAVE if mode == "cache" else 0
        assert p.at == ("save" if mode == "cache" else "step")
        assert p.allocator_overhead == STEP_FIXED + round(r.live * 64 * MiB) + added  # backward's activations + other
        assert p.total == 300 * MiB + peak + p.allocator_overhead and f"host_malloc {mode}" in p.counts
        # a forward that made 100 MiB of them, 36 more than live at the peak: a share of those stays too
        churned = ProcessModel(300 * MiB, "cpu", mode).predict(peak, PHASES, offload=False, churn={"forward": 100 * MiB})
        assert churned.allocator_overhead == STEP_FIXED + round(r.live * 64 * MiB + r.freed * 36 * MiB) + added
        assert 0 <= r.live <= r.freed <= 1
    assert RETAINED["frugal"] < RETAINED["lean"] < RETAINED["default"]  # the trims and mappings keep less
    auto = ProcessModel(300 * MiB, "cpu", "auto")  # 'auto' is lean where offload is on, on the CPU
    assert "host_malloc lean" in auto.predict(peak, PHASES, offload=True).counts
    assert "host_malloc default" in auto.predict(peak, PHASES, offload=False).counts


def test_a_recomputing_row_counts_no_torch_dynamo_in_its_steps(tmp_path, monkeypatch):
    """Recomputing runs on mct's own checkpoint frame, which never imports torch._dynamo: a
    row that recomputes has the baseline and the fixed overhead of one that does not (it
    counted dynamo's 71 MiB and a larger held term while torch's frame imported it)."""
    from mct.memory import baseline as bl
    monkeypatch.setattr(bl, "baseline_file", lambda: tmp_path / "baseline.json")
    (tmp_path / "baseline.json").write_text(json.dumps({bl.baseline_key(()): 250 * MiB,
                                                        bl.baseline_key((), False): 250 * MiB,
                                                        bl.baseline_key(("torch._dynamo",)): 321 * MiB}))
    cfg = tiny_config(data={"micro_batch_size": 2})
    plan = mct.plan(lambda: GPT(cfg.model), gpt_loss, batches(0, 0, 1, B=2)[0], cfg, world_size=1,
                    stages=(0,), policies=("none", "all"), precisions=("fp32",))
    rows = {r.policy: r for r in plan.rows}
    assert rows["all"].runtime_baseline == rows["none"].runtime_baseline == 250 * MiB
    assert rows["all"].process_peak - rows["none"].process_peak == (
        rows["all"].peak - rows["none"].peak if rows["all"].process_at == "step" else 0)


def test_a_sharded_save_counts_torch_dynamo_at_the_save_not_in_the_steps():
    """Saving sharded state (a DTensor) imports torch._dynamo at the save, after the steps: the
    save's peak counts it, the steps' does not."""
    model = ProcessModel(250 * MiB, "cpu", "lean", dynamo=70 * MiB)
    plain = model.predict(100 * MiB, PHASES, offload=False)
    saved = model.predict(100 * MiB, PHASES, offload=False, sharded_save=True)
    # a large step: it is the peak, without torch._dynamo
    assert plain == saved and plain.at == "step" and plain.baseline == 250 * MiB
    assert plain.allocator_overhead == STEP_FIXED + round(RETAINED["lean"].live * 64 * MiB)
    # a small step: the save is the peak, and it counts torch._dynamo where it is sharded
    small = {"forward": {"params": MiB, "activations": MiB}}
    plain, saved = (model.predict(2 * MiB, small, offload=False, sharded_save=s) for s in (False, True))
    assert plain.at == saved.at == "save" and saved.total - plain.total == 70 * MiB
    assert saved.total == 320 * MiB + MiB + SAVE_HELD  # baseline + dynamo + the state it saves + held


def test_a_run_saving_only_after_its_last_step_steps_without_the_checkpoint_writer():
    """The writer's import (sympy, torch.distributed.checkpoint) is in the baseline; a process
    loads it at its first save, so the steps of a run that saves only at its end run without it,
    and the save itself holds the state, not the step's transients."""
    model = ProcessModel(300 * MiB, "cpu", "default", writer=45 * MiB)
    step = model.predict(100 * MiB, PHASES, offload=False)
    assert step.at == "step" and step.baseline == 255 * MiB
    assert step.total == 255 * MiB + 100 * MiB + STEP_FIXED + round(RETAINED["default"].live * 64 * MiB)
    assert state_bytes(PHASES) == 12 * MiB  # params + grads + optimizer at backward's peak
    small = ProcessModel(300 * MiB, "cpu", "default", writer=45 * MiB).predict(12 * MiB, PHASES | {
        "backward": {**BREAKDOWN, "activations": 0, "other": 0}, "forward": {}}, offload=False)
    assert small.at == "save" and small.total == 300 * MiB + 12 * MiB + SAVE_HELD and "checkpoint save" in small.counts


def test_a_model_library_that_loads_dynamo_at_import_adds_nothing_at_a_sharded_save():
    """transformers loads torch._dynamo at import: its dynamo term is 0, so a sharded save
    counts nothing more."""
    hf = ProcessModel(400 * MiB, "cpu", "default", dynamo=0)
    assert hf.predict(10 * MiB, PHASES, offload=False, sharded_save=True) == hf.predict(10 * MiB, PHASES, offload=False)


def test_plan_rows_of_sharded_state_on_several_ranks_count_the_dynamo_term(tmp_path, monkeypatch):
    """Stage 1 and up on two ranks saves DTensors (torch._dynamo at the save); stage 0 does not."""
    from mct.memory import baseline as bl
    monkeypatch.setattr(bl, "baseline_file", lambda: tmp_path / "baseline.json")
    (tmp_path / "baseline.json").write_text(json.dumps({bl.baseline_key(()): 250 * MiB,
                                                        bl.baseline_key((), False): 250 * MiB,
                                                        bl.baseline_key(("torch._dynamo",)): 321 * MiB}))
    cfg = tiny_config(data={"micro_batch_size": 2})
    for world, base in ((1, {0: 250, 1: 250}), (2, {0: 250, 1: 321})):
        plan = mct.plan(lambda: GPT(cfg.model), gpt_loss, batches(0, 0, 1, B=2)[0], cfg, world_size=world,
                        stages=(0, 1), policies=("none",), precisions=("fp32",))
        assert {r.stage: r.runtime_baseline // MiB for r in plan.rows} == base, world
        assert all(r.process_at == "save" and r.allocator_overhead == SAVE_HELD for r in plan.rows)  # a tiny model
    run, counted = predict(task_for(cfg), cfg, 2), dataclasses.replace(plan, budget_counts="process")
    assert counted.figure(run, False, sharded_save=True) - counted.figure(run, False) == 71 * MiB


def test_the_dynamo_and_writer_terms_are_baselines_with_and_without_the_import(tmp_path, monkeypatch):
    from mct.memory import baseline as bl
    from mct.planner import resident
    monkeypatch.setattr(bl, "baseline_file", lambda: tmp_path / "baseline.json")
    (tmp_path / "baseline.json").write_text(json.dumps({bl.baseline_key(()): 250 * MiB,
                                                        bl.baseline_key((), False): 205 * MiB,
                                                        bl.baseline_key(("torch._dynamo",)): 321 * MiB}))
    cfg = tiny_config()
    model, _ = resident.process_model(task_for(cfg), cfg, "cpu", measure=False)
    assert model.baseline == 250 * MiB and model.dynamo == 71 * MiB and model.writer == 45 * MiB
    saving = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=10, checkpoint_every=5))
    model, _ = resident.process_model(task_for(saving), saving, "cpu", measure=False)
    assert model.writer == 0  # a save before the last step: the later steps hold the writer
    (tmp_path / "baseline.json").write_text(json.dumps({bl.baseline_key(()): 250 * MiB}))
    model, _ = resident.process_model(task_for(cfg), cfg, "cpu", measure=False)
    assert model.dynamo == model.writer == 0  # not cached, may not measure: no term


def test_cuda_process_peak_is_the_context_plus_reserved_and_says_it_is_unmeasured():
    p = ProcessModel(300 * MiB, "cuda", "default").predict(100 * MiB, PHASES, offload=False)
    assert p.baseline == CUDA_CONTEXT and p.total > CUDA_CONTEXT + 100 * MiB and "not measured" in p.counts


def test_every_plan_row_carries_the_process_peak_as_baseline_plus_peak_plus_overhead():
    cfg = tiny_config(data={"micro_batch_size": 2})
    plan = mct.plan(lambda: GPT(cfg.model), gpt_loss, batches(0, 0, 1, B=2)[0], cfg, world_size=2,
                    stages=(0, 3), policies=("none", "all"), precisions=("fp32",))
    for row in plan.rows:
        assert row.runtime_baseline == SEEDED_BASELINE  # the test cache's: nothing measured
        held = row.rollback_snapshots
        assert held == 0 if row.stage == 3 else held > 0  # stage 3 keeps its snapshots on disk
        if row.process_at == "step":
            assert row.process_peak == row.runtime_baseline + row.peak + row.allocator_overhead + held
        else:  # at the save: the state it reads, not the step's transients
            assert row.process_peak <= row.runtime_baseline + row.peak + row.allocator_overhead + held
        assert row.allocator_overhead >= STEP_FIXED and "VmHWM" in row.process_counts
    data = json.loads(json.dumps(plan.to_dict()))["rows"]
    assert all(OLD_KEYS <= set(r) and r["peak"] == sum(r["breakdown"].values()) for r in data)  # peak: tensor bytes
    assert all(r["process_peak"] > r["peak"] for r in data)


def test_a_budget_counting_the_process_fits_the_process_peak_and_one_counting_tensors_the_peak():
    """The same budget, between the rows' tensor peaks and far below any process peak: counted as
    the process nothing fits (the advice names the process peak); counted as tensor bytes some rows do."""
    x = batches(0, 0, 1, B=2)[0]
    grid = dict(world_size=2, stages=(0, 3), policies=("none", "all"), precisions=("fp32",))
    cfg = tiny_config(data={"micro_batch_size": 2})
    rows = mct.plan(lambda: GPT(cfg.model), gpt_loss, x, cfg, **grid).rows
    budget = sorted(r.peak for r in rows)[1]
    process = mct.plan(lambda: GPT(cfg.model), gpt_loss, x, cfg, budget=budget, **grid)
    assert process.budget_counts == "process" and process.to_dict()["budget_counts"] == "process"
    assert all(r.budget_counts == "process" and r.fits == (r.process_peak <= budget) for r in process.rows)
    assert process.recommended is None and "(process peak: the resident set)" in process.advice
    tensors_cfg = tiny_config(data={"micro_batch_size": 2}, memory={"budget_counts": "tensors"})
    tensors = mct.plan(lambda: GPT(cfg.model), gpt_loss, x, tensors_cfg, budget=budget, **grid)
    assert [r.fits for r in tensors.rows] == [r.peak <= budget for r in rows] and tensors.recommended is not None
    roomy = mct.plan(lambda: GPT(cfg.model), gpt_loss, x, cfg, budget=max(r.process_peak for r in rows), **grid)
    assert all(r.fits for r in roomy.rows) and "predicted process peak" in roomy.advice


def test_the_solver_needs_the_process_terms_where_the_budget_counts_the_process():
    from mct.planner import resolve_auto
    from mct.planner.choice import need_of
    from mct.task import gpt_task
    cfg = tiny_config(data={"micro_batch_size": 2}, zero={"stage": "auto"}, memory={"budget": "400MiB"})
    resolved, choice = resolve_auto(cfg, 1, gpt_task(cfg))
    assert choice["budget_counts"] == "process" and choice["predicted_process_peak_bytes"] <= 400 * MiB
    assert choice["predicted_process_peak_bytes"] > SEEDED_BASELINE + choice["predicted_peak_bytes"]
    row = {"peak": 10, "first_step_peak": 30, "init_peak": 20, "runtime_baseline": 100, "allocator_overhead": 5}
    assert need_of(row) == 30 and need_of({**row, "budget_counts": "process"}) == 135
    with pytest.raises(ValueError, match="nothing fits 310.00 MiB .*process peak"):
        resolve_auto(tiny_config(data={"micro_batch_size": 2}, zero={"stage": "auto"}, memory={"budget": "310MiB"}),
                     1, gpt_task(cfg))


def test_a_plan_without_a_cached_baseline_that_may_not_measure_has_no_process_peak(tmp_path, monkeypatch):
    from mct.planner.resident import process_model
    monkeypatch.setenv("MCT_CACHE_DIR", str(tmp_path))
    cfg = tiny_config()
    task = Task(lambda: GPT(cfg.model), gpt_loss, None)
    model, why = process_model(task, cfg, "cpu", measure=False)
    assert model is None and "mct calibrate" in why


def test_a_hugging_face_directory_is_counted_with_its_modeling_module(tmp_path):
    from mct.planner.resident import library_modules
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert library_modules(Task(None, None, None, hf_dir=str(tmp_path))) == (
        "transformers.models.llama.modeling_llama",)
    assert library_modules(Task(None, None, None)) == ()


@pytest.mark.slow
@pytest.mark.cli
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_a_tiny_runs_measured_vmhwm_is_near_its_predicted_process_peak(tmp_path, corpus_dir):
    """`mct train` of a small GPT, 3 steps, in a fresh interpreter: its VmHWM (metadata.json
    `resident`) within 30% of the plan row's process peak with this machine's real baseline
    (benchmarks/process_peak.py measures the error per configuration: docs/memory.md)."""
    sets = [f"data.path={corpus_dir}", "model.n_layer=2", "model.d_model=96", "model.n_head=3", "model.seq_len=64",
            "data.micro_batch_size=2", "zero.stage=0", "checkpointing.policy=none", "precision.mode=fp32"]
    cmd = [sys.executable, "-m", "mct", "train", "--run-dir", str(tmp_path / "run"), "--no-progress",
           *(x for s in [*sets, "train.steps=3", "train.eval_every=0", "train.checkpoint_every=0"] for x in ("--set", s))]
    src = Path(__file__).resolve().parents[2] / "src"
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(src)))
    assert out.returncode == 0, out.stderr
    measured = json.loads((tmp_path / "run" / "metadata.json").read_text())["resident"]["workers"][0]
    cfg = load_config(None, sets, defaults=CLI_RECIPE)
    row = make_plan(task_for(cfg), cfg, 1, None, Grid(stages=(0,), policies=("none",), precisions=("fp32",)),
                    advise=False, measure=False).rows[0]
    real = ProcessModel(measure_baseline(), "cpu", cfg.memory.host_malloc)
    predicted = real.predict(row.peak, predict(task_for(cfg), cfg, 1).phases, offload=False).total
    assert 0.7 * measured <= predicted <= 1.3 * measured, (predicted / MiB, measured / MiB)


def test_a_save_in_bf16_holds_the_low_precision_kernels_cache_beside_the_state():
    """A process whose fp32 masters live apart from its parameters (bf16/fp16) holds more at a
    save than an fp32 one (oneDNN's cached primitives for the low-precision kernels, the heap
    its casts leave): MIXED_SAVE, at the save only."""
    from mct.memory.process_peak import MIXED_SAVE
    model = ProcessModel(300 * MiB, "cpu", "default")
    fp32 = {"backward": {"params": 4 * MiB, "optimizer": 8 * MiB, "activations": MiB}}
    bf16 = {"backward": {"params": 2 * MiB, "master": 4 * MiB, "optimizer": 8 * MiB, "activations": MiB}}
    a, b = model.predict(13 * MiB, fp32, offload=False), model.predict(15 * MiB, bf16, offload=False)
    assert a.at == b.at == "save" and a.allocator_overhead == SAVE_HELD
    assert b.allocator_overhead == SAVE_HELD + MIXED_SAVE and b.total - a.total == 2 * MiB + MIXED_SAVE
    cfg = tiny_config(data={"micro_batch_size": 2})
    plan = mct.plan(lambda: GPT(cfg.model), gpt_loss, batches(0, 0, 1, B=2)[0], cfg, world_size=1,
                    stages=(0,), policies=("none",), precisions=("fp32", "bf16"))
    held = {r.precision: r.allocator_overhead for r in plan.rows if r.process_at == "save"}
    assert held == {"fp32": SAVE_HELD, "bf16": SAVE_HELD + MIXED_SAVE}, held
