"""Memory planner: predictions against the engine's measured peaks, the ZeRO paper's
model-state example, `auto` resolution, `mct plan`, and the enforced budget."""

from __future__ import annotations

import json

import pytest
import torch

from mct.cli import main
from mct.config import EngineConfig
from mct.engine import Engine
from mct.memory.plan import make_plan, resolve_auto
from mct.memory.planner import ModelSource, Unit, meta_layout, model_state_bytes, predict, zero_paper_bytes
from mct.memory.tracker import MemoryBudgetExceeded, MemoryTracker
from mct.models.gpt import GPT, gpt_loss, optimizer_groups
from tests.distributed import run_distributed
from tests.helpers import TINY_MODEL, adamw, batches, measured_peak, tiny_config

B = 4
# (stage, policy, precision): every stage, policy and precision at least once per world size
GRID = {1: [(0, "none", "fp32"), (3, "sqrt", "bf16")],
        2: [(1, "all", "bf16"), (2, "sqrt", "fp32"), (3, "all", "fp32"), (3, "none", "bf16")]}


def small_gpt() -> torch.nn.Module:
    """A `module:factory` model for the planner: the tiny GPT, one block deeper."""
    return GPT(tiny_config(model={"n_layer": 3}).model)


def _cfg(stage: int, policy: str, precision: str) -> EngineConfig:
    return tiny_config(zero={"stage": stage}, checkpointing={"policy": policy}, precision={"mode": precision},
                       data={"micro_batch_size": B})


def _measured_peaks(rank: int, world: int, grid: list) -> list[int]:
    return [measured_peak(_cfg(*c), rank, B) for c in grid]


def _predicted(world: int, stage: int, policy: str, precision: str) -> int:
    cfg = _cfg(stage, policy, precision)
    source = ModelSource.from_config(cfg)
    return predict(meta_layout(source, world), source, stage=stage, policy=policy, precision=precision,
                   batch=B, seq=TINY_MODEL["seq_len"]).peak


def test_predicted_peak_within_10_percent_of_measured_on_one_and_two_ranks():
    measured = {1: _measured_peaks(0, 1, GRID[1]), 2: run_distributed(_measured_peaks, 2, GRID[2])[0]}
    for world, grid in GRID.items():
        for (stage, policy, precision), got in zip(grid, measured[world]):
            pred = _predicted(world, stage, policy, precision)
            assert abs(pred - got) <= 0.10 * got, (world, stage, policy, precision, pred, got)


def test_zero_paper_example_model_states_within_1_percent():
    psi, n = 7.5e9, 64
    paper = {0: 120e9, 1: 31.4e9, 2: 16.6e9, 3: 1.9e9}
    # 1%, or the paper's own rounding where that is coarser (it prints 1.875 GB as 1.9 GB)
    tolerance = {s: max(0.01 * w, 0.05e9) for s, w in paper.items()}
    for stage, want in paper.items():
        assert abs(zero_paper_bytes(int(psi), n, stage) - want) <= tolerance[stage]
    # The planner's own per-unit arithmetic, with the paper's 16-bit gradients: one
    # unit per 1/32 of the model, as a 32-block model would be cut.
    units = [Unit(f"b{i}", 0, int(psi) // 32, int(psi) // 32, int(psi) // 32 // n, 1) for i in range(32)]
    units0 = [Unit(u.owner, 0, u.numel, u.numel, u.numel, 1) for u in units]
    for stage, want in paper.items():
        got = sum(model_state_bytes(units0 if stage == 0 else units, stage, "bf16", grad_bytes=2).values())
        # stage 3: the paper also keeps a 16-bit working shard; the engine gathers from the master
        want = want if stage < 3 else want - 2 * psi / n
        assert abs(got - want) <= tolerance[stage], (stage, got, want)


def test_module_factory_model_is_planned_like_the_reference_gpt():
    cfg = _cfg(0, "none", "fp32")
    by_factory = make_plan(cfg, 1, None, factory="tests.test_planner:small_gpt", stages=(0,), policies=("all",),
                           precisions=("fp32",))
    by_config = make_plan(tiny_config(model={"n_layer": 3}, data={"micro_batch_size": B}), 1, None, stages=(0,),
                          policies=("all",), precisions=("fp32",))
    assert by_factory.n_params == by_config.n_params == sum(p.numel() for p in small_gpt().parameters())
    assert by_factory.rows[0].pred.peak == by_config.rows[0].pred.peak


def test_auto_without_budget_is_a_clear_value_error():
    cfg = tiny_config(zero={"stage": "auto"})
    with pytest.raises(ValueError, match="memory.budget"):
        resolve_auto(cfg, 1)


def test_engine_given_auto_points_to_the_planner():
    cfg = tiny_config(checkpointing={"policy": "auto"}, memory={"budget": "1GiB"})
    with pytest.raises(ValueError, match="resolve_auto"):
        Engine(GPT(cfg.model), adamw, cfg)


def _write_corpus(tmp_path) -> str:
    text = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(3000))
    for i in range(4):
        (tmp_path / f"file{i}.py").write_text(text[i::4] * 2)
    return str(tmp_path)


def test_auto_picks_a_fitting_configuration_and_trains_under_enforce(tmp_path):
    from mct.trainer import train
    (tmp_path / "data").mkdir()
    base = {"model": dict(TINY_MODEL), "data": {"path": _write_corpus(tmp_path / "data"), "micro_batch_size": B},
            "train": {"steps": 3, "eval_every": 0, "warmup_steps": 1, "log_every": 1}}
    default_peak = _predicted(1, 0, "none", "fp32")
    budget = int(default_peak * 0.8)  # the default run does not fit
    cfg = EngineConfig.from_dict({**base, "zero": {"stage": "auto"}, "checkpointing": {"policy": "auto"},
                                  "memory": {"budget": str(budget), "enforce": True}})
    summary = train(cfg, tmp_path / "run", progress=False)
    assert summary.steps == 3
    meta = json.loads((tmp_path / "run" / "metadata.json").read_text())
    choice = meta["plan"]
    assert choice["predicted_peak_bytes"] <= budget
    assert (choice["zero.stage"], choice["checkpointing.policy"]) != (0, "none")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["predicted_peak_bytes"] == choice["predicted_peak_bytes"] for r in rows)
    assert max(r["peak_bytes"] for r in rows) <= budget


def test_impossible_budget_fails_in_one_line_with_exit_2(capsys):
    tiny = [f"model.{k}={v}" for k, v in TINY_MODEL.items()]
    args = [a for kv in tiny for a in ("--set", kv)] + ["--set", f"data.micro_batch_size={B}"]
    assert main(["train", *args, "--set", "zero.stage=auto", "--set", "memory.budget=20KB"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("mct: error: nothing fits") and "misses by" in err
    assert main(["plan", *args, "--budget", "20KB", "--json"]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out)["recommended"] is None
    assert captured.err.strip().count("\n") == 0 and "nothing fits" in captured.err


def test_budget_exceeded_in_the_optimizer_step_modifies_nothing():
    """The first step's Adam state does not fit, forward and backward do: the step must
    fail before any master, parameter or optimizer state changes, and succeed later."""
    probe = _cfg(0, "all", "fp32")
    torch.manual_seed(0)
    m = GPT(probe.model)
    peaks = Engine(m, adamw, probe, param_groups=optimizer_groups(m, 0.1)).train_step(
        batches(0, 0, 1, B=B), gpt_loss).metrics["peaks"]
    budget = (max(peaks["forward"]["total"], peaks["backward"]["total"]) + peaks["optimizer"]["total"]) // 2
    assert peaks["optimizer"]["total"] > budget
    cfg = tiny_config(checkpointing={"policy": "all"}, data={"micro_batch_size": B},
                      memory={"budget": str(budget), "enforce": True})
    torch.manual_seed(0)
    model = GPT(cfg.model)
    engine = Engine(model, adamw, cfg, param_groups=optimizer_groups(model, 0.1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(MemoryBudgetExceeded) as info:
        engine.train_step(batches(0, 0, 1, B=B), gpt_loss)
    assert info.value.stage == "optimizer" and "mct plan" in str(info.value)
    assert not engine.optimizer.state, "the optimizer's lazy state was created"
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    engine.tracker.budget_bytes = None
    assert not engine.train_step(batches(0, 0, 1, B=B), gpt_loss).skipped
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_stage_peak_records_growth_below_an_earlier_global_peak():
    tracker = MemoryTracker("cpu")
    with tracker.stage("big"):
        x = torch.zeros(1000)
        del x
    with tracker.stage("small"):
        y = torch.zeros(100)
    assert tracker.peaks()["small"]["total"] == y.untyped_storage().nbytes()
