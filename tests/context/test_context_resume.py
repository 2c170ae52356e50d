"""Resuming across context degrees: ``parallel.context`` may change on ``--resume``. The
sampler draws a step's global batch as one list of windows whatever the number of
data-parallel ranks (world / context), so every step trains the same windows, byte for
byte; the state is ZeRO-sharded over all world ranks, so nothing is resharded at the same
world size; the loss and weights are the uninterrupted run's up to summation order."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from mct.data.corpus import Corpus
from mct.data.sampler import BatchSampler
from mct.persistence.resume import resume_config
from mct.persistence.run_dir import step_dir
from tests.persistence.test_resume import _launch, _rel_diff, _rows, _write_corpus, tiny_run


def _step_bytes(sampler: BatchSampler, step: int, data_world: int) -> bytes:
    """Every window the data-parallel ranks train at ``step``, rank by rank, micro-batch by micro-batch."""
    return b"".join(t.numpy().tobytes() for r in range(data_world) for mb in sampler.micro_batches(step, r)
                    for t in mb)


@pytest.mark.parametrize("packing", ["stream", "documents"])
def test_each_step_trains_the_same_window_bytes_at_every_context_degree(packing):
    tokens = (np.arange(4000) * 7 % 251).astype(np.uint16)
    corpus = Corpus(train=tokens[:3600], val=tokens[3600:], train_files=["a", "b"], val_files=["c"],
                    fingerprint="", source="test", min_vocab_size=251,
                    train_bounds=np.array([0, 700, 3600]), val_bounds=np.array([0, 400]))
    world, global_micro = 4, 4
    by_degree = {}
    for degree in (1, 2, 4):
        data_world = world // degree  # what the trainer hands the sampler (mct.context.data_parallel)
        s = BatchSampler(corpus, seq_len=16, micro_batch_size=2, grad_accum=global_micro // data_world,
                         world_size=data_world, seed=3, packing=packing)
        by_degree[degree] = [_step_bytes(s, step, data_world) for step in range(3)]
    assert by_degree[1] == by_degree[2] == by_degree[4]
    assert by_degree[1][0] != by_degree[1][1]  # steps differ: the comparison can fail


def test_resume_sets_the_accumulation_for_the_new_degree_and_refuses_one_the_world_cannot_hold(tmp_path):
    d = tiny_run(_write_corpus(tmp_path / "corpus"), steps=2, checkpoint_every=2, eval_every=0)
    d["model"]["dropout"] = 0.0
    run = tmp_path / "run"
    _launch(1, d, run)  # 1 rank x 1 micro-batch: one window group a step
    cfg = resume_config(run, ["parallel.context=2"], 2)
    assert (cfg.parallel.context, cfg.data.grad_accum) == (2, 1)  # one data-parallel group of 2 ranks
    with pytest.raises(ValueError, match="parallel.context = 2.*cannot split evenly"):
        resume_config(run, ["parallel.context=2"], 1)


@pytest.mark.multirank
def test_a_run_resumed_at_another_context_degree_ends_where_the_uninterrupted_run_ends(tmp_path):
    d = tiny_run(_write_corpus(tmp_path / "corpus"), steps=4, checkpoint_every=2, eval_every=0)
    d["model"]["dropout"] = 0.0  # dropout draws each rank's masks: another degree, other masks
    d["zero"] = {"stage": 3}
    whole = tmp_path / "whole"
    _launch(2, d, whole)  # degree 1: 2 data-parallel ranks
    run = tmp_path / "resumed"
    shutil.copytree(whole, run)
    shutil.rmtree(step_dir(run, 4))
    _launch(2, d, run, ["parallel.context=2"])  # steps 3-4 at degree 2: 1 group of 2 ranks, 2 micro-batches
    assert 0 <= _rel_diff(run / "model.safetensors", whole / "model.safetensors") < 1e-6
    rows, ref = _rows(run), _rows(whole)
    assert [r["step"] for r in rows] == list(range(4))
    assert all(abs(a["loss"] - b["loss"]) < 1e-6 for a, b in zip(rows, ref))
