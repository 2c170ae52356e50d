"""``mct.dist.agree``: the one rank-agreement step every collective check goes through."""

from __future__ import annotations

import pytest

from mct.dist import agree


class Gathered:
    """A stand-in communicator: ``all_gather_object`` answers what each rank would hand in."""

    def __init__(self, per_rank: list) -> None:
        self.per_rank = per_rank

    def all_gather_object(self, obj):
        return list(self.per_rank)


def test_agree_raises_the_lowest_failing_ranks_error_on_every_rank_after_on_error():
    cleaned: list[int] = []
    with pytest.raises(ValueError, match="^rank 1 is full$"):
        agree(None, Gathered([None, "rank 1 is full", "rank 2 is full"]), on_error=lambda: cleaned.append(1))
    assert cleaned == [1]
    agree(None, Gathered([None, None]), on_error=lambda: cleaned.append(2))  # nobody failed: nothing runs
    assert cleaned == [1]


def test_agree_without_a_group_is_this_process_alone():
    agree(None)
    with pytest.raises(ValueError, match="^bad path$"):
        agree("bad path")
