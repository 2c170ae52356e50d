"""What a training process holds beside its tensors that the tracker cannot see, counted by the
dry run for the process model: the rollback snapshots (``train.snapshot_every``: CPU copies of each
rank's fp32 master and optimizer state, ``Residency.snapshot_bytes``) and a forward's churn (the
bytes of activations and temporaries it makes and frees, ``MemoryTracker.churn``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mct.engine import Engine
from mct.memory.process_peak import ProcessModel, snapshots_held
from mct.memory.tracker import MemoryTracker
from mct.offload.snapshot import MemorySnapshot
from mct.planner.dry_run import dry_run
from tests.distributed import run_distributed
from tests.helpers import adamw, tiny_config
from mct.planner import token_loss
from tests.planner_models import random_batch, tied_frozen_reused

MiB = 2**20
B = 3


def _host_bytes(engine: Engine) -> int:
    """The host-memory bytes of the copy ``engine.snapshot()`` makes (0: it is kept on disk or
    in the offload store)."""
    snap = engine.snapshot()
    if not isinstance(snap, MemorySnapshot):
        return 0
    return sum(t.numel() * t.element_size() for t in snap.handle["tensors"].values() if isinstance(t, torch.Tensor))


def _real(rank: int, world: int, cfgs: list) -> list[tuple[int, int]]:
    """Each config's snapshot bytes before the first step and after two, on a real engine."""
    out = []
    for cfg in cfgs:
        torch.manual_seed(0)
        engine = Engine(tied_frozen_reused(), adamw, cfg)
        before = _host_bytes(engine)
        for s in range(2):
            engine.train_step(random_batch(s, rank, B), token_loss)
        out.append((before, _host_bytes(engine)))
        engine.close()
    return out


def _cfgs(tmp_path) -> list:
    return [tiny_config(zero={"stage": s}, precision={"mode": p}, offload={"optimizer": o, "dir": str(tmp_path)})
            for s, p, o in ((0, "fp32", "none"), (0, "bf16", "none"), (2, "fp32", "none"), (3, "fp32", "none"),
                            (0, "fp32", "disk"))]


def test_a_dry_run_counts_a_rollback_snapshot_to_the_byte_on_one_rank(tmp_path):
    """Tied, frozen and re-used parameters; fp32 (the parameters are the masters), bf16 (the
    fp32 masters, not the bf16 parameters), stage 3 and offload (on disk, in the store: 0 in
    host memory); before the first step there is no optimizer state yet."""
    cfgs = _cfgs(tmp_path)
    real = _real(0, 1, cfgs)
    for cfg, got in zip(cfgs, real):
        run = dry_run(tied_frozen_reused, token_loss, random_batch(0, 0, B), cfg, 1, optimizer=adamw)
        assert run.snapshot == got, (cfg.zero.stage, cfg.precision.mode, cfg.offload.optimizer)
    # fp32 AdamW: the masters, then + two moments and a 4-byte step count per flat unit
    assert real[0][0] > 0 and 3 * real[0][0] < real[0][1] <= 3 * real[0][0] + 64
    assert real[1] == real[0]  # bf16 snapshots its fp32 masters: the same bytes
    assert real[3] == real[4] == (0, 0)


@pytest.mark.multirank
def test_a_dry_run_counts_a_sharded_rollback_snapshot_to_the_byte_on_each_of_two_ranks(tmp_path):
    """Stages 1 and 2 snapshot each rank's shard of the masters and of the optimizer state."""
    cfgs = [tiny_config(zero={"stage": s}) for s in (1, 2)]
    real = run_distributed(_real, 2, cfgs)
    for i, cfg in enumerate(cfgs):
        run = dry_run(tied_frozen_reused, token_loss, random_batch(0, 0, B), cfg, 2, optimizer=adamw)
        assert run.snapshot == real[0][i], cfg.zero.stage
        whole = dry_run(tied_frozen_reused, token_loss, random_batch(0, 0, B), cfg, 1, optimizer=adamw)
        assert run.snapshot[1] < whole.snapshot[1]


def test_a_run_holds_the_first_snapshot_then_two_while_a_new_one_waits_for_its_step():
    """snapshot_every 10: step 0 takes one (masters only), step 10 a second beside it, from
    step 20 two full ones; a save comes after a step passed, when one is kept."""
    first, steady = 3 * MiB, 9 * MiB
    assert snapshots_held(10, 4, first, steady) == (first, first)
    assert snapshots_held(10, 10, first, steady) == (first, first)
    assert snapshots_held(10, 11, first, steady) == (first + steady, steady)
    assert snapshots_held(10, 20, first, steady) == (first + steady, steady)
    assert snapshots_held(10, 21, first, steady) == (2 * steady, steady)
    assert snapshots_held(0, 300, first, steady) == (0, 0)  # train.snapshot_every = 0: none in memory
    model = ProcessModel(300 * MiB, "cpu", "default", steps=300, snapshot_every=10)
    phases = {"forward": {"params": MiB, "activations": 50 * MiB}}
    held = model.predict(60 * MiB, phases, offload=False, snapshot=(first, steady))
    bare = dataclasses.replace(model, snapshot_every=0).predict(60 * MiB, phases, offload=False, snapshot=(first, steady))
    assert held.snapshots == 2 * steady and held.total - bare.total == 2 * steady
    cuda = dataclasses.replace(model, device="cuda").predict(60 * MiB, phases, offload=False, snapshot=(first, steady))
    assert cuda.snapshots == 0  # host memory: not what nvidia-smi counts


def test_the_tracker_counts_what_one_entry_of_a_phase_makes_of_transient_bytes():
    """churn: the new activations and temporaries of one entry of a phase, freed or not, the
    most of any entry (micro-batches re-enter the forward); parameters made there are not
    transient; reset with the step (``Engine.train_step``), not with the peaks."""
    tracker = MemoryTracker("cpu")
    with tracker.phase("forward"):
        for _ in range(4):
            a = torch.empty(1000, dtype=torch.float32)  # 4000 bytes, freed at the next turn
        with tracker.category("params"):
            kept = torch.empty(500)
    del a
    with tracker.phase("forward"):
        b = torch.empty(100)
    assert tracker.churn() == {"forward": 16000}
    assert tracker.peaks()["forward"]["activations"] == 8000  # two live at once: the next made before the last goes
    with tracker.phase("backward"):
        with tracker.phase("backward"):  # re-entered inside itself: one entry
            c = torch.empty(10)
        d = torch.empty(10)
    assert tracker.churn()["backward"] == 80
    tracker.reset_peaks()  # a new window of peaks (the depth extrapolation's): the step's churn stays
    assert tracker.churn()["forward"] == 16000
    tracker.reset_churn()
    assert tracker.churn() == {}
    del b, c, d, kept


def test_a_forward_makes_the_same_bytes_with_and_without_recompute():
    """Recomputation frees a forward's activations sooner; it does not make fewer: the churn
    the process model charges a recomputing row is its twin's without recompute."""
    runs = {p: dry_run(tied_frozen_reused, token_loss, random_batch(0, 0, B), tiny_config(checkpointing={"policy": p}), 1)
            for p in ("none", "all")}
    assert runs["all"].peak < runs["none"].peak
    assert runs["all"].churn["forward"] == runs["none"].churn["forward"] > 0
    assert runs["all"].churn["backward"] > runs["none"].churn["backward"]  # the recompute makes them again


def test_a_plan_that_misses_by_its_rollback_snapshots_says_train_snapshot_every_0_fits():
    """A budget the process peak misses only by the snapshots it holds: the advice names the
    setting and what the snapshots hold; with them off, the same row fits."""
    import mct
    from mct.models.gpt import GPT, gpt_loss
    from tests.helpers import batches
    grid = dict(world_size=1, stages=(0,), policies=("none",), precisions=("fp32",))
    cfg = tiny_config(data={"micro_batch_size": 2}, train={"steps": 300})
    x = batches(0, 0, 1, B=2)[0]
    row = mct.plan(lambda: GPT(cfg.model), gpt_loss, x, cfg, **grid).rows[0]
    assert row.rollback_snapshots > 0
    missed = mct.plan(lambda: GPT(cfg.model), gpt_loss, x, cfg, budget=row.process_peak - 1, **grid)
    assert missed.recommended is None and "train.snapshot_every=0" in missed.advice, missed.advice
    off = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, snapshot_every=0))
    fits = mct.plan(lambda: GPT(cfg.model), gpt_loss, x, off, budget=row.process_peak - 1, **grid)
    assert fits.recommended is not None and fits.rows[0].rollback_snapshots == 0
