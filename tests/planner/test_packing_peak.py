"""The planner prices packed documents: with ``data.packing = 'documents'`` the dry run's
example batch carries segments, so the block-causal mask and what attention keeps for it
are in the predicted peak, which equals the engine tracker's peak of a real packed step
(the built-in GPT, stages 0 and 3, with and without recompute)."""

from __future__ import annotations

import pytest
import torch

import mct
from mct.engine import Engine
from mct.models.gpt import GPT, gpt_loss, optimizer_groups
from mct.task.tokens import token_batch
from tests.helpers import adamw, one_thread, tiny_config  # noqa: F401 (one_thread: autouse fixture)

B, T = 4, 64


def _packed_batch(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    seg = torch.sort(torch.randint(0, 5, (B, T), generator=g), dim=1).values
    seg = seg - seg[:, :1]
    return torch.randint(0, 256, (B, T), generator=g), torch.randint(0, 256, (B, T), generator=g), seg


@pytest.mark.parametrize("sections", [{}, {"zero": {"stage": 3}, "checkpointing": {"policy": "all"}}],
                         ids=["stage0", "stage3_all"])
def test_predicted_peak_of_a_packed_step_is_the_engine_trackers(sections):
    cfg = tiny_config(model={"seq_len": T}, data={"micro_batch_size": B, "packing": "documents"}, **sections)
    torch.manual_seed(0)
    model = GPT(cfg.model)
    engine = Engine(model, adamw, cfg, param_groups=optimizer_groups(model, 0.1))
    peaks = [engine.train_step([_packed_batch(s)], gpt_loss).metrics["peak_bytes"] for s in range(2)]
    example = token_batch(cfg)
    assert len(example) == 3  # the segments travel into the dry run
    pred = mct.predict_peak(lambda: GPT(cfg.model), gpt_loss, example, cfg, world_size=1, optimizer=adamw,
                            param_groups=lambda m: optimizer_groups(m, 0.1))
    stream = tiny_config(model={"seq_len": T}, data={"micro_batch_size": B}, **sections)
    unpacked = mct.predict_peak(lambda: GPT(cfg.model), gpt_loss, token_batch(stream), stream, world_size=1,
                                optimizer=adamw, param_groups=lambda m: optimizer_groups(m, 0.1))
    assert pred == peaks[1]
    assert pred > unpacked  # the mask's bytes are priced
