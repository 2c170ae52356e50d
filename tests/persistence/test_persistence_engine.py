"""Engine.save / Engine.load: exact round trip, resharding on load, and clear errors
with the engine untouched for every damaged or mismatched checkpoint."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

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


def _full(e: Engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in e.full_state_dict().items()}


def _opt_state(e: Engine) -> list[torch.Tensor]:
    return [v.clone() for s in e.optimizer.state.values() for v in s.values()]


@pytest.mark.parametrize("stage", [0, 3])
def test_save_then_load_resumes_bitwise(tmp_path, stage):
    a = _engine(zero={"stage": stage}, precision={"mode": "bf16"})
    for step in range(2):
        a.train_step(batches(step, 0), gpt_loss)
    a.save(str(tmp_path / "ck"))
    a.save(str(tmp_path / "ck"))  # saving over a checkpoint replaces it whole
    b = _engine(zero={"stage": stage}, precision={"mode": "bf16"})
    b.load(str(tmp_path / "ck"))
    assert b.steps_done == 2
    assert b.tracker.live()["optimizer"] == a.tracker.live()["optimizer"] > 0  # loaded state is counted
    for step in (2, 3):  # both continue identically
        assert a.train_step(batches(step, 0), gpt_loss).loss == b.train_step(batches(step, 0), gpt_loss).loss
    sa, sb = a.full_state_dict(), b.full_state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def _damage(ck: Path):
    """(expected message, function that damages a copy of the checkpoint)."""
    def truncate(p): p.write_bytes(p.read_bytes()[:-7])
    def zero(p): p.write_bytes(b"")
    yield "not a complete checkpoint", lambda d: (d / "meta.json").unlink()
    yield "bytes", lambda d: truncate(d / "engine" / "__0_0.distcp")
    yield "0 bytes", lambda d: zero(d / "engine" / "__0_0.distcp")
    yield "sha256", lambda d: (d / "rank0.json").write_text((d / "rank0.json").read_text().replace("0", "1"))
    yield "not valid JSON", lambda d: (d / "meta.json").write_text("{")
    yield "lists no rank1.json", lambda d: (d / "meta.json").write_text(
        json.dumps({**json.loads((d / "meta.json").read_text()), "world_size": 2}))


def test_damaged_checkpoints_fail_with_the_file_and_leave_the_engine_untouched(tmp_path):
    import shutil
    src = _engine()
    src.train_step(batches(0, 0), gpt_loss)
    src.save(str(tmp_path / "good"))
    e = _engine()
    for step in range(2):
        e.train_step(batches(step, 3), gpt_loss)
    before, opt = _full(e), _opt_state(e)
    for i, (match, damage) in enumerate(_damage(tmp_path / "good")):
        d = tmp_path / f"bad{i}"
        shutil.copytree(tmp_path / "good", d)
        damage(d)
        with pytest.raises(ValueError, match=match):
            e.load(str(d))
        after = _full(e)
        assert all(torch.equal(before[k], after[k]) for k in before), match
        assert all(torch.equal(a, b) for a, b in zip(opt, _opt_state(e))) and e.steps_done == 2
    for model, match in (({"n_layer": 3}, "no parameter"), ({"d_model": 48}, "has shape")):
        with pytest.raises(ValueError, match=match):
            _engine(model=model).load(str(tmp_path / "good"))


def test_metadata_pickle_cannot_run_code(tmp_path):
    e = _engine()
    e.save(str(tmp_path / "ck"))
    payload = pickle.dumps(print)  # any global outside DCP's metadata classes is refused
    meta = tmp_path / "ck" / "engine" / ".metadata"
    meta.write_bytes(payload)
    from mct.persistence.files import file_digest
    m = json.loads((tmp_path / "ck" / "meta.json").read_text())
    m["files"]["engine/.metadata"] = file_digest(meta)
    (tmp_path / "ck" / "meta.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="refused to load builtins.print"):
        e.load(str(tmp_path / "ck"))


def _save_sharded(rank: int, world: int, path: str, stage: int) -> dict:
    e = _engine(zero={"stage": stage}, precision={"mode": "bf16"})
    for step in range(2):
        e.train_step(batches(step, rank), gpt_loss)
    e.save(path)
    return {k: v.numpy() for k, v in _full(e).items()}  # numpy: tensors would cross by shared memory


def _load_sharded(rank: int, world: int, path: str, stage: int) -> tuple[dict, int, float]:
    e = _engine(zero={"stage": stage}, precision={"mode": "bf16"})
    e.load(path)
    full, steps = {k: v.numpy() for k, v in _full(e).items()}, e.steps_done
    return full, steps, e.train_step(batches(2, rank), gpt_loss).loss


@pytest.mark.multirank
@pytest.mark.parametrize("save_world,save_stage,load_world,load_stage",
                         [(2, 3, 1, 0)])  # 2 -> 3 and 1 -> 2 run end to end in test_resume
def test_load_reshards_to_any_world_size_and_stage(tmp_path, save_world, save_stage, load_world, load_stage):
    path = str(tmp_path / "ck")
    if save_world == 1:
        saved = _save_sharded(0, 1, path, save_stage)
    else:
        saved = run_distributed(_save_sharded, save_world, path, save_stage)[0]
    if load_world == 1:
        loaded = [_load_sharded(0, 1, path, load_stage)]
    else:
        loaded = run_distributed(_load_sharded, load_world, path, load_stage)
    for full, steps, loss in loaded:
        assert steps == 2 and all((full[k] == saved[k]).all() for k in saved)  # the state itself is exact
        assert loss == loaded[0][2]
