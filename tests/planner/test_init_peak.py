"""The construction ("init") peak at stage 3: the model built on meta and materialized a unit
at a time, predicted to the byte, with a frozen base (LoRA) and a 4-bit one (QLoRA)."""

from __future__ import annotations

import pytest
import torch

from mct.config import CLI_RECIPE, load_config
from mct.engine import Engine
from mct.planner.plan import predict, with_choice
from mct.task import build_model, builds_on_meta, task_for
from tests.storage_count import LiveStorage

TINY = ["model.n_layer=2", "model.d_model=64", "model.n_head=2", "model.seq_len=32", "model.vocab_size=256",
        "data.micro_batch_size=2"]


def _built(task, cfg) -> tuple[int, int]:
    """(peak, kept): live CPU storage bytes while `mct train` builds the engine (the model on meta,
    then each unit materialized), and once it is built."""
    torch.manual_seed(0)
    counter = LiveStorage()
    with counter:
        model, program = build_model(task, cfg, on_meta=builds_on_meta(cfg))
        groups = task.param_groups(model) if task.param_groups else None
        engine = Engine(model, task.optimizer, cfg, param_groups=groups, init_program=program)
        kept = counter.total
    engine.close()
    return counter.peak, kept


@pytest.mark.parametrize("kind", ["none", "lora", "qlora"])
def test_stage3_init_peak_is_the_meta_builds_to_the_byte(kind):
    cfg = load_config(None, [*TINY, f"adapter.kind={kind}"], defaults=CLI_RECIPE)
    cfg = with_choice(cfg, 3, "all", "bf16")
    task = task_for(cfg)
    peak, kept = _built(task, cfg)
    run = predict(task, cfg, 1)
    # before: the dry run cast every frozen parameter to bf16 ahead of its unit (a real meta
    # build has nothing to cast there), 16 GiB of an 8B base that no run holds
    assert (run.init_peak, run.init_end["total"]) == (peak, kept)
