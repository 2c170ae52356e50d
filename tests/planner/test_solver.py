"""The solver: the fastest predicted configuration whose peaks fit a byte budget, found
with real dry runs (mct.planner.solver, mct.planner.auto, `mct plan --solve`)."""

from __future__ import annotations

import dataclasses
import importlib
import json

import pytest

from mct.cli import main
from mct.config import EngineConfig
from mct.planner import Grid, make_plan, resolve_auto
from mct.planner.auto import solve_auto, space_for
from mct.planner.grid import prepare_work
from mct.planner.solver import Space, configure_row, frontier, need, predicted_seconds, rank, solve
from mct.reporting.metrics import MetricsWriter
from mct.task import gpt_task

plan_module = importlib.import_module("mct.planner.plan")  # the package's plan() shadows the module name
MODEL = {"n_layer": 4, "n_head": 2, "d_model": 16, "seq_len": 16, "vocab_size": 64, "dropout": 0.0}
REAL_PREDICT = plan_module.predict


@pytest.fixture(scope="module")
def dry_runs() -> dict:
    return {}


@pytest.fixture(autouse=True)
def each_config_dry_run_once(monkeypatch, dry_runs):
    """A dry run is deterministic: each configuration is dry-run once in this module (the suite's time)."""
    def predict(work, cfg, world):
        key = (json.dumps(cfg.to_dict(), sort_keys=True), world)
        if key not in dry_runs:
            dry_runs[key] = REAL_PREDICT(work, cfg, world)
        return dry_runs[key]
    monkeypatch.setattr(plan_module, "predict", predict)


def config(**sections) -> EngineConfig:
    d = {"model": dict(MODEL), "data": {"micro_batch_size": 4}, "zero": {"stage": 0},
         "checkpointing": {"policy": "auto"}, "memory": {"budget_counts": "tensors"}}  # budgets here: tensor bytes
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v}
    return EngineConfig.from_dict(d)


def uniform_rows(cfg: EngineConfig, **grid) -> dict[str, dict]:
    base = EngineConfig.from_dict({**cfg.to_dict(), "checkpointing": {"policy": "none"}})
    plan = make_plan(gpt_task(cfg), base, 1, None, Grid((0,), ("none", "selective", "all"), ("fp32",), **grid),
                     advise=False)
    return {r["policy"]: r for r in plan.rows}


ONE_BRANCH = Space(stages=(0,), search_policy=True, acts=("none",), chunks=(0,), offloads=("none",),
                   micro_batches=(4,))


@pytest.mark.slow
def test_pick_fits_recomputes_fewer_blocks_and_is_no_slower_than_any_fitting_uniform_row():
    cfg = config()
    rows = uniform_rows(cfg)
    budget = (need(rows["none"]) + need(rows["all"])) // 2
    sol = solve(gpt_task(cfg), cfg, 1, budget, ONE_BRANCH)
    pick = sol.pick
    assert pick is not None and pick["fits"]
    assert max(pick["peak"], pick["first_step_peak"], pick["init_peak"]) <= budget
    assert pick["policy"] == "per_block" and sum(pick["per_block"].values()) < MODEL["n_layer"], pick
    fitting = [r for r in rows.values() if need(r) <= budget]
    assert fitting and all(predicted_seconds(pick) <= predicted_seconds(r) for r in fitting)
    # the pick's numbers are a dry run's: its config predicted again, alone
    picked = configure_row(cfg, pick)
    run = REAL_PREDICT(prepare_work(gpt_task(picked), picked), picked, 1)
    assert (run.peak, run.first_step_peak, run.init_peak) == (pick["peak"], pick["first_step_peak"],
                                                              pick["init_peak"])
    # one block fewer does not fit (the fewest that fit), and every candidate reported was dry-run
    fewer = {**pick["per_block"], "all": pick["per_block"].get("all", 0) - 1}
    assert any(r["per_block"] == {k: v for k, v in fewer.items() if v} and not r["fits"] for r in sol.rows) or \
        pick["per_block"].get("all", 0) == 0
    assert all(r in sol.rows for r in sol.frontier) and pick in sol.frontier
    assert sol.why.startswith("fastest that fits") and "of 4 blocks" in sol.why


def test_ranking_takes_step_seconds_when_predicted_and_ties_go_to_the_larger_micro_batch():
    def r(cost, step_s, peak, mb=4, stage=0):
        return {"cost": cost, "step_s": step_s, "peak": peak, "first_step_peak": 0, "init_peak": 0,
                "micro_batch_size": mb, "stage": stage}
    assert predicted_seconds(r(1.5, None, 1)) == 1.5 and predicted_seconds(r(1.5, 0.2, 1)) == 0.2
    a, b, c = r(1.0, None, 5, mb=2), r(1.0, None, 7, mb=4), r(1.2, None, 3)
    assert min([a, b, c], key=rank) is b  # same time: the larger micro-batch, then the lower peak
    assert frontier([a, b, c]) == [c, a]  # b needs more than a and is no faster


@pytest.mark.slow
def test_budget_below_everything_is_the_one_line_nothing_fits_error_after_few_dry_runs(monkeypatch):
    calls = []
    real = plan_module.predict
    monkeypatch.setattr(plan_module, "predict", lambda *a: calls.append(a[1]) or real(*a))
    monkeypatch.setattr(plan_module, "_what_would_fit", lambda *a: "")  # its own search is tested in test_planner
    cfg = config(zero={"stage": "auto"}, memory={"budget": "1KB"})
    with pytest.raises(ValueError, match="nothing fits 1000 B") as e:
        resolve_auto(cfg, 2, gpt_task(cfg))
    assert "\n" not in str(e.value)
    # the most frugal configuration, then with loss chunking, MLP tiling, state offload: one dry run each
    assert len(calls) == 4, [(c.zero.stage, c.checkpointing.policy, c.train.loss_chunk_tokens) for c in calls]
    assert calls[0].zero.stage == 3 and calls[0].checkpointing.policy == "all"


@pytest.mark.slow
def test_levers_that_change_numerics_are_chosen_only_when_allowed():
    cfg = config()
    small = uniform_rows(config(data={"micro_batch_size": 2}))
    rows = uniform_rows(cfg)
    budget = (need(small["none"]) + need(rows["none"])) // 2  # micro-batch 2 fits without recompute, 4 does not
    assert need(rows["all"]) < budget
    work = gpt_task(cfg)
    plain = dataclasses.replace(space_for(work, cfg, ()), acts=("none",))
    assert plain.micro_batches == (4,) and plain.chunks == (0,) and plain.offloads == ("none",)
    sol = solve_auto(work, cfg, 1, budget, (), space=plain)
    assert sol.pick["micro_batch_size"] == 4 and sol.pick["policy"] != "none"
    assert {r["loss_chunk_tokens"] for r in sol.rows} == {0} and {r["offload"] for r in sol.rows} == {"none"}
    allowed = dataclasses.replace(space_for(work, cfg, ("micro_batch",)), acts=("none",))
    assert allowed.micro_batches == (4, 2, 1)
    # ranked by the relative cost (no rates), where half the micro-batch and no recompute is the faster
    sol = solve_auto(work, cfg, 1, budget, ("micro_batch",), space=allowed, row_kw={})
    pick = sol.pick
    assert (pick["micro_batch_size"], pick["grad_accum"], pick["policy"]) == (2, 2, "none"), pick
    resolved = configure_row(cfg, pick)
    assert (resolved.data.micro_batch_size, resolved.data.grad_accum) == (2, 2)
    with pytest.raises(ValueError, match="memory.solver_allow .*'fast' is not a lever"):
        config(memory={"solver_allow": ["fast"]})


@pytest.mark.slow
def test_budget_fallback_leaves_a_per_block_pick_for_a_more_frugal_uniform_policy():
    from mct.run.budget_loop import BudgetLoop
    cfg = config()
    rows = uniform_rows(cfg)
    budget = (need(rows["none"]) + need(rows["all"])) // 2
    auto = EngineConfig.from_dict({**cfg.to_dict(), "memory": {"budget": str(budget), "enforce": True,
                                                                "budget_counts": "tensors"}})
    work = gpt_task(auto)
    resolved, choice = resolve_auto(auto, 1, work)
    assert resolved.checkpointing.policy == "per_block" and choice["checkpointing.per_block"]
    assert choice["solver"]["why"] and choice["data.micro_batch_size"] == 4
    loop = BudgetLoop.maybe(auto, choice, 1, work)
    new, change = loop.next_config(resolved, "over budget")
    assert new.checkpointing.policy in ("all", "sqrt") and new.checkpointing.per_block == []
    assert change["to"]["predicted_peak_bytes"] < choice["predicted_peak_bytes"]


@pytest.mark.slow
def test_mct_plan_solve_prints_the_frontier_pick_and_why_and_json_carries_them(capsys, tmp_path):
    rows = uniform_rows(config())
    budget = (need(rows["none"]) + need(rows["all"])) // 2
    base = ["plan", *(a for k, v in MODEL.items() for a in ("--set", f"model.{k}={v}")), "--set",
            "data.micro_batch_size=4", "--stages", "0", "--precisions", "fp32", "--workers", "1",
            "--set", "memory.budget_counts=tensors"]
    argv = [*base, "--budget", str(budget), "--solve"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"budget", "world", "n_params", "precision", "n_blocks", "pick", "why", "frontier", "rows", "allow"} <= set(out)
    assert out["pick"] in out["frontier"] and all(r in out["rows"] for r in out["frontier"])
    assert out["allow"] == [] and out["pick"]["fits"] and out["budget"] == budget
    assert main([*argv, "--plot", str(tmp_path / "f.png")]) == 0
    text = capsys.readouterr().out
    assert "frontier" in text and "\npick: zero.stage=0 " in text and "\nwhy: fastest that fits" in text
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
    for bad, word in (([*argv, "--allow", "fast"], "'fast'"), ([*base, "--solve"], "--budget"),
                      ([*base, "--budget", str(budget), "--allow", "micro_batch"], "--solve")):
        assert main(bad) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and word in err, err


@pytest.mark.slow  # a training run (in make test, not make test-fast)
def test_auto_trains_the_solvers_pick_and_records_it(tmp_path, corpus_dir, monkeypatch):
    from mct.run.trainer import train
    # ranked by the relative cost (no machine rates), where half the micro-batch and no recompute is the faster
    monkeypatch.setattr("mct.planner.solver.device_rates", lambda *a, **k: (None, []))
    cfg = config(memory={"solver_allow": ["micro_batch"]}, model={"vocab_size": 256})  # the corpus's bytes
    rows = uniform_rows(cfg)
    small = uniform_rows(config(data={"micro_batch_size": 2}, model={"vocab_size": 256}))
    budget = (need(small["none"]) + need(rows["none"])) // 2
    run = EngineConfig.from_dict({**cfg.to_dict(), "data": {**cfg.to_dict()["data"], "path": str(corpus_dir)},
                                  "memory": {"budget": str(budget), "solver_allow": ["micro_batch"],
                                             "budget_counts": "tensors"},
                                  "train": {"steps": 2, "warmup_steps": 1, "eval_every": 0, "log_every": 1}})
    train(run, tmp_path / "run", progress=False)
    meta = json.loads((tmp_path / "run" / "metadata.json").read_text())
    assert meta["plan"]["data.micro_batch_size"] == 2 and meta["config"]["data"]["grad_accum"] == 2
    assert meta["plan"]["predicted_peak_bytes"] <= budget and meta["plan"]["solver"]["frontier"]


@pytest.mark.slow  # a solver search over dry runs (7 s)
def test_mct_report_shows_the_solvers_pick_frontier_and_why_a_run_recorded(tmp_path, capsys):
    """A run whose config used ``auto`` records the solver's choice in metadata.json under
    ``plan`` (as ``mct train`` writes it); ``mct report`` prints the pick, the frontier's
    size and the why line. A run without the record prints no solver line."""
    rows = uniform_rows(config())
    auto = config(memory={"budget": str((need(rows["none"]) + need(rows["all"])) // 2)})
    _, choice = resolve_auto(auto, 1, gpt_task(auto))
    for name, meta in (("solved", {"plan": choice, "config": auto.to_dict()}), ("plain", {"config": auto.to_dict()})):
        run = tmp_path / name
        MetricsWriter(run).log({"step": 1, "loss": 4.0, "step_time_s": 0.01})
        (run / "metadata.json").write_text(json.dumps(meta))
    assert main(["report", str(tmp_path / "solved")]) == 0
    out = capsys.readouterr().out
    n = len(choice["solver"]["frontier"])
    assert f"solver pick: zero.stage={choice['zero.stage']} checkpointing.policy=" in out
    assert f"(frontier {n} row(s), {choice['solver']['dry_runs']} dry runs)" in out and n >= 1
    assert f"solver why: {choice['solver']['why']}" in out
    assert main(["report", str(tmp_path / "plain")]) == 0
    assert "solver" not in capsys.readouterr().out


@pytest.mark.slow
def test_a_stage_3_pick_under_auto_keeps_the_root_gathered_when_that_fits_and_is_faster():
    """Step 4 of the solver: one more dry run of the pick with zero.reshard_root_after_forward
    = false (one all-gather of the root fewer); taken when it fits and is predicted faster.
    A pinned zero.stage keeps the user's root setting."""
    stage3 = Space(stages=(3,), search_policy=False, acts=("none",), chunks=(0,), offloads=("none",),
                   micro_batches=(4,))
    auto = config(zero={"stage": "auto"}, checkpointing={"policy": "none"})
    sol = solve(gpt_task(auto), auto, 2, 1 << 40, stage3)
    kept = [r for r in sol.rows if r["reshard_root_after_forward"] is False]
    assert len(kept) == 1 and len(sol.rows) == 2
    default = next(r for r in sol.rows if r["reshard_root_after_forward"])
    assert predicted_seconds(kept[0]) < predicted_seconds(default)  # the simulated communicator saw one gather fewer
    assert sol.pick is kept[0] and "zero.reshard_root_after_forward=false" in sol.why
    assert configure_row(auto, sol.pick).zero.reshard_root_after_forward is False
    pinned = config(zero={"stage": 3}, checkpointing={"policy": "none"})
    assert all(r["reshard_root_after_forward"] for r in solve(gpt_task(pinned), pinned, 2, 1 << 40, stage3).rows)
