"""``zero.reshard_root_after_forward = false`` (FSDP2's root): at stage 3 the root unit
(untied embedding and head) stays gathered from the model's forward into its backward.
Same bits as the default, one all-gather of the root fewer per micro-batch, and the dry
run predicts its peak to the byte (higher or lower: the root is held while the loss runs,
but the gather at backward start, with its transients, is gone)."""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.nn as nn

from mct import Engine
from mct.planner import dry_run
from mct.task import token_loss
from tests.distributed import run_distributed
from tests.helpers import tiny_config

VOCAB, SEQ = 512, 16


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging
    logging.set_verbosity_error()
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=44, vocab_size=VOCAB,
                                        max_position_embeddings=SEQ, use_cache=False, attn_implementation="sdpa",
                                        tie_word_embeddings=False))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (2, SEQ), generator=g), torch.randint(0, VOCAB, (2, SEQ), generator=g)


def _adamw(groups):
    return torch.optim.AdamW(groups, lr=1e-2)


def _cfg(reshard: bool, policy: str):
    return tiny_config(zero={"stage": 3, "reshard_root_after_forward": reshard},
                       checkpointing={"policy": policy}, precision={"mode": "bf16"})


def _train(rank: int, world: int, policy: str) -> dict:
    out = {}
    for reshard in (True, False):
        engine = Engine(_llama(), _adamw, _cfg(reshard, policy))
        gathers, peaks = [], []
        for step in range(3):
            before = engine.stage3.gathers
            # two micro-batches: the root is gathered again for the second one's forward
            r = engine.train_step([_batch(step, rank), _batch(step + 10, rank)], token_loss)
            gathers.append(engine.stage3.gathers - before)
            peaks.append(r.metrics["peak_bytes"])
        state = engine.full_state_dict()
        digest = hashlib.sha256(b"".join(state[k].float().numpy().tobytes() for k in sorted(state))).hexdigest()
        out[reshard] = {"gathers": gathers, "peaks": peaks, "digest": digest}
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("policy", ["none", "all"])
def test_a_root_kept_gathered_changes_no_bit_saves_its_gather_and_is_planned_to_the_byte(policy):
    got = run_distributed(_train, 2, policy)
    for rank in got:
        assert rank[False]["digest"] == rank[True]["digest"]
        # per micro-batch the default gathers the root twice (forward, backward), kept once
        assert [g + 2 for g in rank[False]["gathers"]] == rank[True]["gathers"], rank
    for reshard in (True, False):
        run = dry_run(_llama, token_loss, [_batch(0, 0), _batch(10, 0)], _cfg(reshard, policy), 2, optimizer=_adamw)
        measured = min(rank[reshard]["peaks"][1] for rank in got)
        assert run.peak == measured, (reshard, run.peak, [rank[reshard]["peaks"] for rank in got])
