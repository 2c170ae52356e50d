"""The chunked loss with a frozen head streamed in vocabulary slices (``train.loss_vocab_slice``,
``mct.task.vocab_slices``): the same loss and hidden-state gradient as the whole-head chunked loss
(shards with padding rows, ignored targets, one slice or many), the same training on 1-2 ranks at
stages 0-3 (untied frozen head, the GPT's and a LoRA transformers Llama's: streamed from its shards;
LoRA GPT's tied head in the root: views), the head's
unit never gathered whole, the planner's backward equal to the run's (frozen, activations, other), and one-line errors for bad values."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import mct
from mct.planner import dry_run
from mct.adapters import apply_adapters
from mct.config import AdapterConfig
from mct.engine import Engine
from mct.models.gpt import GPT
from mct.task.chunked import linear_cross_entropy
from mct.task.tokens import chunked_token_loss
from mct.task.vocab_slices import HeadRows, sliced_cross_entropy
from tests.distributed import run_distributed
from tests.helpers import batches, tiny_config
from tests.planner_models import hf_llama, random_batch
from tests.zero.test_frozen_ends import untied_frozen_ends_gpt


def _sharded_rows(weight: torch.Tensor, parts: int, slice_rows: int) -> HeadRows:
    """``weight`` laid out as ``parts`` shards of whole rows (the last padded with zeros)."""
    per = -(-weight.shape[0] // parts)
    padded = torch.cat([weight, torch.zeros(parts * per - weight.shape[0], weight.shape[1], dtype=weight.dtype)])
    shards = padded.view(parts, per, -1)
    return HeadRows(lambda lo, hi: shards[:, lo:hi].reshape(-1, weight.shape[1]), parts=parts, per_part=per,
                    vocab=weight.shape[0], slice_rows=slice_rows)


@pytest.mark.parametrize("parts, slice_rows", [(1, 7), (1, 1000), (3, 5), (4, 1)])
def test_sliced_loss_and_hidden_gradient_equal_the_whole_head_chunked_loss(parts, slice_rows):
    torch.manual_seed(0)
    hidden = torch.randn(3, 11, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(37, 16, dtype=torch.float64)  # 37 rows: padding in every parts > 1
    targets = torch.randint(0, 37, (3, 11))
    targets[0, :4] = -100
    want = linear_cross_entropy(hidden, weight, None, targets, chunk=4)
    (want_grad,) = torch.autograd.grad(want, hidden)
    got = sliced_cross_entropy(hidden, _sharded_rows(weight, parts, slice_rows), targets, chunk=4,
                               ignore_index=-100)
    (got_grad,) = torch.autograd.grad(got, hidden)
    assert torch.allclose(got, want, rtol=1e-12, atol=0), (got, want)
    assert torch.allclose(got_grad, want_grad, rtol=1e-10, atol=1e-14)


def test_a_bad_slice_size_is_one_line_naming_the_key():
    with pytest.raises(ValueError, match="train.loss_vocab_slice"):
        mct.EngineConfig.from_dict({"train": {"loss_vocab_slice": -1}})


def _close(got: list, want: dict) -> bool:
    """Updates within 1e-6 relative (``mct verify``'s measure: ||got - want|| / ||want||), plus
    the fp32 rounding of the parameters they are read from (2^-23 of each)."""
    a, b = torch.tensor(got, dtype=torch.float64), torch.tensor(want["update"], dtype=torch.float64)
    return float((a - b).norm()) <= 1e-6 * float(b.norm()) + 2 ** -23 * want["norm"]


def _sgd(groups: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=0.5)


def _train(rank: int, world: int, build: str, stage: int, slice_rows: int) -> dict:
    torch.manual_seed(0)
    model = {"untied": untied_frozen_ends_gpt, "tied": lambda: GPT(tiny_config().model), "llama": hf_llama}[build]()
    if build in ("tied", "llama"):  # LoRA: a tied head frozen in the root; a Llama's untied head frozen alone
        apply_adapters(model, AdapterConfig(kind="lora", rank=2, alpha=4.0))
        with torch.no_grad():  # B = 0 at init: make the adapters count from the first step
            for n, p in model.named_parameters():
                if n.endswith("lora_B.weight"):
                    p.normal_(0, 0.02)
    cfg = _cfg_for(stage, slice_rows)
    # SGD: the updates are the gradients (Adam's normalized step would magnify the rounding of tiny ones)
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    names = set(start)
    engine = Engine(model, _sgd, cfg)
    head_gathers = [0]  # whole gathers of the head's unit (a frozen end unit of its own at stages 1-3)
    if "lm_head" in engine.frozen.units_by_block:
        unit = engine.frozen.units_by_block["lm_head"][0]
        whole = unit.gather

        def counted(*args, **kwargs):
            head_gathers[0] += not unit.gathered
            return whole(*args, **kwargs)
        unit.gather = counted
    loss = chunked_token_loss(8)
    data = (lambda s: random_batch(s, rank, 3)) if build == "llama" else (lambda s: batches(s, rank, world, B=3))
    out = [engine.train_step(data(s), loss) for s in range(2)]
    gathers = head_gathers[0]  # (full_state_dict gathers every frozen unit: not counted)
    final = {n: t for n, t in engine.full_state_dict().items() if n in names}
    trained = {n: {"update": (t - start[n]).tolist(), "norm": float(t.norm())} for n, t in final.items()}
    return {"loss": [o.loss for o in out], "backward": out[1].metrics["peaks"]["backward"], "head_gathers": gathers,
            "trained": trained}  # plain lists cross processes


@pytest.mark.multirank
@pytest.mark.parametrize("build, stage", [("untied", 3), ("untied", 1), ("tied", 3), ("llama", 3)])
def test_two_ranks_train_the_same_with_the_head_in_slices_and_never_gather_it_whole(build, stage):
    got = run_distributed(_train, 2, build, stage, 24)[0]  # 256 rows: 128 per rank, 12 per slice: 11 slices
    want = run_distributed(_train, 2, build, stage, 0)[0]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6, abs=0), (got["loss"], want["loss"])
    for n, t in want["trained"].items():
        assert _close(got["trained"][n]["update"], t), n
    if build == "llama":
        assert got["head_gathers"] == 0 and want["head_gathers"] >= 4, (got["head_gathers"], want["head_gathers"])
    if build == "untied":  # streamed: the head's unit is never gathered whole; else for its call and backward
        assert got["head_gathers"] == 0 and want["head_gathers"] >= 4, (got["head_gathers"], want["head_gathers"])
        # the planner's dry run of the backward (where the head's slices and logits blocks live)
        plan = dry_run(untied_frozen_ends_gpt, chunked_token_loss(8), batches(0, 0, 2, B=3)[0], _cfg_for(stage, 24),
                       2, optimizer=_sgd).phases["backward"]
        for cat in ("frozen", "activations", "other"):
            assert plan[cat] == got["backward"][cat], (cat, plan, got["backward"])


def _cfg_for(stage: int, slice_rows: int) -> mct.EngineConfig:
    """Stage 3 prefetches (the block before the head must not prefetch a streamed head whole)."""
    return tiny_config(zero={"stage": stage, "prefetch": stage == 3}, checkpointing={"policy": "all"},
                       train={"loss_chunk_tokens": 8, "loss_vocab_slice": slice_rows})


@pytest.mark.parametrize("build, stage", [("untied", 0), ("untied", 2), ("tied", 0), ("tied", 3)])
def test_one_rank_trains_the_same_with_the_head_in_slices(build, stage):
    got, want = _train(0, 1, build, stage, 24), _train(0, 1, build, stage, 0)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6, abs=0), (got["loss"], want["loss"])
    for n, t in want["trained"].items():
        assert _close(got["trained"][n]["update"], t), n
