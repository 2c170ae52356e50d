"""The sampler's packed windows (``data.packing = 'documents'``): on a grid, document
ids from the corpus's real boundaries (a prepared dataset's docs.idx, each raw file),
a prepared document's last token predicting its EOS, no target across a boundary,
validation packed alike, and 'stream' windows unchanged."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mct.config import EngineConfig
from mct.data.packing import IGNORE_INDEX
from mct.data.pipeline import prepare
from mct.data.sampler import BatchSampler, build_data

T = 16


def _texts(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for i in range(120):
        (d / f"f{i:02d}.txt").write_text(f"<{i}>" + "xy" * (i % 7))  # 4..17 bytes
    return d


def _cfg(path: Path, packing: str = "documents") -> EngineConfig:
    return EngineConfig.from_dict({"model": {"seq_len": T, "vocab_size": 512},
                                   "data": {"path": str(path), "micro_batch_size": 4, "packing": packing}})


def _check_windows(sampler: BatchSampler, split: str, offsets: np.ndarray, batch: tuple, eos: int | None) -> None:
    tokens = sampler.corpus.train if split == "train" else sampler.corpus.val
    bounds = sampler.corpus.bounds(split)
    x, y, seg = (t.numpy() for t in batch)
    for row, o in enumerate(offsets):
        assert o % T == 0  # the grid: every token an input once per pass
        idx = np.arange(o, o + T)
        doc = np.searchsorted(bounds, idx, side="right") - 1
        assert (seg[row] == doc - doc[0]).all()
        assert (x[row] == tokens[idx]).all()
        last = np.isin(idx + 1, bounds)  # the next token starts another document
        assert (y[row][last] == IGNORE_INDEX).all()
        assert (y[row][~last] == tokens[idx + 1][~last]).all()
        if eos is not None:  # a document's last token is its EOS, which the token before predicts
            assert (x[row][last] == eos).all()
            before = np.isin(idx + 2, bounds) & (idx + 2 <= o + T)
            assert (y[row][before] == eos).all()


def test_raw_files_are_documents_and_no_target_crosses_one(tmp_path):
    corpus_dir = _texts(tmp_path / "t")
    _, sampler = build_data(_cfg(corpus_dir))
    assert sampler.corpus.bounds("train").size == len(sampler.corpus.train_files) + 1
    for step in range(3):
        _check_windows(sampler, "train", sampler.step_offsets(step)[0, 0], sampler.batch(step, 0, 0), None)
    _check_windows(sampler, "val", sampler.val_offsets(0), sampler.val_batch(0), None)


def test_prepared_documents_end_with_eos_which_their_last_token_predicts(tmp_path):
    ds = tmp_path / "ds"
    meta = prepare([str(_texts(tmp_path / "t"))], str(ds), progress=False)
    _, sampler = build_data(_cfg(ds))
    for step in range(3):
        _check_windows(sampler, "train", sampler.step_offsets(step)[0, 0], sampler.batch(step, 0, 0), meta["eos_id"])
    _check_windows(sampler, "val", sampler.val_offsets(1), sampler.val_batch(1), meta["eos_id"])


def test_step_stats_count_windows_documents_and_boundary_targets(tmp_path):
    _, sampler = build_data(_cfg(_texts(tmp_path / "t")))
    stats = sampler.step_stats(2)
    batch = sampler.batch(2, 0, 0)
    assert stats["real_tokens"] == 4 * T and stats["padding_tokens"] == 0
    assert stats["target_tokens"] == int((batch[1] != IGNORE_INDEX).sum())
    assert stats["docs_per_window"] == pytest.approx(float((batch[2][:, -1] + 1).float().mean()))


def test_stream_windows_are_unchanged_pairs_at_any_offset(tmp_path):
    corpus_dir = _texts(tmp_path / "t")
    _, stream = build_data(_cfg(corpus_dir, "stream"))
    offsets = stream.step_offsets(0)[0, 0]
    x, y = stream.batch(0, 0, 0)
    tokens = stream.corpus.train
    for row, o in enumerate(offsets):
        assert torch.equal(x[row], torch.from_numpy(tokens[o:o + T].astype(np.int64)))
        assert torch.equal(y[row], torch.from_numpy(tokens[o + 1:o + T + 1].astype(np.int64)))
    assert any(o % T for o in stream.step_offsets(1).reshape(-1))  # not restricted to the grid


def test_an_unknown_packing_is_one_line_naming_the_key():
    with pytest.raises(ValueError, match=r"data.packing = 'whole' is not allowed: must be 'stream' or 'documents'"):
        EngineConfig.from_dict({"data": {"packing": "whole"}})
    assert EngineConfig.from_dict({}).data.packing == "stream"


def test_a_corpus_too_small_for_packed_windows_says_they_start_on_a_grid(tmp_path):
    d = tmp_path / "small"
    d.mkdir()
    for i in range(8):
        (d / f"f{i}.txt").write_text("abcdefgh" * 4)  # 32 bytes: 256 in all
    cfg = EngineConfig.from_dict({"model": {"seq_len": T}, "seed": 1,
                                  "data": {"path": str(d), "micro_batch_size": 20, "packing": "documents"}})
    with pytest.raises(ValueError, match=f"data.packing = 'documents' starts windows every {T} tokens"):
        build_data(cfg)
    build_data(EngineConfig.from_dict({**cfg.to_dict(), "data": {**cfg.to_dict()["data"], "packing": "stream"}}))
