"""Checkpoints of an offloaded engine stream: save reads one stored piece at a time,
load stages one unit at a time in the store, and a load that fails part-way leaves the
engine exactly as it was."""

from __future__ import annotations

import pytest
import torch

from mct.engine import Engine
from mct.models.gpt import GPT, gpt_loss, optimizer_groups
from mct.offload.runtime import OffloadedState
from mct.persistence import shards
from tests.helpers import adamw, batches, tiny_config


def _engine(tmp_path, tier: str = "disk") -> Engine:
    cfg = tiny_config(zero={"stage": 3}, precision={"mode": "bf16"},
                      offload={"optimizer": tier, "params": tier, "dir": str(tmp_path / "offload"), "chunk_mb": 0.002})
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model)
    return Engine(model, adamw, cfg, param_groups=optimizer_groups(model, 0.1))


def _bits(engine: Engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.full_state_dict().items()}


@pytest.fixture
def never_resident(monkeypatch):
    """Fail the test if anything makes the whole offloaded state resident."""
    def refuse(*args, **kwargs):
        raise AssertionError("the whole offloaded state was read back")
    monkeypatch.setattr(OffloadedState, "resident_state", refuse)
    monkeypatch.setattr(OffloadedState, "masters_resident", refuse)
    reads: list[int] = []
    real = shards.load_pieces

    def counting(template, extents, path):
        reads.append(len({k.split("/")[0] for k in template}))
        return real(template, extents, path)
    monkeypatch.setattr(shards, "load_pieces", counting)
    return reads


def test_offloaded_save_and_load_never_read_the_whole_state_and_resume_bit_identically(tmp_path, never_resident):
    a = _engine(tmp_path)
    for s in range(2):
        a.train_step(batches(s, 0), gpt_loss)
    a.save(str(tmp_path / "ckpt"))
    want = a.train_step(batches(2, 0), gpt_loss)
    b = _engine(tmp_path)
    b.load(str(tmp_path / "ckpt"))
    assert never_resident and max(never_resident) == 1  # one unit's pieces per read
    got = b.train_step(batches(2, 0), gpt_loss)
    assert (got.loss, got.grad_norm) == (want.loss, want.grad_norm)
    a.close()
    b.close()


def test_an_offloaded_load_that_fails_in_a_later_unit_leaves_the_engine_untouched(tmp_path, monkeypatch):
    a = _engine(tmp_path)
    a.train_step(batches(0, 0), gpt_loss)
    a.save(str(tmp_path / "ckpt"))
    b = _engine(tmp_path)
    b.train_step(batches(5, 0), gpt_loss)
    before = _bits(b)
    real = shards.load_pieces
    calls: list[int] = []

    def poisoned_last_unit(template, extents, path):
        out = real(template, extents, path)
        calls.append(1)
        if len(calls) == len(b.sharded.units):  # every earlier unit was read and staged already
            master = next(k for k in out if k.endswith("/master"))
            out[master][0] = float("nan")
        return out
    monkeypatch.setattr(shards, "load_pieces", poisoned_last_unit)
    with pytest.raises(ValueError, match="non-finite"):
        b.load(str(tmp_path / "ckpt"))
    monkeypatch.setattr(shards, "load_pieces", real)
    after = _bits(b)
    assert all(torch.equal(before[k], after[k]) for k in before)
    c = _engine(tmp_path)  # the same engine state, never offered a bad checkpoint: the same next step
    c.train_step(batches(5, 0), gpt_loss)
    assert b.train_step(batches(6, 0), gpt_loss).loss == c.train_step(batches(6, 0), gpt_loss).loss
    for e in (a, b, c):
        e.close()


def two_rank_checks(rank: int, world: int, tmp: str) -> dict[str, bool]:
    """Run inside a 2-rank job (tests/offload/test_offload.py's): a stage-3 engine with optimizer
    and parameters on disk saves, a fresh one loads it (each rank reading and staging
    its own element ranges unit by unit) and takes the same next step; the streamed
    weights export equals ``save_file`` of the full state dict, byte for byte."""
    from pathlib import Path

    from safetensors.torch import save_file

    from mct.persistence.export import export_engine
    a, b = _engine(Path(tmp) / "a"), _engine(Path(tmp) / "b")
    a.train_step(batches(0, rank), gpt_loss)
    a.save(f"{tmp}/streamed")
    export_engine(a, f"{tmp}/streamed.safetensors")
    want_file = False
    if rank == 0:
        save_file({k: v.clone() for k, v in a.full_state_dict().items()}, f"{tmp}/want.safetensors")
        want_file = Path(f"{tmp}/streamed.safetensors").read_bytes() == Path(f"{tmp}/want.safetensors").read_bytes()
    else:
        a.full_state_dict()  # collective
    want = a.train_step(batches(1, rank), gpt_loss)
    b.load(f"{tmp}/streamed")
    got = b.train_step(batches(1, rank), gpt_loss)
    a.close()
    b.close()
    return {"export_equals_save_file": want_file or rank != 0,
            "load_then_step_equal": (got.loss, got.grad_norm) == (want.loss, want.grad_norm)}


@pytest.mark.parametrize("stage", [0, 3])
def test_a_resident_load_reads_one_unit_at_a_time_checks_all_first_and_resumes_bit_identically(tmp_path, monkeypatch,
                                                                                                stage):
    # never a second copy of the rank's state: pass 1 checks every unit, pass 2 reads each into place
    def engine() -> Engine:
        cfg = tiny_config(zero={"stage": stage}, precision={"mode": "bf16"})
        torch.manual_seed(cfg.seed)
        model = GPT(cfg.model)
        return Engine(model, adamw, cfg, param_groups=optimizer_groups(model, 0.1))
    a = engine()
    for s in range(2):
        a.train_step(batches(s, 0), gpt_loss)
    a.save(str(tmp_path / "ckpt"))
    want = a.train_step(batches(2, 0), gpt_loss)
    b = engine()
    b.train_step(batches(7, 0), gpt_loss)
    before = _bits(b)
    real, reads = shards.load_pieces, []

    def poisoned(template, extents, path):
        out = real(template, extents, path)
        reads.append(len({k.split("/")[0] for k in template}))
        if len(reads) == len(b.sharded.units):  # pass 1, the last unit: nothing may have changed yet
            out[next(k for k in out if k.endswith("/master"))][0] = float("nan")
        return out
    monkeypatch.setattr(shards, "load_pieces", poisoned)
    with pytest.raises(ValueError, match="non-finite"):
        b.load(str(tmp_path / "ckpt"))
    assert all(torch.equal(v, before[k]) for k, v in _bits(b).items())
    monkeypatch.setattr(shards, "load_pieces", lambda t, e, p: (reads.append(len({k.split("/")[0] for k in t})),
                                                                 real(t, e, p))[1])
    reads.clear()
    b.load(str(tmp_path / "ckpt"))
    assert reads == [1] * (2 * len(b.sharded.units))  # two passes, one unit per read
    got = b.train_step(batches(2, 0), gpt_loss)
    assert (got.loss, got.grad_norm) == (want.loss, want.grad_norm)


def test_a_stage3_rollback_snapshot_lives_on_disk_and_restores_bit_identically(tmp_path):
    from mct.run.rollback import cpu_copy
    cfg = tiny_config(zero={"stage": 3}, precision={"mode": "bf16"}, offload={"dir": str(tmp_path / "snap")})
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model)
    e = Engine(model, adamw, cfg, param_groups=optimizer_groups(model, 0.1))
    e.train_step(batches(0, 0), gpt_loss)
    handle = cpu_copy(e.snapshot_state("snapshot0"))
    leaves = torch.utils._pytree.tree_leaves(handle)
    assert not any(isinstance(v, torch.Tensor) for v in leaves)  # nothing of the state stays in memory
    want = e.train_step(batches(1, 0), gpt_loss)
    e.train_step(batches(2, 0), gpt_loss)
    e.load_snapshot_state(handle)
    got = e.train_step(batches(1, 0), gpt_loss)
    assert (got.loss, got.grad_norm) == (want.loss, want.grad_norm)
    e.close()
    assert not (tmp_path / "snap").exists()  # the store's folder, made for it, leaves with it
