"""Per-block checkpointing choices (``checkpointing.per_block``): the config's forms and
errors, the uniform policies on the same per-block form, and a mixed stack (blocks that
recompute fully, selectively and not at all) through the engine: bitwise like 'none'
with dropout, within 1e-6 of the fp32 reference at ZeRO stages 0 and 3, its memory
between 'all' and 'none', and `mct verify`."""

from __future__ import annotations

import random

import pytest
import torch

from mct.checkpointing import apply_checkpointing, block_choices, policy_label, region_plans
from mct.config import EngineConfig, apply_overrides
from mct.engine import Engine
from mct.models.gpt import GPT, optimizer_groups
from mct.task.seeding import micro_seed
from mct.task.gpt import seeded_gpt_loss
from mct.verify.reference import ReferenceTrainer
from tests.distributed import run_distributed
from tests.helpers import batches, max_rel_diff, one_thread, sgd_momentum, tiny_config  # noqa: F401 (autouse)

N_LAYER = 4
MIXED = ["selective", "all", "none", "all"]  # every boundary: selective|all, all|none, none|all
STEPS = 2
SEED = 1337


def _ckpt(**keys) -> "EngineConfig":
    return EngineConfig.from_dict({"checkpointing": keys}).checkpointing


def test_per_block_forms_imply_the_policy_and_read_from_set():
    counts = _ckpt(per_block={"all": 2, "selective": 1})
    assert counts.policy == "per_block"
    assert block_choices(counts, 5) == ["all", "all", "selective", "none", "none"]
    assert block_choices(_ckpt(per_block={"selective": 1, "all": 1, "none": 1}), 3) == ["all", "selective", "none"]
    assert block_choices(_ckpt(per_block=MIXED), 4) == MIXED
    assert policy_label(counts) == "all*2,selective*1" and policy_label(_ckpt(per_block=MIXED)) == \
        "selective*1,all*1,none*1,all*1"
    for text, want in (("all=8,selective=8", {"all": 8, "selective": 8}),
                       ("{all = 8, selective = 8}", {"all": 8, "selective": 8}),
                       ("all,none,selective", ["all", "none", "selective"]), ("", [])):
        d = apply_overrides({}, [f"checkpointing.per_block={text}"])
        assert d["checkpointing"]["per_block"] == want, text
    # the recorded config (to_dict, as a run's metadata and checkpoints keep it) reads back the same
    cfg = EngineConfig.from_dict({"checkpointing": {"per_block": {"all": 2}}})
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("keys,message", [
    ({"per_block": ["all", "ful"]}, "checkpointing.per_block[1] = 'ful' is not allowed: choose all, selective or none"),
    ({"per_block": {"al": 2}}, "'al' is not a block policy"),
    ({"per_block": {"all": -1}}, "checkpointing.per_block.all = -1 is not allowed"),
    ({"per_block": {"all": 1.5}}, "checkpointing.per_block.all = 1.5 has the wrong type"),
    ({"per_block": "all"}, "checkpointing.per_block = 'all' has the wrong type"),
    ({"policy": "all", "per_block": ["all"]}, "checkpointing.policy = 'all' sets them all: keep one"),
    ({"policy": "none", "per_block": {"all": 1}}, "checkpointing.policy = 'none' sets them all"),
    ({"policy": "per_block"}, "needs checkpointing.per_block"),
    ({"per_block": ["none", "none"], "offload": "disk"}, "checkpointing.offload = 'disk' is not allowed"),
])
def test_bad_per_block_is_a_value_error_naming_value_and_fix(keys, message):
    with pytest.raises(ValueError) as e:
        EngineConfig.from_dict({"checkpointing": keys})
    assert message in str(e.value)


@pytest.mark.parametrize("spec,message", [
    (["all"] * 3, "checkpointing.per_block lists 3 block(s) and the model has 4"),
    ({"all": 3, "selective": 2}, "counts 5 block(s) and the model has 4"),
    ({"all": 1, "none": 2}, "counts 3 block(s) and the model has 4"),
])
def test_per_block_that_does_not_match_the_model_fails_at_apply(spec, message):
    cfg = tiny_config(model={"n_layer": N_LAYER}, checkpointing={"per_block": spec})
    with pytest.raises(ValueError) as e:
        apply_checkpointing(GPT(cfg.model), cfg.checkpointing)
    assert message in str(e.value) and "{all = " in str(e.value) or "at most 4" in str(e.value)


def test_uniform_policies_are_the_same_regions_as_their_per_block_form():
    n = 6
    for policy, per_block in (("all", ["all"] * n), ("selective", {"selective": n}), ("none", {"none": n}),
                              ("every_k", ["all", "none", "none"] * 2)):
        uniform = _ckpt(policy=policy, k=3)
        mixed = _ckpt(per_block=per_block)
        assert block_choices(uniform, n) == block_choices(mixed, n), policy
        assert region_plans(uniform, n) == region_plans(mixed, n), policy
    assert block_choices(_ckpt(policy="sqrt"), n) is None  # its regions span blocks
    assert [r.mode for r in region_plans(_ckpt(per_block=MIXED), 4)] == ["selective", "all", "all"]


def _seeded(step: int, rank: int, n_micro: int) -> list[tuple]:
    # the dropout seed travels with the micro-batch: engine and reference draw the same masks
    return [(x, y, micro_seed(SEED, step, rank * n_micro + m)) for m, (x, y) in enumerate(batches(step, rank, n_micro))]


def _train(rank: int, world: int, per_block: list[str] | None, stage: int, reference: bool = False) -> dict:
    """A tiny GPT (dropout 0.1) trained STEPS steps with SGD + momentum; the fp32
    reference (rank 0, over every rank's batches) beside it when asked."""
    ckpt = {"per_block": per_block} if per_block else {"policy": "none"}
    cfg = tiny_config(model={"n_layer": N_LAYER, "dropout": 0.1}, zero={"stage": stage}, checkpointing=ckpt)
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model)
    ref = None
    if reference and rank == 0:
        r = GPT(cfg.model)
        r.load_state_dict(model.state_dict())
        ref = ReferenceTrainer(r, sgd_momentum, param_groups=optimizer_groups(r, 0.1))
    engine = Engine(model, sgd_momentum, cfg, param_groups=optimizer_groups(model, 0.1))
    losses, ref_losses = [], []
    for step in range(STEPS):
        out = engine.train_step(_seeded(step, rank, 1), seeded_gpt_loss)
        losses.append(out.loss)
        if ref is not None:
            ref_losses.append(ref.step([_seeded(step, r, 1) for r in range(world)], seeded_gpt_loss).loss)
    state = engine.full_state_dict()
    result = {"losses": losses, "state": {k: v.numpy() for k, v in state.items()},
              "metrics": {k: v for k, v in out.metrics.items() if k.startswith("recompute")},
              "activations": max(p.get("activations", 0) for p in out.metrics["peaks"].values())}
    if ref is not None:
        result["ref_losses"] = ref_losses
        result["ref_rel"] = max_rel_diff(state, ref.state_dict())
    return result


def _assert_bitwise(got: dict, want: dict, label: str) -> None:
    assert got["losses"] == want["losses"], label
    for name, value in want["state"].items():
        assert (got["state"][name] == value).all(), f"{label}: {name}"


def _assert_reference(run: dict, label: str) -> None:
    rel, name = run["ref_rel"]
    assert rel < 1e-6, (label, name, rel)
    for a, b in zip(run["losses"], run["ref_losses"]):
        assert abs(a - b) <= 1e-6 * abs(b), (label, a, b)


@pytest.mark.parametrize("stage", [0, 3])
def test_mixed_stack_trains_like_none_and_the_reference_one_rank(stage):
    mixed = _train(0, 1, MIXED, stage, reference=True)
    _assert_reference(mixed, f"stage {stage}")
    _assert_bitwise(mixed, _train(0, 1, None, stage), f"stage {stage}")  # dropout replayed exactly
    m = mixed["metrics"]
    assert m["recompute_policy"] == "selective*1,all*1,none*1,all*1"
    assert (m["recompute_checkpointed_blocks"], m["recompute_selective_blocks"], m["recompute_regions"]) == (3, 1, 3)
    assert m["recomputed_blocks"] == 3 and m["recompute_time_s"] > 0


def test_mixed_stack_activations_lie_between_all_and_none():
    peak = {name: _train(0, 1, spec, 0)["activations"]
            for name, spec in (("none", None), ("all", ["all"] * N_LAYER), ("mixed", MIXED))}
    assert peak["all"] < peak["mixed"] < peak["none"], peak


def _two_ranks(rank: int, world: int) -> dict:
    return {stage: (_train(rank, world, MIXED, stage, reference=True), _train(rank, world, None, stage))
            for stage in (0, 3)}


@pytest.mark.multirank
def test_mixed_stack_trains_like_none_and_the_reference_on_two_ranks_at_stages_0_and_3():
    ranks = run_distributed(_two_ranks, 2)
    for rank, runs in enumerate(ranks):
        for stage, (mixed, none) in runs.items():
            _assert_bitwise(mixed, none, f"rank {rank} stage {stage}")
    for stage, (mixed, _) in ranks[0].items():
        _assert_reference(mixed, f"2 ranks stage {stage}")


def test_verify_runs_the_mixed_stack_and_passes(tmp_path):
    from mct.verify.compare import run_verify
    rnd = random.Random(0)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(rnd.choice("abcdefgh ijkl\n") for _ in range(50_000)))
    cfg = tiny_config(model={"n_layer": N_LAYER, "dropout": 0.1}, zero={"stage": 3},
                      data={"path": str(corpus), "micro_batch_size": 2}, train={"warmup_steps": 0},
                      checkpointing={"per_block": {"all": 1, "selective": 2}})
    report = run_verify(cfg, 2)
    assert report is not None and report.passed, report.table()
    assert report.checkpointing == "all*1,selective*2" and report.recomputed_blocks == 3
    assert "checkpointing all*1,selective*2: 3 block forward(s) recomputed" in report.table()
