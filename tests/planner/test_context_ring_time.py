"""The planner prices the ring attention's point-to-point exchanges (``parallel.context_attention
= 'ring'``) from the dry run's own counts."""

from __future__ import annotations

import dataclasses

import pytest

from tests.planner.test_context_solver import CONTEXTS, KV_BYTES, T, config, rates


def test_a_ring_exchange_is_priced_as_a_two_rank_all_gather_of_what_it_moves():
    r = rates(1e9)
    assert r.collective_s("send_recv", 1000, 1) == pytest.approx(1e-4 + 2000 / 1e9 + r.wait_s)
    measured = dataclasses.replace(r, collectives={**r.collectives, "send_recv": (5e-5, 2e9)})
    assert measured.collective_s("send_recv", 1000, 1) == pytest.approx(5e-5 + 1000 / 2e9 + measured.wait_s)


def test_the_dry_run_counts_the_rings_exchanges_forward_and_backward():
    from mct.planner.auto import solve_auto
    from mct.task import gpt_task
    cfg = config(parallel={"context_attention": "ring"})
    sol = solve_auto(gpt_task(cfg), cfg, 2, 10**9, ("context",), space=CONTEXTS,
                     row_kw={"rates": rates(1e9), "tokens": 2 * T})
    two = {r.context: r for r in sol.rows}[2]
    # per layer and micro-batch at degree 2: keys and values ([2, B, kv heads, T / 2, head width])
    # one step forward; backward again, and their gradients twice (back to their owner)
    exchanges = 2 * 2 * (1 + 1 + 2)
    assert two.time["comm_s"] == pytest.approx(exchanges * (1e-4 + 2 * KV_BYTES / 1e9))
