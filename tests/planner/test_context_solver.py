"""The solver choosing parallel.context (``memory.solver_allow = ['context']``): the degree
whose per-rank peak fits the budget, and between degrees that both fit the faster by the
time model, which prices the context group's all-gathers of keys and values and their
reduce-scatters from the dry run's own counts."""

from __future__ import annotations

import pytest

from mct.config import EngineConfig
from mct.planner import resolve_auto
from mct.planner.auto import context_degrees, solve_auto, space_for
from mct.planner.solver import Space, predicted_seconds
from mct.planner.steptime import Rates
from mct.task import gpt_task

T = 256
MODEL = {"n_layer": 2, "n_head": 2, "d_model": 16, "seq_len": T, "vocab_size": 64, "dropout": 0.0}
CONTEXTS = Space(stages=(0,), search_policy=False, acts=("none",), chunks=(0,), offloads=("none",),
                 micro_batches=(1,), contexts=(1, 2))
KV_BYTES = 1 * 2 * T * 8 * 4  # one layer's keys (or values), the whole window: [B, heads, T, head width] fp32


def config(**sections) -> EngineConfig:
    d = {"model": dict(MODEL), "data": {"micro_batch_size": 1}, "zero": {"stage": 0},
         "checkpointing": {"policy": "none"},
         "memory": {"budget_counts": "tensors", "solver_allow": ["context"]}}  # budgets here: tensor bytes
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v}
    return EngineConfig.from_dict(d)


def rates(collective_bw: float) -> Rates:
    return Rates(matmul={"fp32": ((16.0, 1e9), (256.0, 4e9))}, speedup={"fp32": 1.0},
                 elementwise=((1e5, 4e9), (1e7, 1e9)), op_s=1e-5,
                 collectives={"all_gather": (1e-4, collective_bw), "reduce_scatter": (1e-4, collective_bw)})


def solved(budget: int, bw: float = 1e9):
    cfg = config()
    sol = solve_auto(gpt_task(cfg), cfg, 2, budget, ("context",), space=CONTEXTS,
                     row_kw={"rates": rates(bw), "tokens": 2 * T})
    return sol, {r.context: r for r in sol.rows}


def test_the_solver_may_choose_only_degrees_that_divide_the_world_and_halve_the_window():
    assert context_degrees(config(), 2) == (1, 2)
    assert context_degrees(config(model={"seq_len": 12}), 6) == (1, 2, 3, 6)
    assert context_degrees(config(model={"seq_len": 20}), 4) == (1, 2)  # 20 is no multiple of 2 x 4
    cfg = config()
    assert space_for(gpt_task(cfg), cfg, (), world=2).contexts == (None,)  # not allowed: the config's own
    assert space_for(gpt_task(cfg), cfg, ("context",), world=2).contexts == (1, 2)


@pytest.mark.slow
def test_a_budget_only_context_2_fits_picks_context_2_with_the_global_batch_kept():
    _, rows = solved(10**9)
    one, two = rows[1], rows[2]
    assert two.peak < one.peak  # each rank holds half the window's activations
    sol, _ = solved((one.peak + two.peak) // 2)
    assert sol.pick is not None and sol.pick.context == 2 and not rows[1].peak <= sol.budget
    assert (sol.pick.micro_batch_size, sol.pick.grad_accum) == (1, 2)  # 2 windows a step, as at degree 1
    assert "parallel.context=2" in sol.why
    # the time model prices the group's collectives: per micro-batch, each layer gathers K and V
    # forward and reduce-scatters their gradients backward, 2 layers x 2 tensors x 2 micro-batches
    calls = 2 * 2 * 2 * 2
    assert two.time["comm_s"] == pytest.approx(calls * (1e-4 + KV_BYTES / 1e9))
    assert one.time["comm_s"] == 0.0  # stage 0 on 2 ranks: the rates above price no all-reduce


@pytest.mark.slow
def test_a_budget_both_fit_picks_the_degree_the_time_model_says_is_faster():
    fast, rows = solved(10**9, bw=1e9)
    assert fast.pick is min(rows.values(), key=predicted_seconds) and fast.pick.context == 2
    slow, rows = solved(10**9, bw=1e5)  # the same dry runs, collectives 10,000x slower
    assert rows[2].time["comm_s"] > rows[1].step_s
    assert slow.pick is min(rows.values(), key=predicted_seconds) and slow.pick.context == 1


@pytest.mark.slow
def test_auto_resolves_parallel_context_into_the_config_it_trains():
    cfg = config(zero={"stage": "auto"})
    every = solve_auto(gpt_task(cfg), cfg, 2, 10**9, ("context",), row_kw={}).rows  # every stage x degree
    least = {d: min(r.need for r in every if r.context == d) for d in (1, 2)}
    assert least[2] < least[1] and len(every) == 8
    budget = (least[1] + least[2]) // 2
    resolved, record = resolve_auto(config(zero={"stage": "auto"}, memory={"budget": budget}), 2, gpt_task(cfg))
    assert (resolved.parallel.context, resolved.data.micro_batch_size, resolved.data.grad_accum) == (2, 1, 2)
    assert record["parallel.context"] == 2
    plain, _ = resolve_auto(config(zero={"stage": "auto"}, memory={"budget": budget, "solver_allow": []}), 2,
                            gpt_task(cfg))
    assert plain.parallel.context == 1  # not allowed: the config's own degree, whatever fits
