"""QLoRA: the frozen linear weights stored as NF4 in the frozen units (``mct.adapters.qlora``).

Metrics: parity with the fp32 reference on the same dequantized base (``mct verify``) within
1e-6 at stages 0 and 3 on 1 rank and at stage 3 on 2 gloo ranks; the base's stored bytes
(the tracker's 'frozen' category) <= 0.57 bytes per quantized element, padding counted; the
planner's dry run equal to the run's tracker peak, to the byte (stage 0 too: the base's
whole parameters count as 'frozen' in the run as in the dry run)."""

from __future__ import annotations

import pytest
import torch

import mct
from mct.adapters.qlora import dequantize_base, nf4_weights
from mct.config import EngineConfig
from mct.engine import Engine
from mct.quant import NF4Codec, round_trip
from mct.task import build_model, seeded, task_for
from tests.adapters.test_lora_exact import STEPS, lora_config, write_corpus
from tests.distributed import run_distributed
from tests.helpers import TINY_MODEL


def qlora_config(data_path: str, **sections: dict) -> EngineConfig:
    return lora_config(data_path, adapter={"kind": "qlora"}, **sections)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("qlora") / "corpus.txt")


def _engine(cfg: EngineConfig) -> tuple[Engine, dict[str, torch.Tensor]]:
    """An engine of ``cfg``'s task and the model's initial values (before packing)."""
    task = task_for(cfg)
    model, program = build_model(task, cfg, on_meta=False)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    return Engine(model, task.optimizer, cfg, param_groups=task.param_groups(model), init_program=program), start


def test_nf4_weights_are_the_frozen_linear_weights_inside_the_blocks():
    cfg = EngineConfig.from_dict({"model": dict(TINY_MODEL), "adapter": {"kind": "qlora"}})
    model, _ = build_model(task_for(cfg), cfg, on_meta=False)
    names = nf4_weights(model)
    assert names and all(n.startswith("blocks.") and n.endswith(".weight") and "lora_" not in n for n in names)
    params = dict(model.named_parameters())
    assert all(params[n].dim() == 2 and not params[n].requires_grad for n in names)
    assert "wte.weight" not in names and not any(".ln" in n for n in names)


def test_qlora_on_a_model_without_blocks_is_refused():
    import torch.nn as nn
    from mct.adapters.qlora import nf4_codecs
    cfg = EngineConfig.from_dict({"adapter": {"kind": "qlora"}})
    with pytest.raises(ValueError, match="adapter.kind = 'qlora' .* use adapter.kind = 'lora'"):
        nf4_codecs(nn.Sequential(nn.Linear(4, 4)).requires_grad_(False), cfg.adapter)


@pytest.mark.parametrize("stage", [0, 3])
def test_the_engine_computes_on_the_base_the_reference_is_given(stage):
    cfg = EngineConfig.from_dict({"model": dict(TINY_MODEL), "adapter": {"kind": "qlora"}, "zero": {"stage": stage}})
    engine, start = _engine(cfg)
    assert engine.frozen.units and all(u.name.endswith("/frozen-nf4") for u in engine.frozen.units
                                       if u.name != "root/frozen" and not u.name.endswith("/frozen"))
    state = engine.full_state_dict()
    names = nf4_weights(engine.model)
    ref, _ = build_model(task_for(cfg), cfg, on_meta=False)
    assert dequantize_base(ref, cfg.adapter, torch.float32) == names
    ref_state = dict(ref.named_parameters())
    for n in names:
        assert torch.equal(state[n], round_trip(start[n])) and torch.equal(state[n], ref_state[n]), n
        assert not torch.equal(state[n], start[n]), n  # quantized: the check above is not vacuous
    others = [n for n in state if n not in names]
    assert others and all(torch.equal(state[n], start[n]) for n in others)


@pytest.mark.parametrize("stage", [0, 3])
def test_qlora_fp32_on_one_rank_matches_the_reference_within_1e_6(corpus, stage):
    from mct.verify.compare import run_verify
    report = run_verify(qlora_config(corpus, zero={"stage": stage}), STEPS)
    assert report.passed and report.max_loss_rel <= 1e-6 and report.param_rel <= 1e-6, report.table()
    assert report.frozen > 0 and not report.frozen_changed


def _stage3(rank: int, world: int, data_path: str) -> dict:
    from mct.verify.compare import run_verify
    report = run_verify(qlora_config(data_path, zero={"stage": 3}), STEPS)
    engine, _ = _engine(qlora_config(data_path, zero={"stage": 3}))
    nf4 = [u for u in engine.frozen.units if u.name.endswith("/frozen-nf4")]
    return {"report": report, "nf4_stored": sum(u.stored_nbytes() for u in nf4),
            "nf4_padded": sum(u.layout.padded_numel for u in nf4),
            "nf4_params": sum(p.numel() for u in nf4 for p in u.params),
            "frozen_live": engine.tracker.live()["frozen"], "frozen_stored": engine.frozen.stored_bytes()}


@pytest.mark.multirank
def test_qlora_fp32_stage3_on_two_ranks_matches_the_reference_and_stores_nf4_shards(corpus):
    got = run_distributed(_stage3, 2, corpus, timeout=300)[0]
    report = got["report"]
    assert report.passed and report.max_loss_rel <= 1e-6 and report.param_rel <= 1e-6, report.table()
    assert not report.frozen_changed
    # each rank keeps half of every NF4 unit: 0.516 B an element, the per-weight padding counted
    assert got["nf4_stored"] == NF4Codec().stored_bytes(got["nf4_padded"]) // 2
    assert got["nf4_stored"] <= 0.57 * got["nf4_padded"] / 2
    assert got["nf4_padded"] >= got["nf4_params"]
    assert got["frozen_live"] == got["frozen_stored"]  # between steps: the stored shards only


def _peaks(rank: int, world: int, data_path: str, stages: tuple[int, ...]) -> dict:
    from mct.task.gpt import step_batches
    from mct.data import build_data
    out = {}
    for stage in stages:
        cfg = qlora_config(data_path, zero={"stage": stage}, precision={"mode": "bf16"})
        engine, _ = _engine(cfg)
        task = task_for(cfg)
        _, sampler = build_data(cfg, world)
        loss_fn = seeded(task.loss_fn)
        m = [engine.train_step(step_batches(sampler, cfg, s, rank), loss_fn).metrics for s in range(2)]
        out[stage] = (m[1]["peak_bytes"], m[1]["peaks"])
    return out


@pytest.mark.multirank
def test_planned_peak_equals_the_qlora_run_tracker_peak_on_2_ranks(corpus):
    from mct.data import build_data
    from mct.task.gpt import step_batches
    stages = (0, 3)
    measured = run_distributed(_peaks, 2, corpus, stages, timeout=300)[0]
    for stage in stages:
        cfg = qlora_config(corpus, zero={"stage": stage}, precision={"mode": "bf16"})
        task = task_for(cfg)
        _, sampler = build_data(cfg, 2)
        batch = step_batches(sampler, cfg, 1, 0)  # rank 0's micro-batches of the measured step
        pred = mct.predict_peak(task.model_fn, seeded(task.loss_fn), batch, cfg, world_size=2, optimizer=task.optimizer,
                                param_groups=task.param_groups)
        peak, by_phase = measured[stage]
        assert any(p.get("frozen", 0) > 0 for p in by_phase.values()), stage
        assert pred == peak, (stage, pred, peak)


def test_init_from_a_qlora_checkpoint_keeps_the_nf4_bytes_it_saved(tmp_path):
    """A checkpoint holds the decoded base; ``--init-from`` it keeps the NF4 bytes where the
    values are the ones they decode to (encoding them again would move them: NF4 is not
    idempotent), so the run continues on the base it saved."""
    from mct.data import build_data
    from mct.persistence.init_from import load_pretrained
    from mct.task.gpt import step_batches
    cfg = qlora_config(write_corpus(tmp_path / "c.txt"), zero={"stage": 3})
    task = task_for(cfg)
    _, sampler = build_data(cfg, 1)
    engine, _ = _engine(cfg)
    engine.train_step(step_batches(sampler, cfg, 0, 0), seeded(task.loss_fn))
    engine.save(str(tmp_path / "ckpt"))
    stored = [{k: v.clone() for k, v in u.stored.items()} for u in engine.frozen.units]
    assert any(u.name.endswith("frozen-nf4") for u in engine.frozen.units)
    again, _ = _engine(cfg)
    load_pretrained(again, str(tmp_path / "ckpt"))
    assert all(torch.equal(u.stored[k], want[k]) for u, want in zip(again.frozen.units, stored) for k in want)
    a, b = engine.full_state_dict(), again.full_state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("stage", [0, 3])
def test_planned_peak_equals_the_run_with_nf4_units_of_several_chunks(corpus, stage):
    """d_model 128: a block's NF4 unit is 3 decode chunks, of which a dry run makes only the
    first and the last (``nf4._chunk_starts``): the peak is still the run's, to the byte."""
    from mct.data import build_data
    from mct.quant.nf4 import NF4_CHUNK
    from mct.task.gpt import step_batches
    cfg = qlora_config(corpus, zero={"stage": stage}, precision={"mode": "bf16"}, model={"d_model": 128, "n_head": 4})
    engine, _ = _engine(cfg)
    assert max(u.layout.padded_numel for u in engine.frozen.units) >= 3 * NF4_CHUNK
    task = task_for(cfg)
    _, sampler = build_data(cfg, 1)
    loss_fn = seeded(task.loss_fn)
    peak = [engine.train_step(step_batches(sampler, cfg, s, 0), loss_fn).metrics["peak_bytes"] for s in range(2)][1]
    pred = mct.predict_peak(task.model_fn, loss_fn, step_batches(sampler, cfg, 1, 0), cfg, world_size=1,
                            optimizer=task.optimizer, param_groups=task.param_groups)
    assert pred == peak


@pytest.mark.parametrize("policy", ["all", "none"])
def test_backward_never_holds_two_blocks_decoded_nf4_layers_at_once(corpus, policy):
    """With prefetch off, a block's decoded NF4 layer is freed before the block below it is
    gathered for its backward (both happen when the same gradient arrives): at most one
    block's decoded layer is held at any gather, forward or backward."""
    from mct.zero.frozen import FrozenUnit
    cfg = qlora_config(corpus, zero={"stage": 3, "prefetch": False}, checkpointing={"policy": policy})
    engine, _ = _engine(cfg)
    blocks = [u for u in engine.frozen.units if u.name.endswith("/frozen-nf4")]
    assert len(blocks) >= 2, [u.name for u in engine.frozen.units]
    most = []
    real_gather = FrozenUnit.gather

    def gather(unit, comm, async_op=False):
        real_gather(unit, comm, async_op=async_op)
        most.append(sum(u.gathered for u in blocks))
    from mct.data import build_data
    from mct.task.gpt import step_batches
    task = task_for(cfg)
    _, sampler = build_data(cfg, 1)
    FrozenUnit.gather = gather
    try:
        engine.train_step(step_batches(sampler, cfg, 0, 0), seeded(task.loss_fn))
    finally:
        FrozenUnit.gather = real_gather
    assert most and max(most) == 1, most
