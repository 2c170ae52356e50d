"""Frozen parameters sharded at ZeRO stages 1-3 (mct.zero.frozen): the built-in GPT with its
embeddings (tied to the head), position embeddings and first block frozen.

Metrics: parity with the fp32 reference within 1e-6 (SGD with momentum, linear in the
gradient, so a wrong scale shows; the reference summing in the stage's order: AdamW's
rounding noise on the attention key bias, docs/stages.md "reduce", would hide nothing
else) at stages 0-3 on 1-3 gloo ranks, frozen values bit-identical after training;
the tracker's 'frozen' bytes (the stored shards: base/N, and the gathered units on top);
the planner's dry run equal to the run's tracker peak; checkpoints resumed exactly and
resharded from 2 ranks to 3.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn as nn

import mct
from mct.engine import Engine
from mct.models.gpt import GPT, gpt_loss, optimizer_groups
from mct.zero.frozen import FrozenModel
from mct.zero.frozen_codec import IdentityCodec
from tests.distributed import run_distributed
from tests.helpers import (adamw, batches, engine_run, max_rel_diff, reference_run, sgd_momentum, shared_work,
                           tiny_config)

STEPS = 3
N_MICRO = 2
FROZEN = ("wte.weight", "wpe.weight")  # and every parameter of blocks.0


def frozen_gpt() -> nn.Module:
    """The tiny GPT with its (tied) token embedding, position embedding and block 0 frozen."""
    model = GPT(tiny_config().model)
    model.wte.weight.requires_grad_(False)
    model.wpe.weight.requires_grad_(False)
    model.blocks[0].requires_grad_(False)
    return model


def _frozen_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if not p.requires_grad]


def _parity(rank: int, world: int) -> dict:
    cfg0 = tiny_config(train={"grad_clip": 1.0}, memory={"track": False})
    refs = shared_work(rank, world, {order: (lambda order=order: reference_run(
        cfg0, world, STEPS, sgd_momentum, N_MICRO, frozen_gpt, order=order)[1]) for order in ("rank", "micro")})
    torch.manual_seed(cfg0.seed)
    init = {n: p.detach().clone() for n, p in frozen_gpt().named_parameters() if not p.requires_grad}
    out, evals = {}, []
    for stage in (0, 1, 2, 3):
        for policy in ("none", "all") if stage else ("none",):
            cfg = tiny_config(train={"grad_clip": 1.0}, zero={"stage": stage}, checkpointing={"policy": policy},
                              memory={"track": False})
            _, state, engine, _ = engine_run(cfg, rank, STEPS, sgd_momentum, N_MICRO, frozen_gpt)
            evals.append(engine.eval_loss(batches(STEPS, rank)[0], gpt_loss))  # gathers and frees too
            unchanged = all(torch.equal(state[n], t) for n, t in init.items())
            # between steps a sharded frozen parameter holds no data
            freed = all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters() if not p.requires_grad)
            if refs is not None:
                out[(stage, policy)] = (max_rel_diff(state, refs["micro" if stage >= 2 else "rank"]), unchanged, freed)
    if refs is not None:
        out["eval"] = evals
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world", [1, 2, 3])
def test_frozen_gpt_trains_like_the_reference_at_every_stage_and_its_frozen_bytes_never_change(world):
    got = _parity(0, 1) if world == 1 else run_distributed(_parity, world)[0]
    evals = got.pop("eval")  # evaluation after training, every stage against stage 0's
    assert all(abs(e - evals[0]) <= 1e-6 * abs(evals[0]) for e in evals), evals
    assert set(got) == {(0, "none"), *((s, p) for s in (1, 2, 3) for p in ("none", "all"))}
    for (stage, policy), ((diff, name), unchanged, freed) in got.items():
        assert diff <= 1e-6, (world, stage, policy, diff, name)
        assert unchanged, (world, stage, policy)
        # sharded units hold no data between steps; on one rank a unit is resident (one copy)
        assert freed == (stage >= 1 and world > 1), (world, stage, policy)


def _held(rank: int, world: int) -> dict:
    """Stage 3, no prefetch: the tracker's 'frozen' bytes between steps and inside block 0."""
    cfg = tiny_config(zero={"stage": 3, "prefetch": False})
    torch.manual_seed(0)
    model = frozen_gpt()
    base = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    engine = Engine(model, adamw, cfg, param_groups=optimizer_groups(model, 0.1))
    inside: list[int] = []
    model.blocks[0].register_forward_pre_hook(lambda m, a: inside.append(engine.tracker.live()["frozen"]))
    engine.train_step(batches(0, rank), gpt_loss)
    units = {u.name: u.layout.padded_numel * 4 for u in engine.frozen.units}
    n_frozen = sum(1 for p in model.parameters() if not p.requires_grad)
    return {"base": base, "n_frozen": n_frozen, "between": engine.tracker.live()["frozen"], "inside": inside, "units": units,
            "reported": engine.model_state_bytes()["frozen"]}


@pytest.mark.multirank
def test_frozen_base_at_stage3_holds_base_over_n_per_rank_plus_the_gathered_units():
    held = {1: _held(0, 1), **{w: run_distributed(_held, w)[0] for w in (2, 3)}}
    for world, h in held.items():
        assert set(h["units"]) == {"root/frozen", "blocks.0/frozen"}
        padded = sum(h["units"].values())
        assert h["between"] == h["reported"] == padded // world, (world, h)
        # padding: each parameter starts on 16 elements, the unit is padded to the world size
        assert 0 <= padded - h["base"] < 4 * (16 * h["n_frozen"] + 2 * world), (world, padded, h["base"])
        # inside block 0's forward: the shards, the root unit (tied embedding, gathered for the
        # whole forward) and block 0's unit; block 0 runs once (its input needs no gradient).
        # On one rank the stored units are the working buffers: nothing is added.
        gathered = h["units"]["root/frozen"] + h["units"]["blocks.0/frozen"] if world > 1 else 0
        assert h["inside"] == [h["between"] + gathered], (world, h)
    assert held[1]["between"] > held[2]["between"] > held[3]["between"]


def _run_peaks(rank: int, world: int, stages: tuple[int, ...]) -> dict[int, int]:
    out = {}
    for stage in stages:
        cfg = tiny_config(zero={"stage": stage}, checkpointing={"policy": "all"}, precision={"mode": "bf16"})
        torch.manual_seed(0)
        model = frozen_gpt()
        engine = Engine(model, adamw, cfg, param_groups=optimizer_groups(model, 0.1))
        peaks = [engine.train_step(batches(s, rank, 1, B=3), gpt_loss).metrics for s in range(2)]
        out[stage] = (peaks[1]["peak_bytes"], peaks[1]["peaks"])
    return out


@pytest.mark.multirank
def test_planned_peak_equals_the_run_tracker_peak_with_frozen_units_on_2_ranks():
    stages = (0, 1, 2, 3)  # stage 0: the frozen parameters whole, counted under 'frozen' too
    measured = run_distributed(_run_peaks, 2, stages)[0]
    for stage in stages:
        cfg = tiny_config(zero={"stage": stage}, checkpointing={"policy": "all"}, precision={"mode": "bf16"})
        pred = mct.predict_peak(frozen_gpt, gpt_loss, batches(0, 0, 1, B=3)[0], cfg, world_size=2, optimizer=adamw,
                                param_groups=lambda m: optimizer_groups(m, 0.1))
        peak, by_phase = measured[stage]
        assert any(p.get("frozen", 0) > 0 for p in by_phase.values()), stage
        assert pred == peak, (stage, pred, peak)


def test_on_one_rank_a_frozen_unit_is_held_once_and_the_plan_equals_the_run():
    """World 1, stages 1-3: the stored shard is the working buffer (no second copy), so the
    frozen bytes at the peak are the padded units once, as stage 0 holds them whole."""
    torch.manual_seed(0)
    base = sum(p.numel() * p.element_size() for p in frozen_gpt().parameters() if not p.requires_grad)
    for stage in (1, 2, 3):
        cfg = tiny_config(zero={"stage": stage}, checkpointing={"policy": "all"}, precision={"mode": "bf16"})
        torch.manual_seed(0)
        model = frozen_gpt()
        engine = Engine(model, adamw, cfg, param_groups=optimizer_groups(model, 0.1))
        units = sum(u.layout.padded_numel * 2 for u in engine.frozen.units)  # bf16
        assert all(u.resident for u in engine.frozen.units), stage
        runs = [engine.train_step(batches(s, 0, 1, B=3), gpt_loss).metrics for s in range(2)]
        peak, by_phase = runs[1]["peak_bytes"], runs[1]["peaks"]
        assert max(p.get("frozen", 0) for p in by_phase.values()) == units, (stage, by_phase)
        assert units - base // 2 < 2 * 16 * 8, (units, base)  # only padding on top of the bf16 base
        pred = mct.predict_peak(frozen_gpt, gpt_loss, batches(0, 0, 1, B=3)[0], cfg, world_size=1, optimizer=adamw,
                                param_groups=lambda m: optimizer_groups(m, 0.1))
        assert pred == peak, (stage, pred, peak)


def _values(state: dict[str, torch.Tensor]) -> dict:
    return {k: v.numpy().copy() for k, v in state.items()}  # sent by value between processes


def _save_resume(rank: int, world: int, path: str, phase: str, embed: bool = False) -> dict:
    """Save after 2 steps (``embed``: ``Engine.save``, the base by value; else a run's
    checkpoint, the base by hash), or load (``changed``/``old-format``: into an engine whose
    base differs in one element) and step once more."""
    cfg = tiny_config(zero={"stage": 3}, checkpointing={"policy": "all"}, memory={"track": False})
    torch.manual_seed(cfg.seed)
    model = frozen_gpt()
    if phase in ("changed", "old-format"):  # a base that is not the one saved
        with torch.no_grad():
            model.wpe.weight[3, 5] += 1.0
    engine = Engine(model, adamw, cfg, param_groups=optimizer_groups(model, 0.1))
    out = {}
    if phase == "changed":
        try:
            engine.load(path)
        except ValueError as e:
            out["error"] = str(e)
        return out
    if phase == "save":
        for s in range(2):
            engine.train_step(batches(s, rank), gpt_loss)
        if embed:
            engine.save(path)
        else:
            from mct.persistence.checkpoint import save_checkpoint
            save_checkpoint(path, engine, step=2, embed_base=False)
        out["saved"] = _values(engine.full_state_dict())
        engine.train_step(batches(2, rank), gpt_loss)
        out["continued"] = _values(engine.full_state_dict())
    else:
        engine.load(path)
        out["loaded"] = _values(engine.full_state_dict())
        engine.train_step(batches(2, rank), gpt_loss)
        out["continued"] = _values(engine.full_state_dict())
    return out


@pytest.mark.multirank
def test_checkpoint_referencing_the_frozen_base_by_hash_resumes_exactly_reshards_and_refuses_a_changed_base(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_save_resume, 2, path, "save")[0]
    resumed = run_distributed(_save_resume, 2, path, "load")[0]
    resharded = run_distributed(_save_resume, 3, path, "load")[0]
    for got in (resumed["loaded"], resharded["loaded"]):
        assert got.keys() == saved["saved"].keys()
        assert all(np.array_equal(got[k], saved["saved"][k]) for k in got)
    assert all(np.array_equal(resumed["continued"][k], saved["continued"][k]) for k in saved["continued"])
    # the frozen base is referenced by content hash, not saved: base.json names every frozen tensor
    info = json.loads((tmp_path / "ckpt" / "engine.json").read_text())
    assert not any(k.startswith("frozen/") for k in info["tensors"])
    base = json.loads((tmp_path / "ckpt" / "base.json").read_text())
    assert sorted(base["tensors"]) == sorted(_frozen_names(frozen_gpt()))
    assert base["source"]["model"] == "gpt" and len(base["sha256"]) == 64
    # a rebuilt base that differs in one element: one line naming the tensor, on every rank
    errors = [r["error"] for r in run_distributed(_save_resume, 2, path, "changed")]
    assert len(set(errors)) == 1 and "tensor 'wpe.weight' sha256" in errors[0] and "\n" not in errors[0]


@pytest.mark.multirank
def test_a_checkpoint_that_embeds_its_frozen_base_loads_the_saved_values(tmp_path):
    """``Engine.save`` (and mct before base.json) embeds the frozen base under frozen/, whole
    tensors gathered from the shards; loading it (resharded 2 -> 3) sets that base: an engine
    built with another base continues from the saved values."""
    path = str(tmp_path / "old")
    saved = run_distributed(_save_resume, 2, path, "save", True)[0]
    assert not (tmp_path / "old" / "base.json").exists()
    info = json.loads((tmp_path / "old" / "engine.json").read_text())
    frozen_keys = {k for k in info["tensors"] if k.startswith("frozen/")}
    assert frozen_keys == {"frozen/" + n for n in _frozen_names(frozen_gpt())}
    assert all(not info["tensors"][k]["per_element"] for k in frozen_keys)
    from mct.persistence import shards
    for key in frozen_keys:  # their values: the saved ones, gathered from the shards
        t = torch.empty(info["tensors"][key]["shape"])
        shards.load_full(tmp_path / "old" / "engine", {key: t})
        assert np.array_equal(t.numpy(), saved["saved"][key.removeprefix("frozen/")]), key
    loaded = run_distributed(_save_resume, 3, path, "old-format")[0]
    assert all(np.array_equal(loaded["loaded"][k], saved["saved"][k]) for k in saved["saved"])


def test_frozen_units_follow_the_trainable_unit_assignment_with_tied_weights_in_the_root():
    torch.manual_seed(0)
    model = frozen_gpt()
    from mct.checkpointing import find_blocks
    from mct.dist import DistContext
    from mct.memory.tracker import MemoryTracker
    from mct.zero.comm import Comm
    from mct.zero.sharded import assign_units
    blocks = find_blocks(model, [], key="checkpointing.blocks")
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    frozen = FrozenModel(model, assign_units(model, blocks), ["root", *(b for b, _ in blocks)], shard=True,
                         comm=Comm(DistContext.current(), bucket_bytes=2**20), dtype=torch.float32,
                         codec=IdentityCodec(torch.float32), device=torch.device("cpu"), tracker=MemoryTracker())
    assert [u.name for u in frozen.units] == ["root/frozen", "blocks.0/frozen"]
    assert frozen.units[0].names == ["wte.weight", "wpe.weight"]  # lm_head.weight is wte.weight
    # one rank: packed into the root unit's working buffer (its own storage dropped), which is
    # the stored copy too (resident, never released)
    root = frozen.units[0]
    assert root.resident and root.stored["data"] is root.working
    assert model.lm_head.weight.untyped_storage().data_ptr() == root.working.untyped_storage().data_ptr()
    got = {n: t.clone() for n, t in frozen.items()}  # views valid until the next unit: copied
    assert got.keys() == before.keys() and all(torch.equal(got[n], before[n]) for n in before)
    root.release()  # a no-op for a resident unit
    assert model.lm_head.weight.untyped_storage().nbytes() == root.working.numel() * 4


class _Halving:
    """A stand-in decoding codec: stores fp32 values as bf16 and decodes them back."""

    align = 8

    def encode(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        assert flat.numel() % self.align == 0
        return {"half": flat.to(torch.bfloat16), "n": torch.tensor([flat.numel()])}

    def decode(self, parts: dict[str, torch.Tensor], numel: int, dtype: torch.dtype) -> torch.Tensor:
        return parts["half"][:numel].to(dtype)

    def stored_bytes(self, numel: int) -> int:
        return 2 * numel + 8


def test_a_decoding_codec_stores_its_parts_and_gathers_decoded_values():
    torch.manual_seed(0)
    lin = nn.Linear(5, 7)
    lin.requires_grad_(False)
    want = {n: p.detach().to(torch.bfloat16).float() for n, p in lin.named_parameters()}
    from mct.dist import DistContext
    from mct.memory.tracker import MemoryTracker
    from mct.zero.comm import Comm
    frozen = FrozenModel(lin, {}, ["root"], shard=True, comm=Comm(DistContext.current(), bucket_bytes=2**20),
                         dtype=torch.float32, codec=_Halving(), device=torch.device("cpu"), tracker=MemoryTracker())
    unit = frozen.units[0]
    assert unit.layout.offsets == (0, 48) and unit.layout.padded_numel % 8 == 0  # starts on lcm(16, 8)
    assert unit.stored["half"].dtype == torch.bfloat16 and not unit.gathered
    assert frozen.stored_bytes() == unit.layout.padded_numel * 2 + 8
    got = {n: t.clone() for n, t in frozen.items()}  # views valid until the next unit: copied
    assert all(torch.equal(got[n], want[n]) for n in want)


def _init_from(rank: int, world: int, source: str) -> dict:
    from mct.persistence.init_from import load_pretrained
    cfg = tiny_config(zero={"stage": 3}, memory={"track": False})
    torch.manual_seed(1)  # other values than the file's
    model = frozen_gpt()
    engine = Engine(model, adamw, cfg, param_groups=optimizer_groups(model, 0.1))
    load_pretrained(engine, source)
    loaded = _values(engine.full_state_dict())
    engine.train_step(batches(0, rank), gpt_loss)  # the loaded frozen shards are what the step gathers
    return {"loaded": loaded, "after": _values(engine.full_state_dict())}


@pytest.mark.multirank
def test_init_from_fills_each_ranks_frozen_shards_from_the_file(tmp_path):
    from safetensors.torch import save_file
    torch.manual_seed(0)
    want = {n: p.detach().clone() for n, p in frozen_gpt().named_parameters()}
    save_file(want, tmp_path / "w.safetensors")
    got = run_distributed(_init_from, 2, str(tmp_path / "w.safetensors"))[0]
    assert got["loaded"].keys() == want.keys()
    assert all(np.array_equal(got["loaded"][n], want[n].numpy()) for n in want)
    assert all(np.array_equal(got["after"][n], want[n].numpy()) for n in _frozen_names(frozen_gpt()))


def test_parameter_offload_streams_trainable_units_and_keeps_frozen_shards_on_the_device(tmp_path):
    runs = {}
    for name, offload in (("resident", {}), ("disk", {"optimizer": "disk", "params": "disk", "dir": str(tmp_path)})):
        cfg = tiny_config(zero={"stage": 3}, offload=offload, memory={"track": False})
        _, state, engine, _ = engine_run(cfg, 0, 2, adamw, 1, frozen_gpt)
        frozen = [p for p in engine.model.parameters() if not p.requires_grad]
        # one rank: each frozen unit's stored copy is its working buffer (resident, one copy)
        held = all(u.resident and u.gathered for u in engine.frozen.units) and all(
            p.untyped_storage().nbytes() > 0 for p in frozen)
        runs[name] = (state, [u.name for u in engine.frozen.units], held)
        engine.close()
    (want, units, held), (got, units_off, held_off) = runs["resident"], runs["disk"]
    assert units_off == units == ["root/frozen", "blocks.0/frozen"] and held and held_off
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_model_built_on_meta_materializes_its_frozen_base_a_chunk_at_a_time_bit_identically():
    from mct.offload import record_init
    cfg = tiny_config(zero={"stage": 3}, precision={"mode": "bf16"}, memory={"track": False})
    _, want, _, _ = engine_run(cfg, 0, 2, adamw, 1, frozen_gpt)
    torch.manual_seed(cfg.seed)
    model, program = record_init(frozen_gpt)
    names = {id(p): n for n, p in model.named_parameters()}
    whole: list[str] = []
    read: list[str] = []
    materialize, chunks = program.materialize, program.chunks

    def recording(params, device="cpu"):
        whole.extend(names[id(p)] for p in params if id(p) in names and not p.requires_grad)
        materialize(params, device)

    def chunked(p):
        read.append(names[id(p)])
        for start, values in chunks(p, chunk=48):  # many chunks per parameter of the tiny GPT
            assert values.numel() <= 48 + 15
            yield start, values
    program.materialize, program.chunks = recording, chunked
    engine = Engine(model, adamw, cfg, param_groups=optimizer_groups(model, 0.1), init_program=program)
    for s in range(2):
        engine.train_step(batches(s, 0), gpt_loss)
    got = engine.full_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    # every parameter is read a chunk at a time into its unit (the frozen base unit by unit), none
    # replayed whole
    frozen = set(_frozen_names(model))
    assert whole == [] and [n for n in read if n in frozen] == _frozen_names(model)
    assert sorted(read) == sorted(n for n, _ in model.named_parameters())
