"""Engine checkpoints: save/load round trip, and clear errors for a bad checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from mct.engine import Engine
from mct.models.gpt import GPT, gpt_loss
from tests.helpers import adamw, batches, tiny_config


def _engine(**sections) -> Engine:
    cfg = tiny_config(**sections)
    torch.manual_seed(0)
    return Engine(GPT(cfg.model), adamw, cfg)


@pytest.mark.parametrize("stage", [0, 3])
def test_save_then_load_resumes_bitwise(tmp_path, stage):
    a = _engine(zero={"stage": stage}, precision={"mode": "bf16"})
    for step in range(2):
        a.train_step(batches(step, 0), gpt_loss)
    a.save(str(tmp_path / "ck"))
    b = _engine(zero={"stage": stage}, precision={"mode": "bf16"})
    b.load(str(tmp_path / "ck"))
    assert b.steps_done == 2
    assert b.tracker.live()["optimizer"] == a.tracker.live()["optimizer"] > 0  # loaded state is counted
    for step in (2, 3):  # both continue identically
        la = a.train_step(batches(step, 0), gpt_loss).loss
        lb = b.train_step(batches(step, 0), gpt_loss).loss
        assert la == lb
    sa, sb = a.full_state_dict(), b.full_state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_load_errors_name_the_problem(tmp_path):
    e = _engine()
    with pytest.raises(ValueError, match="not an mct checkpoint"):
        e.load(str(tmp_path / "nothing"))
    e.save(str(tmp_path / "ck"))
    meta = json.loads((tmp_path / "ck" / "meta.json").read_text())
    (tmp_path / "ck" / "meta.json").write_text(json.dumps({**meta, "world_size": 4}))
    with pytest.raises(ValueError, match="saved with world_size=4"):
        e.load(str(tmp_path / "ck"))
    (tmp_path / "ck" / "meta.json").write_text(json.dumps(meta))
    other = _engine(model={"n_layer": 3})
    with pytest.raises(ValueError, match="different model"):
        other.load(str(tmp_path / "ck"))
    (tmp_path / "ck" / "rank0.pt").unlink()
    with pytest.raises(ValueError, match="no shard for rank 0"):
        e.load(str(tmp_path / "ck"))
