"""Activation offload (`checkpointing.offload`): checkpoint regions' inputs wait for
backward on disk (CPU) or in pinned host memory (CUDA), training stays bit-identical, the
tracker and the planner see the bytes leave, files and threads go away, and failures are
one line."""

from __future__ import annotations

import errno
import gc
import os
import threading

import pytest
import torch

import mct
from mct.checkpointing import act_store
from mct.config import EngineConfig
from mct.dist import DistContext
from mct.engine import Engine
from mct.models.gpt import GPT, gpt_loss
from mct.planner.dry_run import dry_run
from mct.run.trainer import seeded_gpt_loss
from tests.distributed import run_distributed
from tests.helpers import adamw, batches, one_thread, tiny_config  # noqa: F401 (one_thread: autouse fixture)
from tests.checkpointing.test_checkpointing_engine import _micro_batches, sgd

STEPS = 20




def _cfg(policy: str, offload: str, root: str, n_layer: int = 4, **sections) -> EngineConfig:
    return tiny_config(model={"n_layer": n_layer, "dropout": 0.1}, offload={"dir": root},
                       checkpointing={"policy": policy, "offload": offload}, **sections)


def _train(rank: int, cfg: EngineConfig, steps: int, n_micro: int = 1) -> dict:
    torch.manual_seed(cfg.seed)
    engine = Engine(GPT(cfg.model), sgd, cfg)
    losses, metrics = [], []
    for step in range(steps):
        out = engine.train_step(_micro_batches(step, rank, n_micro), seeded_gpt_loss)
        losses.append(out.loss)
        metrics.append({k: v for k, v in out.metrics.items() if k.startswith(("act_", "peaks"))})
    state = {n: t.numpy() for n, t in engine.full_state_dict().items()}
    off = engine.recompute.offload
    folder = off.store.dir if off is not None and off.store is not None else None
    left = _files_under(folder) if folder else []
    engine.close()
    return {"losses": losses, "state": state, "metrics": metrics, "files_between_steps": left,
            "folder_after_close": folder is not None and os.path.exists(folder)}


def _files_under(root: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs) if os.path.isdir(root) else []


def _two_rank_runs(rank: int, world: int, root: str) -> dict:
    out = {}
    for stage in (0, 3):
        for policy in ("all", "sqrt"):
            for off in ("none", "disk"):
                cfg = _cfg(policy, off, root, zero={"stage": stage})
                out[(stage, policy, off)] = _train(rank, cfg, STEPS)
    return out


@pytest.mark.timeout(1500)
@pytest.mark.multirank
def test_disk_offload_trains_bit_identically_for_20_steps_stages_0_and_3_on_two_ranks(tmp_path):
    ranks = run_distributed(_two_rank_runs, 2, str(tmp_path), timeout=1200.0)
    for rank, runs in enumerate(ranks):
        for stage in (0, 3):
            for policy in ("all", "sqrt"):
                ref, got = runs[(stage, policy, "none")], runs[(stage, policy, "disk")]
                label = f"rank {rank} stage {stage} {policy}"
                assert got["losses"] == ref["losses"], label
                for name in ref["state"]:
                    assert (got["state"][name] == ref["state"][name]).all(), f"{label}: {name}"
                # the inputs really went to disk (4 blocks: 'all' parks 3 per micro-batch,
                # sqrt's 2 regions of 2 park 1), and nothing outlived the step or the run
                parked = [m["act_offload_count"] for m in got["metrics"]]
                assert parked == [3 if policy == "all" else 1] * STEPS, (label, parked)
                assert got["files_between_steps"] == [] and not got["folder_after_close"], label
    assert not os.listdir(tmp_path)  # both ranks' private folders removed


@pytest.mark.parametrize("policy", ["selective", "every_k"])
def test_every_other_policy_trains_bit_identically_with_disk_offload(tmp_path, policy):
    ref = _train(0, _cfg(policy, "none", str(tmp_path)), 3, n_micro=2)
    got = _train(0, _cfg(policy, "disk", str(tmp_path)), 3, n_micro=2)
    assert got["losses"] == ref["losses"]
    for name in ref["state"]:
        assert (got["state"][name] == ref["state"][name]).all(), name
    assert got["metrics"][-1]["act_offload_count"] == 2 * (3 if policy == "selective" else 1)


def test_32_blocks_backward_holds_two_region_inputs_plus_one_block_recompute(tmp_path):
    """'all' on a 32-block GPT: without offload the backward peak holds all 32 block
    inputs U plus R (one block's recompute and gradients, the head); with 'disk' it holds
    2U + R, and the 31 inputs parked at the end of forward were on disk, not in memory."""
    runs = {off: _train(0, _cfg("all", off, str(tmp_path), n_layer=32), 2) for off in ("none", "disk")}
    U = 2 * 16 * 32 * 4  # one fp32 [B, T, d_model] block input
    act = {off: run["metrics"][-1]["peaks"]["backward"]["activations"] for off, run in runs.items()}
    R = act["none"] - 32 * U
    assert R > 0, act
    assert act["disk"] <= 2 * U + R, (act, U)
    assert act["disk"] < 0.5 * act["none"], act  # the saving is real, not a rounding
    m = runs["disk"]["metrics"][-1]
    assert m["act_offload_peak_bytes"] == 31 * U and m["act_offload_count"] == 31
    fwd = {off: run["metrics"][-1]["peaks"]["forward"]["activations"] for off, run in runs.items()}
    assert fwd["disk"] < 0.5 * fwd["none"], fwd  # forward no longer accumulates the inputs either


@pytest.mark.parametrize("policy", ["all", "sqrt"])
def test_the_planner_predicts_the_offloaded_run_from_its_tracker(tmp_path, policy):
    cfg = tiny_config(model={"n_layer": 12}, offload={"dir": str(tmp_path)},
                      checkpointing={"policy": policy, "offload": "disk"})
    torch.manual_seed(0)
    engine = Engine(GPT(cfg.model), adamw, cfg)
    peaks = [engine.train_step(batches(s, 0, 1), gpt_loss).metrics for s in range(2)]
    engine.close()
    run = dry_run(lambda: GPT(cfg.model), gpt_loss, batches(0, 0, 1)[0], cfg, 1, optimizer=adamw)
    real = peaks[1]["peak_bytes"]
    assert abs(run.peak - real) <= 0.02 * real, (run.peak, real)
    # the time model's traffic: every input the real step parked, written out and read back
    # (none is parked when the step ends: counted from the step, not from what is held)
    assert peaks[1]["act_offload_bytes"] > 0 and run.work.offload == {"disk": 2 * peaks[1]["act_offload_bytes"]}
    # the activations it predicts are the tracker's, to the byte: I/O is simulated, not skipped
    for phase in ("forward", "backward"):
        assert run.phases[phase]["activations"] == peaks[1]["peaks"][phase]["activations"], phase
    assert _files_under(str(tmp_path)) == []  # a dry run writes nothing


def test_cpu_tier_on_a_cpu_device_is_a_one_line_error_naming_disk(tmp_path):
    cfg = _cfg("all", "cpu", str(tmp_path))
    with pytest.raises(ValueError, match=r"checkpointing.offload = 'cpu'.*use checkpointing.offload = 'disk'") as e:
        Engine(GPT(cfg.model), sgd, cfg, ctx=DistContext())
    assert "\n" not in str(e.value)


def test_offload_without_a_checkpointing_policy_is_a_config_error():
    with pytest.raises(ValueError, match=r"checkpointing.offload = 'disk'.*policy = 'none'"):
        tiny_config(checkpointing={"policy": "none", "offload": "disk"})
    with pytest.raises(ValueError, match=r"checkpointing.offload = 'tape'.*'none', 'cpu' or 'disk'"):
        tiny_config(checkpointing={"policy": "all", "offload": "tape"})


def test_unwritable_offload_dir_is_one_line_naming_the_key(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cfg = _cfg("all", "disk", str(blocker / "sub"))
    engine = Engine(GPT(cfg.model), sgd, cfg)
    with pytest.raises(ValueError, match=r"checkpointing.offload = 'disk': cannot write .*offload.dir") as e:
        engine.train_step(_micro_batches(0, 0, 1), seeded_gpt_loss)
    assert "\n" not in str(e.value)
    engine.close()


def test_a_full_disk_is_one_line_and_the_next_step_trains_again(tmp_path, monkeypatch):
    cfg = _cfg("all", "disk", str(tmp_path))
    engine = Engine(GPT(cfg.model), sgd, cfg)
    real_open = open

    def full(path, mode="r", *a, **k):
        if "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, mode, *a, **k)
    monkeypatch.setattr(act_store, "open", full, raising=False)
    with pytest.raises(ValueError, match=r"no space left on the device.*set offload.dir") as e:
        engine.train_step(_micro_batches(0, 0, 1), seeded_gpt_loss)
    assert "\n" not in str(e.value)
    monkeypatch.undo()
    out = engine.train_step(_micro_batches(0, 0, 1), seeded_gpt_loss)  # the failed step left nothing behind
    assert out.metrics["act_offload_count"] == 3
    assert _files_under(str(tmp_path)) == []
    engine.close()


def test_a_file_lost_before_backward_is_one_line(tmp_path):
    cfg = _cfg("all", "disk", str(tmp_path))
    engine = Engine(GPT(cfg.model), sgd, cfg)
    x, y, seed = _micro_batches(0, 0, 1)[0]
    loss = seeded_gpt_loss(engine.model, (x, y, seed))
    for f in _files_under(str(tmp_path)):
        os.unlink(f)
    with pytest.raises(ValueError, match=r"checkpointing.offload = 'disk': cannot read .*no such file"):
        loss.backward()
    engine.close()


def test_close_ends_the_io_thread_and_removes_the_folder(tmp_path):
    cfg = _cfg("all", "disk", str(tmp_path / "made"))
    engine = Engine(GPT(cfg.model), sgd, cfg)
    engine.train_step(_micro_batches(0, 0, 1), seeded_gpt_loss)
    assert any(t.name == "mct-act-offload" and t.daemon for t in threading.enumerate())
    engine.close()
    assert not any(t.name == "mct-act-offload" for t in threading.enumerate())
    assert not (tmp_path / "made").exists()  # the folder it created for offload.dir, too


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_cuda_offload_trains_bit_identically_and_frees_device_bytes(tmp_path, tier, deterministic_cuda):
    ref, m_ref = _cuda_offload_run(tmp_path, "none")
    again, _ = _cuda_offload_run(tmp_path, "none")
    assert all(torch.equal(again[name], ref[name]) for name in ref), "not deterministic without offload"
    got, m_got = _cuda_offload_run(tmp_path, tier)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name
    assert m_got["act_offload_count"] == 7
    assert m_got["peaks"]["backward"]["activations"] < m_ref["peaks"]["backward"]["activations"]


@pytest.fixture
def deterministic_cuda(monkeypatch):
    """Bit identity needs deterministic kernels: SDPA's CUDA backward (memory-efficient, with
    dropout) accumulates with atomics, so two runs without offload already differ; the explicit
    attention's matmuls and a deterministic cuBLAS workspace repeat exactly."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def _cuda_offload_run(tmp_path, off: str) -> tuple[dict, dict]:
    """Five steps of an 8-block GPT on CUDA with activation offload ``off``: (the final
    weights on the CPU, the last step's metrics)."""
    cfg = tiny_config(model={"n_layer": 8, "dropout": 0.1, "d_model": 256, "seq_len": 128, "attention": "explicit"},
                      offload={"dir": str(tmp_path)}, checkpointing={"policy": "all", "offload": off})
    torch.manual_seed(cfg.seed)
    engine = Engine(GPT(cfg.model), sgd, cfg, ctx=DistContext(device=torch.device("cuda")))
    for step in range(5):
        xb = [(torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(step)),
               torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(step + 99)), s)
              for _, _, s in _micro_batches(step, 0, 1)]
        out = engine.train_step(xb, seeded_gpt_loss)
    state = {n: t.cpu() for n, t in engine.full_state_dict().items()}
    engine.close()
    del engine
    gc.collect()  # the CUDA tracker counts every unregistered device byte as activations: free this run's
    return state, out.metrics


def _gpt_work(n_layer: int):
    from mct.task import gpt_task
    cfg = EngineConfig.from_dict({"model": {"n_layer": n_layer, "d_model": 16, "n_head": 2, "vocab_size": 101,
                                            "seq_len": 13}, "data": {"micro_batch_size": 3}})
    return gpt_task(cfg), cfg


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_plan_rows_per_activation_offload_tier_and_extrapolation_is_exact():
    from mct.planner.plan import Grid, make_plan
    work, cfg = _gpt_work(8)
    grid = Grid((0,), ("none", "all"), ("fp32",), act_offloads=("none", "disk"))
    ext = make_plan(work, cfg, 1, None, grid, extrapolate=True, advise=False)
    full = make_plan(work, cfg, 1, None, grid, extrapolate=False, advise=False)
    keys = [(r["stage"], r["policy"], r["act_offload"]) for r in full.rows]
    # policy 'none' checkpoints nothing, so it plans no activation offload
    assert sorted(keys) == sorted((s, p, a) for s in (0,) for p in ("none", "all")
                                  for a in ("none", "disk") if p != "none" or a == "none")
    assert [(r["peak"], r["phases"]) for r in ext.rows] == [(r["peak"], r["phases"]) for r in full.rows]
    by = {(r["stage"], r["policy"], r["act_offload"]): r for r in full.rows}
    on, off = by[(0, "all", "disk")], by[(0, "all", "none")]
    assert on["phases"]["forward"] < off["phases"]["forward"] and on["peak"] < off["peak"], (on, off)
    assert on["cost"] > off["cost"]


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_auto_chooses_activation_offload_when_only_it_fits(capsys):
    from mct.planner import resolve_auto
    from mct.planner.plan import Grid, make_plan
    work, base = _gpt_work(8)
    grid = Grid((0,), ("all",), ("fp32",), act_offloads=("none", "disk"))
    rows = {r["act_offload"]: r for r in make_plan(work, base, 1, None, grid, advise=False).rows}
    budget = (rows["none"]["peak"] + rows["disk"]["peak"]) // 2
    assert rows["disk"]["peak"] < budget < rows["none"]["peak"]
    cfg = EngineConfig.from_dict({**base.to_dict(), "zero": {"stage": 0}, "checkpointing": {"policy": "auto"},
                                  "memory": {"budget": str(budget), "budget_counts": "tensors"}})
    resolved, choice = resolve_auto(cfg, 1, work)
    assert resolved.checkpointing.offload == "disk" and choice["checkpointing.offload"] == "disk"
    assert choice["predicted_peak_bytes"] <= budget


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_mct_plan_act_offloads_flag(capsys):
    from mct.cli import main
    args = ["plan", "--set", "model.n_layer=4", "--set", "model.d_model=16", "--set", "model.n_head=2",
            "--set", "model.seq_len=16", "--stages", "0", "--policies", "none,all", "--precisions", "fp32",
            "--act-offloads", "none,disk"]
    assert main([*args, "--wide"]) == 0  # the full table (the default one says shared columns once)
    out = capsys.readouterr().out
    lines = [r for r in (line.split() for line in out.splitlines()[2:]) if r and r[0].isdigit()]  # the table's rows
    assert sorted((r[1], r[4]) for r in lines) == [("all", "disk"), ("all", "none"), ("none", "none")], out
    assert main(args[:-1] + ["none,tape"]) == 2
    assert "--act-offloads 'none,tape'" in capsys.readouterr().err
