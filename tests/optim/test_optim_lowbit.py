"""mct.optim.lowbit: the codecs, the counter-based noise, the AdamW arithmetic against
torch's, the fused CPU kernel against the torch reference (the same bytes), and the
engine's [optimizer] wiring (bytes per parameter, errors)."""

from __future__ import annotations

import pytest
import torch

import mct

from mct.config import EngineConfig
from mct.engine import Engine
from mct.models.gpt import GPT, gpt_loss, optimizer_groups
from mct.optim import AdamW, make_adamw
from mct.optim.lowbit import BLOCK, LowPrecisionAdamW, codec, native, noise
from tests.helpers import batches, tiny_config


def _grads(n: int, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(n, generator=g) * (torch.arange(n) % 7 + 1) * 10.0 ** -(s % 3) for s in range(steps)]


def _run(opt_fn, p0: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    p = p0.clone().requires_grad_()
    opt = opt_fn([p])
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def test_fp32_state_is_torch_adamw_bit_for_bit():
    p0, grads = torch.randn(BLOCK * 5), _grads(BLOCK * 5, 12)
    kw = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    ref = _run(lambda ps: torch.optim.AdamW(ps, foreach=False, **kw), p0, grads)
    got = _run(lambda ps: LowPrecisionAdamW(ps, state_dtype="fp32", **kw), p0, grads)
    assert torch.equal(ref, got)


@pytest.mark.parametrize("state_dtype,tol", [("bf16", 0.01), ("int8", 0.05)])
def test_low_precision_state_tracks_fp32_updates(state_dtype, tol):
    p0, grads = torch.randn(BLOCK * 40), _grads(BLOCK * 40, 30)
    kw = {"lr": 1e-2, "betas": (0.9, 0.999), "weight_decay": 0.0}
    ref = _run(lambda ps: torch.optim.AdamW(ps, **kw), p0, grads)
    got = _run(lambda ps: LowPrecisionAdamW(ps, state_dtype=state_dtype, **kw), p0, grads)
    rel = float((got - ref).norm() / (ref - p0).norm())
    assert rel < tol, rel


def test_int8_codecs_error_bounds_and_no_zero_second_moment():
    x = torch.randn(BLOCK * 8) * torch.logspace(-6, 0, BLOCK * 8)
    codes, scales = torch.empty(x.numel(), dtype=torch.int8), torch.empty(8)
    codec.encode_signed(x.clone(), codes, scales)
    back = codec.decode_signed(codes, scales, torch.empty_like(x))
    step = scales.repeat_interleave(BLOCK) * (2 * x.abs().div(scales.repeat_interleave(BLOCK)).sqrt() / 127 + 1 / 127**2)
    assert bool(((back - x).abs() <= step).all())
    v = x.square()
    ucodes = torch.empty(v.numel(), dtype=torch.uint8)
    codec.encode_unsigned(v.clone(), ucodes, scales)
    vb = codec.decode_unsigned(ucodes, scales, torch.empty_like(v))
    assert bool((vb[v > 0] > 0).all())  # Adam divides by sqrt(v): a positive v never becomes 0
    big = v > scales.repeat_interleave(BLOCK) * 1e-4
    assert float(((vb - v).abs() / v)[big].max()) < 0.12


def test_stochastic_rounding_is_unbiased_and_a_function_of_the_global_index():
    n = noise.T
    table = noise.NoiseTable(7, torch.device("cpu"))
    x = torch.full((n,), 1.0 + 2.0**-10)  # between two bf16 values
    out = torch.empty(n, dtype=torch.bfloat16)
    codec.round_bf16(x.clone(), out, table.bits16(2, 3, 4, 0, n))
    assert abs(float(out.float().mean()) - float(x[0])) < 2.0**-14
    u = table.uniform(2, 3, 4, 0, n)
    assert abs(float(u.mean()) - 0.5) < 0.01 and float(u.min()) >= 0 and float(u.max()) < 1
    # a piece of the global tensor starting at 1000 draws what the whole tensor draws there
    assert torch.equal(table.uniform(2, 3, 4, 1000, 500), table.uniform(2, 3, 4, 0, 1500)[1000:])
    assert torch.equal(table.uniform(2, 3, 4, 9000, 8000), table.uniform(2, 3, 4, 8000, 9000)[1000:])
    assert not torch.equal(table.uniform(2, 3, 4, 0, 64), table.uniform(2, 4, 4, 0, 64))  # a new step
    assert torch.equal(noise.NoiseTable(7, torch.device("cpu")).uniform(2, 3, 4, 0, 64), table.uniform(2, 3, 4, 0, 64))


def _shard_run(state_dtype: str, n: int, offset: int, use_native: bool | None) -> tuple[list[torch.Tensor], LowPrecisionAdamW]:
    """4 steps on a shard of ``n`` elements placed at ``offset``: gradients over 11 decades,
    a block of zero gradients at step 2 (a zero absmax). Returns the weights and state."""
    torch.manual_seed(0)
    p = torch.randn(n).requires_grad_()
    opt = LowPrecisionAdamW([p], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, state_dtype=state_dtype, seed=3,
                            native=use_native)
    if n % BLOCK == 0:  # ``place`` refuses a shard of part blocks
        opt.place(p, offset, 2)
    g = torch.Generator().manual_seed(1)
    for s in range(4):
        p.grad = torch.randn(n, generator=g) * torch.logspace(-9, 2, n)[torch.randperm(n, generator=g)]
        p.grad[BLOCK:2 * BLOCK] *= float(s != 2)
        opt.step()
    return [p.detach(), *opt.state[p].values()], opt


@pytest.mark.skipif(native.compiler() is None, reason="no C compiler: the fused kernel cannot be built here")
@pytest.mark.parametrize("state_dtype", ["int8", "bf16"])
def test_fused_kernel_writes_the_bytes_of_the_torch_reference(state_dtype):
    """The kernel (one call per shard, or two threads' halves) and the reference (64K-element
    chunks, the last one partial) give identical weights and state: a small shard, and one
    of two chunks and a piece placed off a chunk boundary."""
    threads = torch.get_num_threads()
    for n, offset, k in ((3 * BLOCK, 0, 1), (2 * noise.T + 5 * BLOCK, 77 * BLOCK, 2)):
        torch.set_num_threads(k)
        try:
            fast, opt = _shard_run(state_dtype, n, offset, None)
        finally:
            torch.set_num_threads(threads)
        ref, _ = _shard_run(state_dtype, n, offset, False)
        assert opt._kernels is not None  # the default ran the kernel
        for a, b in zip(fast, ref):
            assert a.dtype == b.dtype and torch.equal(a, b), (state_dtype, n, a.dtype)
    if state_dtype == "bf16":  # not whole blocks (no engine to align it): the reference, every element stepped
        fast, opt = _shard_run(state_dtype, BLOCK * 2 + 5, 0, None)
        ref, _ = _shard_run(state_dtype, BLOCK * 2 + 5, 0, False)
        assert all(torch.equal(a, b) for a, b in zip(fast, ref)) and bool((fast[2][-5:] != 0).all())  # exp_avg


def test_native_true_without_a_compiler_is_refused_and_the_default_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    p = torch.zeros(BLOCK, requires_grad=True)
    with pytest.raises(ValueError, match="could not be built with .*no-such-cc.*native=None"):
        LowPrecisionAdamW([p], state_dtype="int8", native=True)
    opt = LowPrecisionAdamW([p], state_dtype="int8")
    p.grad = torch.ones(BLOCK)
    opt.step()
    assert opt._kernels is None and float(p.detach()[0]) < 0  # the torch reference stepped


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("state_dtype,most", [("fp32", 8.01), ("bf16", 4.1), ("int8", 2.1)])
def test_tracker_counts_the_smaller_state(stage, state_dtype, most):
    cfg = tiny_config(zero={"stage": stage}, precision={"mode": "bf16"}, optimizer={"state_dtype": state_dtype},
                      model={"d_model": 64})
    torch.manual_seed(0)
    model = GPT(cfg.model)
    n = sum(p.numel() for p in model.parameters())
    e = Engine(model, make_adamw(cfg.optimizer, lr=1e-2, seed=cfg.seed, fused=True), cfg,
               param_groups=optimizer_groups(model, 0.1))
    e.train_step(batches(0, 0), gpt_loss)
    per_param = e.tracker.live()["optimizer"] / n
    assert per_param <= most and per_param >= most - 0.2
    assert e.model_state_bytes()["optimizer"] == e.tracker.live()["optimizer"]
    assert isinstance(e.optimizer, torch.optim.AdamW) == (state_dtype == "fp32")


def test_planner_dry_run_predicts_the_low_precision_step_exactly():
    """The dry run (fake tensors) takes the step's real path: the fused kernel allocates
    its noise table and nothing per chunk, and the prediction is the tracker's peak."""
    cfg = tiny_config(zero={"stage": 2}, optimizer={"state_dtype": "int8"})
    factory = make_adamw(cfg.optimizer, lr=1e-3, seed=0)
    pred = mct.predict_peak(lambda: GPT(cfg.model), gpt_loss, batches(0, 0, 1)[0], cfg, world_size=1,
                            optimizer=factory)
    torch.manual_seed(0)
    e = Engine(GPT(cfg.model), factory, cfg)
    peaks = [e.train_step(batches(s, 0, 1)[0], gpt_loss).metrics["peak_bytes"] for s in range(2)]
    assert pred == peaks[1]


def test_default_fp32_path_is_unchanged():
    """fp32 state: torch's fused AdamW as before (mct.optim.AdamW, torch's without the
    dynamo wrappers), and the layout keeps its old padding."""
    cfg = tiny_config(zero={"stage": 1})
    opt = make_adamw(cfg.optimizer, lr=1e-3, seed=0, fused=True)([{"params": [torch.zeros(3, requires_grad=True)]}])
    assert type(opt) is AdamW and isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["fused"] and opt.defaults["betas"] == (0.9, 0.999)
    torch.manual_seed(0)
    e = Engine(GPT(cfg.model), None, cfg)
    assert all(u.layout.shard_align == 1 for u in e.sharded.units)
    assert type(e.optimizer) is AdamW and e.optimizer.defaults["betas"] == (0.9, 0.999)


def test_config_errors_are_one_line_with_the_fix():
    with pytest.raises(ValueError, match="optimizer.state_dtype.*'fp16'"):
        EngineConfig.from_dict({"optimizer": {"state_dtype": "fp16"}})
    with pytest.raises(ValueError, match="set train.lr"):
        EngineConfig.from_dict({"optimizer": {"lr": 1e-3}})
    # offloaded low-precision state is streamed compressed (tests/offload/test_offload_lowbit.py)
    assert EngineConfig.from_dict({"optimizer": {"state_dtype": "int8"}, "offload": {"optimizer": "cpu"}}).offload.enabled
    with pytest.raises(ValueError, match="optimizer.betas"):
        EngineConfig.from_dict({"optimizer": {"betas": [0.9]}})
    assert EngineConfig.from_dict({"optimizer": {"betas": [0.8, 0.9], "eps": 1e-6}}).optimizer.betas == [0.8, 0.9]


def test_hand_written_factory_under_a_low_precision_config_is_refused():
    cfg = tiny_config(optimizer={"state_dtype": "int8"})
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="make_adamw"):
        Engine(GPT(cfg.model), lambda groups: torch.optim.AdamW(groups, lr=1e-3), cfg)


def test_checkpoint_of_other_state_dtype_is_refused(tmp_path):
    cfg = tiny_config(optimizer={"state_dtype": "int8"})
    torch.manual_seed(0)
    e = Engine(GPT(cfg.model), None, cfg)
    e.train_step(batches(0, 0), gpt_loss)
    sd = e.state_dict()
    torch.manual_seed(0)
    f = Engine(GPT(cfg.model), None, tiny_config())
    with pytest.raises(ValueError):
        f.load_state_dict(sd)
    torch.manual_seed(0)
    g = Engine(GPT(cfg.model), None, tiny_config(optimizer={"state_dtype": "bf16"}))
    with pytest.raises(ValueError, match="set optimizer.state_dtype"):
        g.load_state_dict(sd)
