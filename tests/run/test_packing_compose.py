"""Packed documents compose with the engine: ZeRO stages 2 and 3 train as stage 0, the
'all', 'selective' and 'sqrt' checkpointing policies as 'none' (the recompute sees the same
mask), also with the kept inputs offloaded to disk, two ranks as one, chunked loss as the
whole loss, on the sampler's real packed windows (tiny GPT, dropout on, two steps)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mct.data.sampler import build_data
from mct.engine import Engine
from mct.models.gpt import GPT, gpt_loss
from mct.task.gpt import step_batches
from mct.task.seeding import seeded
from mct.task.tokens import loss_for
from tests.distributed import run_distributed
from tests.helpers import one_thread, tiny_config  # noqa: F401 (one_thread: autouse fixture)

STEPS = 2


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    """Twenty text files of 3..40 bytes: several documents in every 16-token window."""
    d = tmp_path_factory.mktemp("docs")
    rng = np.random.default_rng(0)
    for i in range(20):
        (d / f"doc{i:02d}.txt").write_text("".join(chr(97 + int(c)) for c in rng.integers(0, 26, rng.integers(3, 40))))
    return d


def _cfg(corpus_dir: Path, data: dict | None = None, **sections):
    return tiny_config(model={"dropout": 0.1}, data={"path": str(corpus_dir), "packing": "documents",
                                                      "micro_batch_size": 2, **(data or {})}, **sections)


def _train(corpus_dir: Path, chunk: int = 0, rank: int = 0, world: int = 1, **sections) -> dict:
    cfg = _cfg(corpus_dir, **sections)
    _, sampler = build_data(cfg, world)
    torch.manual_seed(cfg.seed)
    engine = Engine(GPT(cfg.model), lambda g: torch.optim.SGD(g, lr=0.1), cfg)
    loss_fn = seeded(loss_for(tiny_config(train={"loss_chunk_tokens": chunk}), gpt_loss))
    losses = [engine.train_step(step_batches(sampler, cfg, s, rank), loss_fn).loss for s in range(STEPS)]
    return {"losses": losses, "state": {k: v.clone() for k, v in engine.full_state_dict().items()}}


def _rank_stage3(rank: int, world: int, corpus_dir: Path) -> dict:
    """One rank's result, tensors as numpy arrays: they cross the process boundary by value
    (a shared-memory tensor would outlive its process)."""
    out = _train(corpus_dir, rank=rank, world=world, zero={"stage": 3}, data={"micro_batch_size": 1})
    return {"losses": out["losses"], "state": {k: v.numpy() for k, v in out["state"].items()}}


@pytest.fixture(scope="module")
def reference(corpus_dir) -> dict:
    return _train(corpus_dir)


def test_the_windows_pack_several_documents(corpus_dir):
    cfg = _cfg(corpus_dir)
    _, sampler = build_data(cfg)
    x, y, seg = sampler.batch(0, 0, 0)
    assert seg.shape == x.shape == y.shape and int(seg.max()) >= 1


@pytest.mark.parametrize("label,sections", [("stage3", {"zero": {"stage": 3}}),
                                            ("policy_all", {"checkpointing": {"policy": "all"}}),
                                            ("stage3_all", {"zero": {"stage": 3}, "checkpointing": {"policy": "all"}}),
                                            ("all_to_disk", {"checkpointing": {"policy": "all", "offload": "disk"}}),
                                            ("selective", {"checkpointing": {"policy": "selective"}}),
                                            ("stage2_sqrt", {"zero": {"stage": 2}, "checkpointing": {"policy": "sqrt"}})])
def test_packed_training_matches_stage0_without_checkpointing(corpus_dir, reference, label, sections):
    got = _train(corpus_dir, **sections)
    assert got["losses"] == reference["losses"], label
    for name, t in reference["state"].items():
        assert torch.equal(got["state"][name], t), f"{label}: {name} differs"


@pytest.mark.multirank
def test_two_ranks_on_stage3_train_the_global_batch_of_one_rank_on_stage0(corpus_dir):
    """The same 2 windows a step: two ranks of one window (ZeRO-3, gloo) against one rank
    of two (stage 0). The mean over ranks is the mean over the two windows' losses."""
    one = _train(corpus_dir, data={"micro_batch_size": 1, "grad_accum": 2})
    two = run_distributed(_rank_stage3, 2, corpus_dir)
    np.testing.assert_allclose(two[0]["losses"], one["losses"], rtol=1e-6)
    for name, t in one["state"].items():
        torch.testing.assert_close(torch.from_numpy(two[0]["state"][name]), t, rtol=1e-5, atol=1e-6)


def test_chunked_loss_ignores_the_same_boundary_targets(corpus_dir, reference):
    got = _train(corpus_dir, chunk=7)
    np.testing.assert_allclose(got["losses"], reference["losses"], rtol=1e-5)
    for name, t in reference["state"].items():
        torch.testing.assert_close(got["state"][name], t, rtol=1e-5, atol=1e-6)
