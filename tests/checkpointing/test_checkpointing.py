"""Activation checkpointing: exact replay, real recomputation, memory saved, seams."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from mct.checkpointing import apply_checkpointing, find_blocks, plan_regions, saved_activation_bytes
from mct.config import CheckpointingConfig, ModelConfig
from mct.models.gpt import GPT, gpt_loss

TINY = ModelConfig(n_layer=4, n_head=2, d_model=32, seq_len=16, dropout=0.1)
POLICIES = ["all", "every_k", "sqrt", "selective"]


def _batch(cfg: ModelConfig = TINY, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
    return x.to(device), y.to(device)


def _gpt(policy: str, cfg: ModelConfig = TINY, device: str = "cpu", **kw):
    torch.manual_seed(1)
    model = GPT(cfg).to(device).train()
    return model, apply_checkpointing(model, CheckpointingConfig(policy=policy, **kw))


def _loss_and_grads(model: nn.Module, batch, autocast: bool = False):
    torch.manual_seed(2)  # same dropout masks for every policy
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx:
        loss = gpt_loss(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _assert_bitwise(a, b) -> None:
    assert torch.equal(a[0], b[0]), (a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


@pytest.mark.parametrize("policy", POLICIES)
def test_policy_matches_none_bitwise_with_dropout(policy):
    ref = _loss_and_grads(_gpt("none")[0], _batch())
    model, state = _gpt(policy)
    _assert_bitwise(_loss_and_grads(model, _batch()), ref)
    assert state.metrics()["recompute_calls"] == len(state.regions) > 0


def test_autocast_bf16_matches_none_bitwise():
    ref = _loss_and_grads(_gpt("none")[0], _batch(), autocast=True)
    model, state = _gpt("all")
    _assert_bitwise(_loss_and_grads(model, _batch(), autocast=True), ref)
    assert state.recompute_calls == TINY.n_layer


def _fwd_bwd_flops(model: nn.Module) -> tuple[int, int]:
    torch.manual_seed(2)
    with FlopCounterMode(display=False) as fwd:
        loss = gpt_loss(model, _batch())
    with FlopCounterMode(display=False) as bwd:
        loss.backward()
    return fwd.get_total_flops(), bwd.get_total_flops()


def _blocks_forward_flops(model: GPT) -> int:
    x = torch.randn(2, TINY.seq_len, TINY.d_model)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        for block in model.blocks:
            x = block(x)
    return fc.get_total_flops()


def test_all_recomputes_exactly_one_forward_of_the_blocks():
    none_model = _gpt("none")[0]
    none_fwd, none_bwd = _fwd_bwd_flops(none_model)
    all_fwd, all_bwd = _fwd_bwd_flops(_gpt("all")[0])
    blocks_fwd = _blocks_forward_flops(none_model)
    # Counted ops are matmuls and attention, whose backward is exactly twice the forward:
    # so 'none' does no recompute at all.
    assert none_bwd == 2 * none_fwd
    assert all_fwd == none_fwd
    assert blocks_fwd > 0 and all_bwd - none_bwd == blocks_fwd


def test_selective_keeps_matmul_outputs_and_recomputes_fewer_flops_than_all():
    _, none_bwd = _fwd_bwd_flops(_gpt("none")[0])
    _, all_bwd = _fwd_bwd_flops(_gpt("all")[0])
    _, sel_bwd = _fwd_bwd_flops(_gpt("selective")[0])
    # Only matmul/attention FLOPs are counted and selective saves exactly those outputs.
    assert sel_bwd == none_bwd < all_bwd


def test_all_keeps_at_most_0_3_of_none_activation_bytes_at_8_layers():
    # Unit U = one fp32 [B, T, d_model] tensor. 'none' keeps, per block, at least: ln_1
    # input and output (2U), qkv (3U), attention output and its reshaped copy (2U),
    # the residual sum (1U), ln_2 output (1U), fc and gelu outputs (8U), dropout masks
    # (>= 2U): >= 19U. 'all' keeps only each block's input: 1U. Outside the blocks both
    # keep the same O ~ 11U (embedding dropout mask, ln_f, log-softmax over vocab = 8U).
    # Ratio <= (8*1 + O) / (8*19 + O) = 19/163 ~ 0.12; 0.3 allows O up to ~70U.
    cfg = ModelConfig(n_layer=8, n_head=2, d_model=32, seq_len=16, dropout=0.1)
    kept = {}
    for policy in ("none", "all"):
        model, _ = _gpt(policy, cfg)
        loss, kept[policy] = saved_activation_bytes(lambda: gpt_loss(model, _batch(cfg)))
        loss.backward()
    assert 0 < kept["all"] <= 0.3 * kept["none"], kept


class HFLayer(nn.Module):
    """Hugging Face-style layer: extra positional and keyword-only args, tuple + dict out."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, hidden_states, attention_mask=None, *, scale=1.0):
        h = self.drop(torch.tanh(self.fc(hidden_states))) * scale
        if attention_mask is not None:
            h = h * attention_mask
        return hidden_states + h, {"pre_scale": h / scale}


class HFModel(nn.Module):
    def __init__(self, n: int = 4, d: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(HFLayer(d) for _ in range(n))

    def forward(self, x, mask):
        aux = 0.0
        for layer in self.layers:
            outputs = layer(x, mask, scale=0.5)
            x = outputs[0]
            aux = aux + outputs[1]["pre_scale"].sum()
        return x.square().mean() + aux


def _hf_run(policy: str, x_requires_grad: bool = True):
    torch.manual_seed(3)
    model = HFModel().train()
    state = apply_checkpointing(model, CheckpointingConfig(policy=policy))
    x = torch.randn(2, 5, 8, requires_grad=x_requires_grad)
    mask = torch.ones(2, 5, 1)
    torch.manual_seed(4)
    loss = model(x, mask)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    if x_requires_grad:
        grads["x"] = x.grad
    return model, state, (loss.detach(), grads)


@pytest.mark.parametrize("policy", ["all", "sqrt"])
def test_hf_style_layer_with_kwargs_and_tuple_dict_output(policy):
    ref_model, _, ref = _hf_run("none")
    model, state, got = _hf_run(policy)
    _assert_bitwise(got, ref)
    assert state.recomputed_blocks == 4
    assert list(model.state_dict()) == list(ref_model.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref_model.named_parameters()]


def test_remove_restores_the_class_forward():
    model, state, _ = _hf_run("sqrt")
    assert all("forward" in layer.__dict__ for layer in model.layers)
    state.remove()
    assert all("forward" not in layer.__dict__ for layer in model.layers)
    apply_checkpointing(model, CheckpointingConfig(policy="all"))  # can apply again


@pytest.mark.parametrize("policy", ["all", "sqrt"])
def test_input_not_requiring_grad(policy):
    _, _, ref = _hf_run("none", x_requires_grad=False)
    _, _, got = _hf_run(policy, x_requires_grad=False)
    _assert_bitwise(got, ref)


def test_forward_pre_hooks_fire_again_in_sqrt_recompute():
    model, state = _gpt("sqrt")
    calls = {i: 0 for i in range(TINY.n_layer)}
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
    torch.manual_seed(2)
    loss = gpt_loss(model, _batch())
    assert set(calls.values()) == {1}
    loss.backward()
    assert set(calls.values()) == {2}
    assert state.metrics()["recompute_calls"] == 2  # ceil(sqrt(4)) = 2 blocks per region


def test_state_reports_recomputing_to_hooks_and_kwarg_chained_input_works():
    torch.manual_seed(3)
    model = HFModel().train()
    state = apply_checkpointing(model, CheckpointingConfig(policy="sqrt"))
    seen = []
    model.layers[1].register_forward_pre_hook(lambda m, a: seen.append(state.recomputing))
    x = torch.randn(2, 5, 8, requires_grad=True)
    for layer in model.layers:  # chained input passed by keyword
        x = layer(hidden_states=x, attention_mask=None)[0]
    x.sum().backward()
    assert seen == [False, True] and not state.recomputing


def test_no_grad_forward_is_not_checkpointed():
    model, state = _gpt("all")
    with torch.no_grad():
        gpt_loss(model, _batch())
    assert state.recompute_calls == 0 and state.regions[0]._open is None


class NoisyBlock(nn.Module):
    """Adds noise from its own generator, which advances on every call: the replay differs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.gen = torch.Generator().manual_seed(5)

    def forward(self, x):
        return self.fc(x) + torch.randn(x.shape, generator=self.gen)


def test_verify_catches_non_deterministic_block_by_name():
    model = nn.Sequential()
    model.layers = nn.ModuleList([nn.Linear(8, 8), NoisyBlock(), nn.Linear(8, 8)])
    state = apply_checkpointing(model, CheckpointingConfig(policy="all", verify=True))
    x = torch.randn(2, 8, requires_grad=True)
    for layer in model.layers:
        x = layer(x)
    with pytest.raises(RuntimeError, match=r"'layers\.1'.*max abs difference") as err:
        x.sum().backward()
    assert "non-deterministic" in str(err.value)
    assert not state.verified


def test_verify_passes_on_gpt_with_dropout_then_costs_nothing():
    model, state = _gpt("sqrt", verify=True)
    _loss_and_grads(model, _batch())
    assert state.verified
    torch.manual_seed(2)
    gpt_loss(model, _batch())  # second step: regions keep no copies of block outputs
    assert all(r._open is None for r in state.regions)


def test_sqrt_rejects_blocks_that_do_not_chain():
    model, _ = _gpt("sqrt")
    x = torch.randn(2, TINY.seq_len, TINY.d_model, requires_grad=True)
    model.blocks[0](x)
    with pytest.raises(ValueError, match="do not chain"):
        model.blocks[1](x.clone())


def test_recompute_context_and_metrics_reset():
    entered = []

    @contextlib.contextmanager
    def category():
        entered.append(1)
        yield

    torch.manual_seed(1)
    model = GPT(TINY).train()
    state = apply_checkpointing(model, CheckpointingConfig(policy="all"), recompute_context=category)
    _loss_and_grads(model, _batch())
    m = state.metrics()
    assert len(entered) == m["recompute_calls"] == m["recompute_checkpointed_blocks"] == TINY.n_layer
    assert m["recompute_policy"] == "all" and m["recompute_time_s"] > 0
    state.reset_step()
    assert state.metrics()["recompute_calls"] == 0 and state.recompute_time_s == 0.0


def test_plan_regions():
    assert plan_regions("none", 4, 2) == []
    assert plan_regions("all", 3, 2) == [[0], [1], [2]]
    assert plan_regions("every_k", 5, 2) == [[0], [2], [4]]
    assert plan_regions("sqrt", 8, 2) == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_find_blocks_by_default_and_by_class_name():
    model = GPT(TINY)
    assert [n for n, _ in find_blocks(model)] == [f"blocks.{i}" for i in range(TINY.n_layer)]
    assert [n for n, _ in find_blocks(model, ["MLP"])] == [f"blocks.{i}.mlp" for i in range(TINY.n_layer)]


def test_find_blocks_prefers_the_longest_list_of_one_repeated_class():
    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # a longer mixed list (heads of different kinds) next to the layer stack
            self.heads = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2),
                                              torch.nn.ReLU()])
            self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])
    assert [n for n, _ in find_blocks(Stack())] == ["layers.0", "layers.1", "layers.2"]
    mixed = torch.nn.Module()
    mixed.only = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.ReLU()])
    assert [n for n, _ in find_blocks(mixed)] == ["only.0", "only.1"]  # the fallback: no repeated list


def test_config_errors():
    with pytest.raises(ValueError, match="checkpointing.policy"):
        CheckpointingConfig(policy="bogus")
    with pytest.raises(ValueError, match="checkpointing.k"):
        CheckpointingConfig(k=0)
    with pytest.raises(ValueError, match=r"k = 5 .*\(4\)"):
        apply_checkpointing(GPT(TINY), CheckpointingConfig(policy="every_k", k=5))
    with pytest.raises(ValueError, match=r"'Nope'.*Block"):
        apply_checkpointing(GPT(TINY), CheckpointingConfig(policy="all", blocks=["Nope"]))
    with pytest.raises(ValueError, match=r"checkpointing.blocks = \[\"MyLayer\"\]"):
        apply_checkpointing(nn.Linear(2, 2), CheckpointingConfig(policy="all"))
    with pytest.raises(ValueError, match="'auto' must be resolved by the memory planner"):
        apply_checkpointing(GPT(TINY), CheckpointingConfig(policy="auto"))
    model = GPT(TINY)
    apply_checkpointing(model, CheckpointingConfig(policy="all"))
    with pytest.raises(ValueError, match="already checkpointed"):
        apply_checkpointing(model, CheckpointingConfig(policy="all"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["all", "sqrt"])
def test_cuda_dropout_replay_matches_none_bitwise(policy):
    ref = _loss_and_grads(_gpt("none", device="cuda")[0], _batch(device="cuda"))
    model, state = _gpt(policy, device="cuda", verify=True)
    _assert_bitwise(_loss_and_grads(model, _batch(device="cuda")), ref)
    assert state.verified
