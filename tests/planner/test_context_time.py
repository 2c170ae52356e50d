"""The time model prices a context group's collectives at its group size: the group rates'
keys in the machine profile, the arithmetic of one priced call, the fall-back to the
world's rates for a profile measured before group rates existed, and the dry run's counts
carrying the group size."""

from __future__ import annotations

import pytest
import torch

from mct.context.comm import SimulatedContextComm
from mct.machine import MachineProfile
from mct.planner import overhead, steptime
from mct.planner.steptime import Rates, group_collectives, group_key, rates_for, step_time
from mct.planner.work import StepWork

WORLD_RATES = {"all_reduce": (1e-4, 1e9), "all_gather": (3e-4, 2.5e8), "reduce_scatter": (2e-4, 5e8)}
GROUP_RATES = {"all_gather": (1e-5, 4e9), "reduce_scatter": (2e-5, 2e9), "all_to_all": (5e-5, 1e9)}


def _rates(**kw) -> Rates:
    return Rates(matmul={"fp32": ((16.0, 1e9),)}, speedup={"fp32": 1.0}, elementwise=((1e5, 4e9),), op_s=0.0,
                 collectives=dict(WORLD_RATES), **kw)


def _profile(collectives: dict) -> MachineProfile:
    return MachineProfile(device="cpu", name="handmade", flags=(), torch_version="x", threads=8,
                          matmul_one={"fp32": 1e10}, matmul_all={"fp32": 1e10}, matmul_size={"fp32": 1024},
                          memcpy_bytes_per_s=1e9, extra={"collectives": collectives})


@pytest.fixture
def eight_cores(monkeypatch):
    """The profile's machine has 8 usable cores: worlds up to 8 are measured as themselves."""
    monkeypatch.setattr(steptime, "usable_cores", lambda: 8)


def test_a_context_call_is_priced_at_its_group_rates_not_the_worlds():
    rates = _rates(groups={2: dict(GROUP_RATES)})
    assert rates.collective_s("all_gather", 4e6, 1, 2) == pytest.approx(1e-5 + 4e6 / 4e9)
    assert rates.collective_s("all_to_all", 1e6, 1, 2) == pytest.approx(5e-5 + 1e6 / 1e9)
    assert rates.collective_s("all_gather", 4e6, 1) == pytest.approx(3e-4 + 4e6 / 2.5e8)  # the world's own


def test_a_group_without_measured_rates_falls_back_to_the_worlds_rate_of_that_kind():
    rates = _rates()  # a profile from before group rates: the world's, as before
    assert rates.collective_s("reduce_scatter", 5e5, 1, 2) == pytest.approx(2e-4 + 5e5 / 5e8)
    assert rates.collective_s("all_to_all", 1e6, 1, 2) == 0.0  # measured nowhere: not counted


def test_step_time_sums_world_and_group_collectives_by_their_own_rates():
    work = StepWork(ops={}, comm={("all_reduce", 10**6, 2): 1, ("all_gather", 4 * 10**6, 1, 2): 3,
                                  ("all_to_all", 10**6, 1, 2): 4})
    got = step_time(work, _rates(groups={2: dict(GROUP_RATES)})).comm_s
    assert got == pytest.approx((2 * 1e-4 + 1e6 / 1e9) + 3 * (1e-5 + 4e6 / 4e9) + 4 * (5e-5 + 1e6 / 1e9))
    assert work.comm_bytes == 10**6 + 3 * 4 * 10**6 + 4 * 10**6


def test_group_rates_are_keyed_by_world_and_group_and_scaled_as_a_ring_beyond_the_measured(eight_cores):
    profile = _profile({"gloo:8/2": {k: list(v) for k, v in GROUP_RATES.items()},
                        "gloo:8/8": {k: list(v) for k, v in GROUP_RATES.items()}})
    assert group_key(profile, 8, 2) == ("gloo:8/2", 2)
    assert group_key(profile, 6, 3) == ("gloo:6/3", 3)
    assert group_key(profile, 16, 2) == ("gloo:8/2", 2)  # a larger world: its groups of 2 as measured at 8
    assert group_collectives(profile, 8, 2)["all_to_all"] == GROUP_RATES["all_to_all"]
    lat, bw = group_collectives(profile, 16, 16)["all_gather"]  # a group of 16 from one of 8
    assert lat == pytest.approx(1e-5 * 15 / 7) and bw == pytest.approx(4e9 * (7 / 8) / (15 / 16))
    assert group_collectives(profile, 4, 2) == {}  # 'gloo:4/2' not measured
    assert set(rates_for(profile, 8, 1).groups) == {2, 8}  # 4's not measured either


def test_a_profile_without_group_rates_gets_them_measured_once_on_demand(eight_cores, monkeypatch, tmp_path):
    asked = []

    def measure(world, groups, device):
        asked.append((world, groups))
        return {g: {k: list(v) for k, v in GROUP_RATES.items()} for g in groups}

    monkeypatch.setattr(overhead, "measure_group_collectives", measure)
    monkeypatch.setattr(overhead, "remember", lambda p, name, value: (
        MachineProfile.from_dict({**p.to_dict(), "extra": {**p.extra, name: {**p.extra.get(name, {}), **value}}}),
        None))
    profile, warning = overhead._with_group_collectives(_profile({"gloo:4": {}}), 4, "cpu")
    assert asked == [(4, (2, 4))] and warning is None
    assert {"gloo:4/2", "gloo:4/4"} <= set(profile.extra["collectives"])
    overhead._with_group_collectives(profile, 4, "cpu")
    assert asked == [(4, (2, 4))]  # cached: not measured again


def test_the_dry_runs_context_counts_carry_the_group_size():
    comm = SimulatedContextComm(3)
    x = torch.zeros(2, 4, requires_grad=True)
    comm.all_gather(x, 0).sum().backward()
    comm.all_to_all(torch.zeros(3, 4, requires_grad=True)).sum().backward()
    assert comm.calls == {("all_gather", 6 * 4 * 4, 1, 3): 1, ("reduce_scatter", 6 * 4 * 4, 1, 3): 1,
                          ("all_to_all", 3 * 4 * 4, 1, 3): 2}
