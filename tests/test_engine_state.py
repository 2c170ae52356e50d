"""Engine.state_dict / load_state_dict: exact round trip, full validation before any change."""

from __future__ import annotations

import copy

import pytest
import torch

from mct.engine import Engine
from mct.models.gpt import GPT, gpt_loss, optimizer_groups
from tests.distributed import run_distributed
from tests.helpers import adamw, batches, tiny_config


def _engine(**sections) -> Engine:
    cfg = tiny_config(**sections)
    torch.manual_seed(0)
    model = GPT(cfg.model)
    return Engine(model, adamw, cfg, param_groups=optimizer_groups(model, 0.1))


def _snapshot(e: Engine) -> dict:
    sd = e.state_dict()
    return {**copy.deepcopy({k: v for k, v in sd.items() if k != "tensors"}),
            "tensors": {k: v.clone() for k, v in sd["tensors"].items()},
            "full": {k: v.clone() for k, v in e.full_state_dict().items()}}


def _same(a: dict, b: dict) -> bool:
    ta, tb = a["tensors"], b["tensors"]
    return (set(ta) == set(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)
            and all(torch.equal(a["full"][k], b["full"][k]) for k in a["full"])
            and {k: v for k, v in a.items() if k not in ("tensors", "full")}
            == {k: v for k, v in b.items() if k not in ("tensors", "full")})


@pytest.mark.parametrize("mode", ["fp32", "fp16"])
def test_state_dict_round_trip_continues_bitwise(mode):
    a = _engine(precision={"mode": mode})
    for step in range(2):
        a.train_step(batches(step, 0), gpt_loss)
    saved = _snapshot(a)
    b = _engine(precision={"mode": mode})
    b.load_state_dict({k: v for k, v in saved.items() if k != "full"})
    assert b.steps_done == 2 and b.scaler.state_dict() == a.scaler.state_dict()
    assert b.tracker.live()["optimizer"] == a.tracker.live()["optimizer"] > 0
    for step in (2, 3):
        assert a.train_step(batches(step, 0), gpt_loss).loss == b.train_step(batches(step, 0), gpt_loss).loss
    sa, sb = a.full_state_dict(), b.full_state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_rollback_to_an_earlier_snapshot_of_the_same_engine():
    e = _engine()
    e.train_step(batches(0, 0), gpt_loss)
    snap = _snapshot(e)
    first = e.train_step(batches(1, 0), gpt_loss).loss
    e.train_step(batches(2, 0), gpt_loss)
    e.load_state_dict({k: v for k, v in snap.items() if k != "full"})
    assert e.steps_done == 1 and e.train_step(batches(1, 0), gpt_loss).loss == first


def _corruptions(sd: dict):
    t = sd["tensors"]
    master = next(k for k in t if k.endswith("/master"))
    yield "format", {**sd, "format": "other"}
    yield "steps_done", {**sd, "steps_done": -1}
    yield "missing tensors", {**sd, "tensors": {k: v for k, v in t.items() if k != master}}
    yield "has shape", {**sd, "tensors": {**t, master: t[master][:-1]}}
    yield "dtype", {**sd, "tensors": {**t, master: t[master].double()}}
    yield "non-finite", {**sd, "tensors": {**t, master: torch.full_like(t[master], float("nan"))}}
    yield "covers elements", {**sd, "extents": {**sd["extents"], master: [1, 5]}}
    yield "different model", {**sd, "units": sd["units"][:-1]}
    yield "param groups", {**sd, "param_groups": sd["param_groups"][:1]}
    yield "scale", {**sd, "scaler": {**sd["scaler"], "scale": float("inf")}}
    last = next(k for k in reversed(list(t)) if k.endswith("/optim/exp_avg"))
    yield "optimizer state differs", {**sd, "tensors": {k: v for k, v in t.items() if k != last}}


def test_failed_loads_leave_the_engine_untouched():
    src = _engine()
    src.train_step(batches(0, 0), gpt_loss)
    good = src.state_dict()
    e = _engine()
    for step in range(2):
        e.train_step(batches(step, 5), gpt_loss)
    before = _snapshot(e)
    for match, bad in _corruptions(good):
        with pytest.raises(ValueError, match=match):
            e.load_state_dict(bad)
        assert _same(_snapshot(e), before), match
    other = _engine(model={"n_layer": 3})
    with pytest.raises(ValueError, match="different model"):
        other.load_state_dict(good)


def _two_rank_round_trip(rank: int, world: int) -> bool:
    return all(_round_trip_at(rank, stage) for stage in (1, 3))


def _round_trip_at(rank: int, stage: int) -> bool:
    a = _engine(zero={"stage": stage}, precision={"mode": "bf16"})
    for step in range(2):
        a.train_step(batches(step, rank), gpt_loss)
    sd = a.state_dict()
    saved = {**sd, "tensors": {k: v.clone() for k, v in sd["tensors"].items()}}
    b = _engine(zero={"stage": stage}, precision={"mode": "bf16"})
    b.load_state_dict(saved)
    la = a.train_step(batches(2, rank), gpt_loss).loss
    lb = b.train_step(batches(2, rank), gpt_loss).loss
    sa, sb = a.full_state_dict(), b.full_state_dict()
    return la == lb and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.multirank
def test_two_rank_round_trip_is_exact_at_stages_1_and_3():
    assert all(run_distributed(_two_rank_round_trip, 2))


@pytest.mark.parametrize("sections", [{}, {"zero": {"stage": 3}}, {"offload": {"optimizer": "cpu"}}],
                         ids=["memory", "stage3-disk", "offload-store"])
def test_a_snapshot_object_restores_itself_wherever_its_copy_lives(sections, tmp_path):
    e = _engine(**sections, **({} if "offload" in sections else {"offload": {"dir": str(tmp_path)}}))
    e.train_step(batches(0, 0), gpt_loss)
    snap = e.snapshot("snapshot0")
    assert snap.tag == (None if not sections else "snapshot0")  # the store tag it occupies
    want = e.train_step(batches(1, 0), gpt_loss)
    e.train_step(batches(2, 0), gpt_loss)
    snap.restore()
    got = e.train_step(batches(1, 0), gpt_loss)
    assert e.steps_done == 2 and (got.loss, got.grad_norm) == (want.loss, want.grad_norm)
    e.close()
