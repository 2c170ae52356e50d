"""The context group's collectives are measured as the group calls them, within groups of
the world's ranks: every kind the time model prices gets a latency and a bandwidth."""

from __future__ import annotations

import pytest

from mct.machine.collectives import GROUP_KINDS, measure_group_collectives


@pytest.mark.multirank
def test_group_collectives_of_two_ranks_give_every_kind_a_latency_and_a_bandwidth():
    got = measure_group_collectives(2, (2,), timeout_s=120)
    assert set(got) == {2} and set(got[2]) == set(GROUP_KINDS)
    for kind, (latency, bandwidth) in got[2].items():
        assert 0 < latency < 1.0 and bandwidth > 1e6, (kind, latency, bandwidth)
