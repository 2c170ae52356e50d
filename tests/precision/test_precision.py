"""Precision policy, dynamic loss scaler and the non-finite gradient check."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from mct.config import PrecisionConfig
from mct.precision import LossScaleFloorError, LossScaler, PrecisionPolicy

INF, NAN = float("inf"), float("nan")

# 48 steps, "x" = overflow, "." = clean: growths (3 clean in a row), single and double
# back-offs, overflows right after a growth, long clean runs.
PATTERN = "...x..x....x.xx......x...x.x.........xx...x.....x"


def _drive(scaler: LossScaler, pattern: str) -> list[float]:
    scales = []
    for c in pattern:
        scaler.update(c == "x")
        scales.append(scaler.scale)
    return scales


def _grad_scaler_scales(init_scale: float, growth_interval: int, pattern: str) -> list[float]:
    """Drive torch.amp.GradScaler on CPU for real: backward, poison the grad, step, update."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    gs = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    scales = []
    for c in pattern:
        opt.zero_grad()
        gs.scale((p * 2.0).sum()).backward()
        if c == "x":
            p.grad[1] = INF
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gs.step(opt)
        gs.update()
        scales.append(gs.get_scale())
    return scales


def test_scaler_with_hysteresis_1_matches_torch_grad_scaler_step_for_step():
    ours = LossScaler(enabled=True, initial_scale_power=8, growth_interval=3, hysteresis=1, min_scale=2.0**-20)
    expected = _grad_scaler_scales(2.0**8, 3, PATTERN)
    got = _drive(ours, PATTERN)
    assert got == expected
    assert len(set(got)) > 3, "the pattern must exercise several growths and back-offs"
    assert ours.metrics()["overflows"] == PATTERN.count("x")


# Documented semantics, hysteresis=2, growth_interval=3, initial scale 16, min_scale 1.
# Columns: found_inf, scale after update, hysteresis_left after update, growth_tracker after update.
HYSTERESIS_2_TABLE = [
    (False, 16, 2, 1),
    (False, 16, 2, 2),
    (False, 32, 2, 0),  # 3 clean steps: grow, refill
    (True, 32, 1, 0),   # first overflow spends hysteresis, scale stays
    (False, 32, 1, 1),
    (True, 16, 1, 0),   # budget used up: halve; budget not refilled by the clean step between
    (True, 8, 1, 0),
    (False, 8, 1, 1),
    (False, 8, 1, 2),
    (False, 16, 2, 0),  # growth refills the budget
    (True, 16, 1, 0),
    (True, 8, 1, 0),
    (False, 8, 1, 1),
    (False, 8, 1, 2),
    (True, 4, 1, 0),    # overflow resets the clean-step counter
    (False, 4, 1, 1),
    (False, 4, 1, 2),
    (False, 8, 2, 0),
    (False, 8, 2, 1),
    (False, 8, 2, 2),
    (False, 16, 2, 0),
]


def test_scaler_with_hysteresis_2_follows_documented_table():
    s = LossScaler(enabled=True, initial_scale_power=4, growth_interval=3, hysteresis=2, min_scale=1.0)
    for i, (found_inf, scale, h_left, tracker) in enumerate(HYSTERESIS_2_TABLE):
        s.update(found_inf)
        st = s.state_dict()
        assert (st["scale"], st["hysteresis_left"], st["growth_tracker"]) == (scale, h_left, tracker), f"step {i + 1}"
    assert s.metrics() == {"loss_scale": 16.0, "overflows": 6, "skipped_steps": 6, "consecutive_skips": 0}


def test_overflow_at_min_scale_with_hysteresis_used_up_raises_floor_error_after_counting():
    s = LossScaler(enabled=True, initial_scale_power=3, growth_interval=100, hysteresis=2, min_scale=4.0)
    s.update(True)   # hysteresis 2 -> 1, scale 8
    s.update(True)   # scale 8 -> 4 = floor
    assert s.scale == 4.0
    with pytest.raises(LossScaleFloorError) as exc:
        s.update(True)
    msg = str(exc.value)
    assert "scale = 4" in msg and "3 consecutive" in msg
    assert "precision.mode = 'bf16'" in msg and "train.lr" in msg and "overflow fp16" in msg
    assert isinstance(exc.value, RuntimeError)
    assert s.metrics() == {"loss_scale": 4.0, "overflows": 3, "skipped_steps": 3, "consecutive_skips": 3}


def test_overflow_at_min_scale_with_hysteresis_left_does_not_raise():
    s = LossScaler(enabled=True, initial_scale_power=3, growth_interval=2, hysteresis=2, min_scale=8.0)
    s.update(True)   # at the floor from the start, but one overflow is tolerated
    assert s.scale == 8.0
    s.update(False)
    s.update(False)  # growth to 16 refills hysteresis
    s.update(True)
    s.update(True)   # 16 -> 8, no error: the scale could still back off
    assert s.scale == 8.0
    with pytest.raises(LossScaleFloorError):
        s.update(True)


def test_state_dict_round_trip_restores_identical_future_behaviour():
    cfg = dict(enabled=True, initial_scale_power=6, growth_interval=3, hysteresis=2, min_scale=0.5)
    a = LossScaler(**cfg)
    _drive(a, "..x..x.x....x.")
    state = json.loads(json.dumps(a.state_dict()))  # plain numbers only
    b = LossScaler(**cfg)
    assert b.state_dict() != state
    b.load_state_dict(state)
    future = "x...x.x.x......xx..x"
    assert _drive(b, future) == _drive(a, future)
    assert b.metrics() == a.metrics()
    assert b.state_dict() == a.state_dict()


def test_loading_fp16_state_into_disabled_scaler_keeps_counters_and_scale_one():
    a = LossScaler(enabled=True, initial_scale_power=6, growth_interval=3)
    _drive(a, "x.x")
    b = LossScaler(enabled=False)
    b.load_state_dict(a.state_dict())
    assert b.scale == 1.0 and b.metrics()["skipped_steps"] == 2


def test_load_state_dict_rejects_missing_keys_and_bad_scale():
    s = LossScaler(enabled=True)
    with pytest.raises(ValueError, match="missing keys"):
        s.load_state_dict({"scale": 2.0})
    bad = s.state_dict() | {"scale": INF}
    with pytest.raises(ValueError, match="scale = inf"):
        s.load_state_dict(bad)


def test_disabled_scaler_is_identity_counts_skips_and_never_raises():
    s = LossScaler.from_config(PrecisionConfig(mode="bf16", min_scale=1.0, initial_scale_power=0))
    loss = torch.tensor(2.5, dtype=torch.bfloat16, requires_grad=True)
    assert not s.enabled and s.scale == 1.0 and s.inv_scale == 1.0
    assert s.scale_loss(loss) is loss
    for _ in range(5):
        s.update(True)
    assert s.scale == 1.0
    assert s.metrics() == {"loss_scale": None, "overflows": 0, "skipped_steps": 5, "consecutive_skips": 5}
    s.update(False)
    assert s.metrics()["consecutive_skips"] == 0


def test_enabled_scaler_scales_loss_in_fp32_and_grads_unscale_exactly():
    s = LossScaler.from_config(PrecisionConfig(mode="fp16", initial_scale_power=10))
    w = torch.tensor([0.5, -1.5], dtype=torch.float16, requires_grad=True)
    loss = (w.float() * torch.tensor([3.0, 4.0])).sum()
    scaled = s.scale_loss(loss)
    assert scaled.dtype == torch.float32 and scaled.item() == loss.item() * 1024
    scaled.backward()
    assert w.grad.dtype == torch.float16
    assert (w.grad.float() * s.inv_scale).tolist() == [3.0, 4.0]


@pytest.mark.parametrize("kwargs, key", [
    (dict(growth_interval=0), "precision.growth_interval"),
    (dict(hysteresis=0), "precision.hysteresis"),
    (dict(initial_scale_power=-1), "precision.initial_scale_power"),
    (dict(initial_scale_power=True), "precision.initial_scale_power"),
    (dict(min_scale=0.0), "precision.min_scale"),
    (dict(initial_scale_power=2, min_scale=8.0), "precision.min_scale"),
])
def test_scaler_rejects_bad_arguments_naming_the_value(kwargs, key):
    with pytest.raises(ValueError, match=key):
        LossScaler(enabled=True, **kwargs)


@pytest.mark.parametrize("mode, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_policy_dtypes_per_mode(mode, dtype):
    p = PrecisionPolicy.from_config(PrecisionConfig(mode=mode))
    assert (p.param_dtype, p.compute_dtype, p.reduce_dtype, p.master_dtype) == (dtype, dtype, torch.float32, torch.float32)
    assert p.has_master == (mode != "fp32")
    q = PrecisionPolicy.from_config(PrecisionConfig(mode=mode, reduce_dtype="param"))
    assert q.reduce_dtype == dtype


@pytest.mark.parametrize("mode, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_policy_autocast_runs_cpu_matmul_in_compute_dtype(mode, dtype):
    p = PrecisionPolicy.for_mode(mode)
    a, b = torch.randn(4, 8), torch.randn(8, 2)
    with p.autocast("cpu"):
        assert (a @ b).dtype == dtype
        assert torch.nn.functional.linear(a, b.t()).dtype == dtype
    assert (a @ b).dtype == torch.float32


def test_policy_fp32_autocast_is_a_no_op():
    p = PrecisionPolicy.for_mode("fp32")
    a = torch.randn(4, 8)
    with p.autocast(torch.device("cpu")):
        assert not torch.is_autocast_enabled("cpu")
        assert (a @ a.t()).dtype == torch.float32


def test_policy_rejects_unknown_mode_and_reduce_dtype():
    with pytest.raises(ValueError, match="'fp8'"):
        PrecisionPolicy.for_mode("fp8")
    with pytest.raises(ValueError, match="'fp16'"):
        PrecisionPolicy.for_mode("bf16", reduce_dtype="fp16")
    with pytest.raises(ValueError, match="reduce_dtype"):
        PrecisionPolicy(mode="bf16", param_dtype=torch.bfloat16, compute_dtype=torch.bfloat16,
                        reduce_dtype=torch.float16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_policy_autocast_on_cuda(mode, dtype):
    a = torch.randn(4, 8, device="cuda")
    with PrecisionPolicy.for_mode(mode).autocast("cuda"):
        assert (a @ a.t()).dtype == dtype
        assert torch.softmax(a, -1).dtype == torch.float32  # CUDA autocast promotes softmax
