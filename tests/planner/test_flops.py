"""Step FLOPs counted on fake tensors: the built-in GPT's count equals the analytic
formula exactly, recompute and chunked loss show up in the hardware FLOPs only, and a
model that cannot run on fake tensors falls back to 6 x parameters x tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils.flop_counter import FlopCounterMode

from mct.checkpointing import apply_checkpointing
from mct.config import EngineConfig
from mct.planner.flops import COUNTED, ESTIMATED, EXTRA_FORMULAS, UNKNOWN, step_flops
from mct.task import task_for, with_loss_chunk
from mct.task.spec import Task

L, H, D, S, V, B = 2, 2, 32, 16, 96, 2


def _cfg(**sections) -> EngineConfig:
    model = {"n_layer": L, "n_head": H, "d_model": D, "seq_len": S, "vocab_size": V, **sections.pop("model", {})}
    return EngineConfig.from_dict({"model": model, "data": {"micro_batch_size": B, "grad_accum": 3}, **sections})


def analytic_gpt_flops(attention: str) -> int:
    """One micro-batch of the built-in GPT, forward + backward, as matmul FLOPs.

    Every linear weight (qkv 3d^2, proj d^2, fc 4d^2, mlp proj 4d^2 per block, and the
    tied head d V) costs 2 FLOPs per weight per token forward and 4 backward (input and
    weight gradients): 6 N T. Biases, norms, softmax and embedding lookups count
    nothing. Attention per block: QK^T and PV are 2 B S^2 d each forward; backward is 4
    such matmuls for the explicit form, 5 for SDPA (torch counts the recomputed scores),
    both over the full S x S matrix (no causal discount)."""
    n_matmul = L * 12 * D * D + D * V
    per_block = {"explicit": 6, "sdpa": 7}[attention] * 2 * B * S * S * D
    return 6 * n_matmul * B * S + L * per_block


@pytest.mark.parametrize("attention", ["sdpa", "explicit"])
def test_gpt_flop_count_equals_the_analytic_formula_exactly(attention):
    cfg = _cfg(model={"attention": attention})
    f = step_flops(task_for(cfg), cfg, world_size=2)
    assert f.method == COUNTED and f.micro_batches == 3 * 2
    assert f.model == analytic_gpt_flops(attention) * 6
    assert f.hardware == f.model  # no recompute, no chunking


def test_recompute_counts_in_hardware_flops_as_the_real_model_runs_it():
    cfg = _cfg(checkpointing={"policy": "all"}, model={"attention": "sdpa"})
    f = step_flops(task_for(cfg), cfg, world_size=1)
    assert f.model == analytic_gpt_flops("sdpa") * 3  # MFU's numerator ignores recompute
    task = task_for(cfg)
    model = task.model_fn()
    apply_checkpointing(model, cfg.checkpointing)
    x = torch.randint(0, V, (B, S))
    with FlopCounterMode(display=False, custom_mapping=EXTRA_FORMULAS) as real:
        task.loss_fn(model, (x, x)).backward()
    assert f.hardware == real.get_total_flops() * 3 > f.model


def test_chunked_loss_recomputes_the_head_in_hardware_flops_only():
    cfg = _cfg(train={"loss_chunk_tokens": 8}, model={"attention": "sdpa"})
    f = step_flops(with_loss_chunk(task_for(cfg), 8), cfg, world_size=1)
    assert f.model == analytic_gpt_flops("sdpa") * 3
    assert f.hardware - f.model == 2 * B * S * D * V * 3  # the logits once more, chunk by chunk


class NeedsValues(nn.Module):
    """A forward that reads a value: it cannot run on fake tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum().item() < 0:
            raise AssertionError("unreachable")
        return self.head(self.emb(x))


def test_a_model_that_cannot_run_on_fake_tensors_falls_back_to_6NT():
    task = Task(model_fn=NeedsValues, loss_fn=lambda m, b: m(b[0]).float().mean(),
                batch=(torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long)))
    cfg = _cfg()
    f = step_flops(task, cfg, world_size=2)
    n_params = 10 * 4 + 4 * 10 + 10
    assert f.method == ESTIMATED and f.hardware is None and "FLOP count failed" in f.note
    assert f.model == 6 * n_params * 10 * 3 * 2
    assert "6 x parameters x tokens" in f.describe()


def test_a_model_that_needs_real_storage_is_not_counted_and_says_so():
    def factory() -> nn.Module:
        probe = torch.empty(0)
        if probe.device.type == "meta" or is_fake(probe):
            raise RuntimeError("this constructor needs real storage")
        return nn.Linear(2, 2)
    f = step_flops(Task(model_fn=factory, loss_fn=lambda m, b: m(b).sum(), batch=torch.zeros(3, 2)), _cfg(), 1)
    assert f.method == UNKNOWN and f.model == 0 and f.hardware is None
    assert "meta device" in f.note and f.describe().startswith("not counted")


def test_counting_changes_no_global_state():
    cfg = _cfg(checkpointing={"policy": "all"}, precision={"mode": "bf16"})
    torch.manual_seed(3)
    before = torch.get_rng_state()
    step_flops(task_for(cfg), cfg, world_size=1)
    assert torch.equal(torch.get_rng_state(), before) and not torch.is_autocast_enabled("cpu")
    assert dataclasses.asdict(cfg) == dataclasses.asdict(_cfg(checkpointing={"policy": "all"},
                                                               precision={"mode": "bf16"}))


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
def test_attention_formulas_count_every_query_head_with_fewer_key_value_heads(heads):
    """Grouped-query attention (key and value with fewer heads, as a Llama with GQA runs it
    through SDPA's CPU or CUDA kernels) is counted per query head: the same as the equal-head
    attention it broadcasts to, on every torch (torch's own formula rejects it before 2.13)."""
    from torch.utils import flop_counter

    from mct.planner.work import attention_backward_flops, attention_flops
    h, h_kv = heads
    q, o = (2, h, 16, 8), (2, h, 16, 8)
    kv = (2, h_kv, 24, 8)
    full = (2, h, 24, 8)
    assert attention_flops(q, kv, kv) == attention_flops(q, full, full) == flop_counter.sdpa_flop_count(q, full, full)
    assert (attention_backward_flops(o, q, kv, kv) == attention_backward_flops(o, q, full, full)
            == flop_counter.sdpa_backward_flop_count(o, q, full, full))
    with pytest.raises(ValueError, match="multiple"):
        attention_flops((2, 5, 16, 8), (2, 2, 16, 8), (2, 2, 16, 8))
    # and a GQA model's step counts under the counter, each query head once
    qt, kt = torch.randn(q, requires_grad=True), torch.randn(kv, requires_grad=True)
    vt = torch.randn(kv, requires_grad=True)
    with FlopCounterMode(display=False, custom_mapping=EXTRA_FORMULAS) as counter:
        out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        out.sum().backward()
    assert counter.get_total_flops() == attention_flops(q, kv, kv) + attention_backward_flops(o, q, kv, kv)
