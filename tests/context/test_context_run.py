"""A context-parallel training run: groups of ranks share their windows (the sampler, the
validation and the checkpoint's global batch count world / parallel.context data-parallel
ranks), so 2 context groups of 2 ranks train what one rank trains with 2 micro-batches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mct.config import EngineConfig
from mct.run.trainer import train
from tests.distributed import run_distributed


def _cfg(corpus: Path, **sections: dict) -> EngineConfig:
    d = {"seed": 3, "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 32},
         "data": {"path": str(corpus), "micro_batch_size": 1, "packing": "documents"},
         "train": {"steps": 3, "warmup_steps": 1, "eval_every": 3, "eval_batches": 2, "log_every": 1}}
    for k, v in sections.items():
        d.setdefault(k, {}).update(v)
    return EngineConfig.from_dict(d)


def _losses(run: Path) -> tuple[list[float], list[float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r], [r["val_loss"] for r in rows if "val_loss" in r]


def _context_rank(rank: int, world: int, corpus: Path, run: Path) -> None:
    train(_cfg(corpus, parallel={"context": 2}, zero={"stage": 3}), run, progress=False)


@pytest.mark.multirank
def test_two_context_groups_train_the_global_batch_of_one_rank(tmp_path):
    corpus = tmp_path / "docs"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    for i in range(40):
        (corpus / f"d{i:02d}.txt").write_text("".join(chr(97 + int(c)) for c in rng.integers(0, 26, rng.integers(5, 50))))
    train(_cfg(corpus, data={"grad_accum": 2}), tmp_path / "one", progress=False)
    run_distributed(_context_rank, 4, corpus, tmp_path / "four", timeout=300)
    one, four = _losses(tmp_path / "one"), _losses(tmp_path / "four")
    assert len(one[0]) == 3 and len(one[1]) == 2  # validation at steps 0 and 2
    np.testing.assert_allclose(four[0], one[0], rtol=1e-6)
    np.testing.assert_allclose(four[1], one[1], rtol=1e-6)
