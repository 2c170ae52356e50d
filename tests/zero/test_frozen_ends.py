"""A frozen input embedding and a frozen, untied output head as frozen units of their own
(``mct.zero.frozen.split_frozen_ends``): at stages 1-3 each is gathered around its own call
(the head again for its backward), not held with the root for the whole step.

Metrics: the tracker's 'frozen' bytes inside block 0's forward (neither end gathered) and
inside the head's call (only the head on top of the shards); parity with the unsharded run;
the planner's dry run equal to the run's tracker peak on 2 gloo ranks, chunked loss on.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import mct
from mct.engine import Engine
from mct.models.gpt import GPT, gpt_loss, optimizer_groups
from tests.distributed import run_distributed
from tests.helpers import adamw, batches, tiny_config


def untied_frozen_ends_gpt() -> nn.Module:
    """The tiny GPT with its head untied from the embedding, both frozen (the rest trains)."""
    model = GPT(tiny_config().model)
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())
    for p in (model.wte.weight, model.wpe.weight, model.lm_head.weight):
        p.requires_grad_(False)
    return model


def _cfg(stage: int, **extra) -> mct.EngineConfig:
    return tiny_config(zero={"stage": stage, "prefetch": False}, checkpointing={"policy": "all"},
                       precision={"mode": "bf16"}, train={"loss_chunk_tokens": 8}, **extra)


def _held(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = untied_frozen_ends_gpt()
    engine = Engine(model, adamw, _cfg(3), param_groups=optimizer_groups(model, 0.1))
    live = lambda: engine.tracker.live()["frozen"]  # noqa: E731
    seen: dict[str, list[int]] = {"block0": [], "head": []}
    model.blocks[0].register_forward_pre_hook(lambda m, a: seen["block0"].append(live()))
    model.lm_head.register_forward_pre_hook(lambda m, a: seen["head"].append(live()))  # after the gather
    losses = [engine.train_step(batches(s, rank, 1, B=3), gpt_loss) for s in range(2)]
    units = {u.name: u.layout.padded_numel * 2 for u in engine.frozen.units}  # bf16
    torch.manual_seed(0)
    model0 = untied_frozen_ends_gpt()
    engine0 = Engine(model0, adamw, _cfg(0), param_groups=optimizer_groups(model0, 0.1))  # every frozen whole
    want = [engine0.train_step(batches(s, rank, 1, B=3), gpt_loss).loss for s in range(2)]
    return {"units": units, "between": live(), "seen": seen, "loss": [o.loss for o in losses], "want": want,
            "peak": losses[1].metrics["peak_bytes"]}


@pytest.mark.multirank
def test_frozen_untied_head_and_embedding_are_gathered_only_around_their_use_and_plan_equals_run():
    got = run_distributed(_held, 2)[0]
    units, between = got["units"], got["between"]
    assert set(units) == {"root/frozen", "wte/frozen", "lm_head/frozen"}, units  # wpe stays in root
    assert between == sum(units.values()) // 2  # the shards only, between steps
    # block 0 runs (forward, then its recompute) with the root (wpe) gathered and neither end;
    # the head's call with the root and the head
    assert got["seen"]["block0"] == [between + units["root/frozen"]] * 4, (got["seen"], units)
    assert got["seen"]["head"] == [between + units["root/frozen"] + units["lm_head/frozen"]] * 2, (got["seen"], units)
    pred = mct.predict_peak(untied_frozen_ends_gpt, gpt_loss, batches(0, 0, 1, B=3)[0], _cfg(3), world_size=2,
                            optimizer=adamw, param_groups=lambda m: optimizer_groups(m, 0.1))
    assert pred == got["peak"], (pred, got["peak"])
    # the same losses as stage 0 on the same ranks (every frozen parameter whole)
    assert got["loss"] == pytest.approx(got["want"], rel=1e-5), (got["loss"], got["want"])


def test_a_tied_head_stays_in_the_root_unit():
    from mct.zero.frozen import split_frozen_ends
    model = GPT(tiny_config().model)
    model.requires_grad_(False)
    unit_of = {id(p): "root" for p in model.parameters()}
    assert split_frozen_ends(model, unit_of, [model.wte, model.lm_head]) == []  # one weight, two uses
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone(), requires_grad=False)
    unit_of = {id(p): "root" for p in model.parameters()}
    assert [n for n, _ in split_frozen_ends(model, unit_of, [model.wte, model.lm_head])] == ["wte", "lm_head"]
    assert unit_of[id(model.lm_head.weight)] == "lm_head" and unit_of[id(model.wpe.weight)] == "root"
