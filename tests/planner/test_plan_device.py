"""``mct plan --device cpu|cuda``: a plan for the device a run will compute on, from any machine."""

from __future__ import annotations

import json

import pytest

from mct.cli import main
from mct.config import EngineConfig
from mct.memory.process_peak import CUDA_CONTEXT, CUDA_RETAINED, CUDA_SEGMENT, transient_bytes
from mct.planner.grid import Grid
from mct.machine import default_device
from mct.planner.plan import for_device, make_plan, predict, target_device, with_choice
from mct.task import task_for

TINY = ["--set", "model.n_layer=2", "--set", "model.d_model=32", "--set", "model.n_head=2",
        "--set", "model.seq_len=16", "--set", "model.vocab_size=96", "--set", "data.micro_batch_size=2"]


def _cfg(n_layer: int = 2, seq_len: int = 16) -> EngineConfig:
    return EngineConfig.from_dict({"model": {"n_layer": n_layer, "d_model": 32, "n_head": 2, "seq_len": seq_len,
                                             "vocab_size": 96}, "data": {"micro_batch_size": 2}})


def test_a_cuda_plan_counts_the_context_and_the_caching_allocator_and_times_nothing_on_a_cpu(capsys):
    assert main(["plan", "--json", "--device", "cuda", "--stages", "0,3", "--policies", "all",
                 "--precisions", "bf16", *TINY]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["device"] == "cuda"
    for r in plan["rows"]:
        assert r["runtime_baseline"] == CUDA_CONTEXT and "CUDA context" in r["process_counts"]
        assert "not measured here" in r["process_counts"]
        assert r["process_peak"] == CUDA_CONTEXT + r["peak"] + r["allocator_overhead"]
        assert CUDA_SEGMENT <= r["allocator_overhead"] < CUDA_SEGMENT + r["peak"]
        if default_device() == "cpu":  # this machine's profile times its CPU only
            assert r["step_s"] is None and r["tokens_per_s"] is None
    if default_device() == "cpu":
        assert any("none for cuda" in n for n in plan["time_notes"])
    assert main(["plan", "--json", "--device", "cpu", "--stages", "0", "--policies", "all",
                 "--precisions", "bf16", *TINY]) == 0
    cpu = json.loads(capsys.readouterr().out)
    assert cpu["device"] == "cpu" and "resident" in cpu["rows"][0]["process_counts"]
    if default_device() == "cpu":
        assert cpu["rows"][0]["step_s"] > 0  # the machine's own device: timed as before


def test_the_cuda_process_peak_is_the_models_arithmetic_on_the_dry_runs_transients():
    cfg = _cfg()
    plan = make_plan(task_for(cfg), cfg, 1, None, Grid(stages=(3,), policies=("none",), precisions=("bf16",)),
                     advise=False, device="cuda", measure=False)
    (r,) = plan.rows
    run = predict(task_for(cfg), for_device(with_choice(cfg, 3, "none", "bf16"), "cuda"), 1)
    assert r.peak == run.peak and transient_bytes(run.phases) > 0
    assert r.allocator_overhead == CUDA_SEGMENT + round(CUDA_RETAINED * transient_bytes(run.phases))
    assert r.process_peak == CUDA_CONTEXT + r.peak + r.allocator_overhead


def test_activation_offload_to_host_memory_is_a_tier_of_a_cuda_plan_and_not_counted_in_its_peak():
    cfg = _cfg(n_layer=6, seq_len=64)  # more regions than the two offload keeps resident
    grid = Grid(stages=(0,), policies=("all",), precisions=("bf16",), act_offloads=("none", "cpu", "disk"))
    none, host, disk = make_plan(task_for(cfg), cfg, 1, None, grid, advise=False, device="cuda", measure=False).rows
    assert (none.act_offload, host.act_offload, disk.act_offload) == ("none", "cpu", "disk")
    assert host.peak < none.peak and host.breakdown["activations"] < none.breakdown["activations"]
    # nothing moves in a dry run: pinned host memory parks what the disk tier parks, off the device
    assert host.peak == disk.peak and host.breakdown == disk.breakdown
    run = predict(task_for(cfg), for_device(with_choice(cfg, 0, "all", "bf16", act_offload="cpu"), "cuda"), 1)
    assert set(run.work.offload) == {"cpu"} and run.work.offload["cpu"] > 0  # the traffic, to host memory


def test_a_cpu_plan_refuses_activation_offload_to_host_memory_in_one_line(capsys):
    assert main(["plan", "--device", "cpu", "--act-offloads", "cpu", "--stages", "0", "--policies", "all",
                 "--precisions", "bf16", *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "checkpointing.offload = 'cpu'" in err and "'disk'" in err


def test_a_device_that_is_not_cpu_or_cuda_is_refused_in_one_line(capsys):
    assert main(["plan", "--device", "tpu", *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("mct: error: --device 'tpu': choose cpu or cuda (the device the run will compute on; "
                   "default: this machine's own)")


def test_the_default_device_is_the_one_a_run_would_take_here():
    cfg = _cfg()
    assert target_device(cfg) == default_device()
    nccl = EngineConfig.from_dict({"distributed": {"backend": "nccl"}})
    assert target_device(nccl) == "cuda" and target_device(nccl, "cpu") == "cpu"
    with pytest.raises(ValueError, match="--device 'gpu'"):
        target_device(cfg, "gpu")
    dry = for_device(cfg, "cuda")  # the dry run of a CUDA run: NCCL ranks, native matmuls
    assert dry.distributed.backend == "nccl" and dry.precision.cpu_matmul == "native"
    assert for_device(nccl, "cpu").distributed.backend == "gloo"
