"""MemoryTracker: every count below is computed by hand from shapes and dtypes."""

from __future__ import annotations

import gc
import pickle
import weakref

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from mct.memory import CATEGORIES, MemoryBudgetExceeded, MemoryTracker

F32 = 4


def _zeros(**nonzero: int) -> dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0) | nonzero
    out["total"] = sum(out[c] for c in CATEGORIES)
    return out


def _two_linears() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3))


PARAM_BYTES = (7 * 5 + 5 + 5 * 3 + 3) * F32  # 232


def test_registered_params_count_exact_bytes():
    model, tracker = _two_linears(), MemoryTracker()
    for p in model.parameters():
        tracker.register(p, "params")
    assert tracker.live() == _zeros(params=PARAM_BYTES)
    tracker.register(model[0].weight, "params")  # registering twice counts once
    assert tracker.live()["total"] == PARAM_BYTES


def test_adam_state_is_two_moments_plus_one_fp32_step_per_param():
    model, tracker = _two_linears(), MemoryTracker()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 7)).sum().backward()
    opt.step()
    for state in opt.state.values():
        for value in state.values():
            tracker.register(value, "optimizer")
    # exp_avg and exp_avg_sq mirror each param; `step` is a 0-dim fp32 CPU tensor per param
    # (torch keeps it on CPU unless capturable/fused).
    n_tensors = len(list(model.parameters()))
    assert tracker.live() == _zeros(optimizer=2 * PARAM_BYTES + n_tensors * F32)


def test_optimizer_state_made_inside_category_is_counted_without_register():
    model, tracker = _two_linears(), MemoryTracker()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 7)).sum().backward()
    with tracker.category("optimizer"):
        opt.step()  # its temporaries are freed again before it returns
    assert tracker.live() == _zeros(optimizer=2 * PARAM_BYTES + 4 * F32)


def _known_ops(tracker: MemoryTracker) -> list:
    """x [4, 8] fp32 (made outside), w [8, 16]: returns live/peak at each step."""
    x, w = torch.randn(4, 8), torch.randn(8, 16)
    seen = []
    with tracker.phase("forward"):
        y = x @ w                      # 4*16*4 = 256
        seen.append(tracker.live()["total"])
        z = y.relu()                   # +256
        seen.append(tracker.live()["total"])
        v = z.view(16, 4)              # view: same storage
        z.add_(1.0)                    # in place: nothing new
        seen.append(tracker.live()["total"])
    del y
    seen.append(tracker.live()["total"])
    del z
    seen.append(tracker.live()["total"])  # v still holds z's storage
    del v
    seen.append(tracker.live()["total"])
    seen.append(tracker.peaks())
    return seen


def test_known_op_sequence_counts_views_and_inplace_as_free_and_returns_bytes_on_delete():
    seen = _known_ops(MemoryTracker())
    assert seen[:6] == [256, 512, 512, 256, 256, 0]
    assert seen[6] == {"forward": _zeros(activations=512)}


def test_counts_are_deterministic_across_runs():
    runs = [_known_ops(MemoryTracker()) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]


def _mlp_step(tracker: MemoryTracker) -> tuple[dict, dict, dict]:
    torch.manual_seed(0)
    w1 = torch.randn(8, 16, requires_grad=True)  # 512 B
    w2 = torch.randn(16, 4, requires_grad=True)  # 256 B
    x = torch.randn(2, 8)
    for w in (w1, w2):
        tracker.register(w, "params")
    with tracker.phase("forward"):
        h = x @ w1                     # 128
        a = h.relu()                   # 128, peak so far 256
        loss = (a @ w2).sum()          # 32 temporary + 4 -> peak 292, then the 32 is freed
    after_forward = tracker.live()
    with tracker.phase("backward", category="grads"):
        loss.backward()
    for w in (w1, w2):
        tracker.register(w.grad, "grads")
    after_backward = tracker.live()
    del h, a, loss
    return tracker.peaks(), after_forward, after_backward


def test_mlp_forward_backward_peaks_are_reproducible_and_categories_add_up():
    params = (8 * 16 + 16 * 4) * F32
    runs = [_mlp_step(MemoryTracker()) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    peaks, after_forward, after_backward = runs[0]
    assert peaks["forward"] == _zeros(params=params, activations=292)
    assert after_forward == _zeros(params=params, activations=260)
    # backward temporaries are gone; what is left in "grads" is exactly w1.grad + w2.grad
    assert after_backward == _zeros(params=params, activations=260, grads=params)
    assert peaks["backward"]["grads"] >= params
    for snap in peaks.values():
        assert snap["total"] == sum(snap[c] for c in CATEGORIES)


def test_disabled_tracker_counts_nothing_and_installs_no_mode():
    tracker = MemoryTracker(enabled=False, budget_bytes=1)
    w = torch.randn(8, 8)
    tracker.register(w, "params")
    with tracker.phase("forward"):
        assert _get_current_dispatch_mode() is None
        with tracker.category("grads"):
            y = w @ w
    assert tracker.live() == _zeros()
    assert tracker.peaks() == {"forward": _zeros()}
    assert tracker.peak_total() == 0
    assert y.shape == (8, 8)


def test_enabled_phase_installs_the_mode_only_while_inside():
    tracker = MemoryTracker()
    with tracker.phase("outer"):
        with tracker.phase("inner"):
            assert _get_current_dispatch_mode() is not None
    assert _get_current_dispatch_mode() is None


def test_budget_exceeded_names_phase_budget_and_suggestion_and_stays_consistent():
    tracker = MemoryTracker(budget_bytes=400, suggestion=lambda: "enable activation checkpointing")
    x, w = torch.randn(4, 8), torch.randn(8, 16)
    with pytest.raises(MemoryBudgetExceeded) as info:
        with tracker.phase("forward"):
            y = x @ w          # 256: under
            z = y.relu()       # 512: over
    # the traceback's frames hold the tensor that tipped it over; drop them as a caller would
    err = info.value.with_traceback(None)
    del info
    assert err.phase == "forward" and err.budget == 400
    assert err.live == _zeros(activations=512)
    assert "'forward'" in str(err) and "400 B" in str(err) and "activations 512 B" in str(err)
    assert "enable activation checkpointing" in str(err)
    # the tensor that tipped it over was never returned: its bytes are gone again
    gc.collect()
    assert tracker.live() == _zeros(activations=256)
    del y
    assert tracker.live() == _zeros()
    assert pickle.loads(pickle.dumps(err)).live == err.live


def test_budget_exactly_reached_does_not_raise():
    tracker = MemoryTracker(budget_bytes=512)
    x, w = torch.randn(4, 8), torch.randn(8, 16)
    with tracker.phase("forward"):
        y = x @ w
        z = y.relu()
    assert tracker.peak_total() == 512
    del y, z


def test_budget_exceeded_in_backward_propagates_its_type():
    tracker = MemoryTracker(budget_bytes=300)
    a = torch.randn(10, 10, requires_grad=True)
    loss = (a * 2).sum()
    with pytest.raises(MemoryBudgetExceeded, match="'backward'"):
        with tracker.phase("backward", category="grads"):
            loss.backward()    # the 400 B gradient crosses 300 B
    assert tracker.live() == _zeros()


def test_dtype_conversion_to_bf16_allocates_half():
    tracker = MemoryTracker()
    x = torch.randn(4, 8)
    with tracker.phase("forward"):
        h = x.to(torch.bfloat16)
        same = h.to(torch.bfloat16)  # no-op conversion returns the same tensor
    assert tracker.live() == _zeros(activations=4 * 8 * 2)
    assert same is h


def test_resize_to_zero_and_back_with_refresh_like_zero3_param_buffers():
    tracker = MemoryTracker()
    p = nn.Parameter(torch.randn(10, 4))
    tracker.register(p, "params")
    tracker.reset_peaks()
    storage = p.untyped_storage()
    storage.resize_(0)              # freed in place: invisible until refresh
    assert tracker.live()["params"] == 160
    tracker.refresh(p)
    assert tracker.live() == _zeros()
    storage.resize_(160)
    tracker.refresh(p)
    assert tracker.live() == _zeros(params=160)
    tracker.unregister(p)
    assert tracker.live() == _zeros()
    tracker.register(p, "params")
    assert tracker.live() == _zeros(params=160)


def test_register_recategorizes_a_tracked_storage():
    tracker = MemoryTracker()
    x = torch.randn(4, 8)
    with tracker.phase("backward", category="grads"):
        g = x * 2
    tracker.register(g, "other")
    assert tracker.live() == _zeros(other=128)


def test_category_overrides_phase_default_and_nests():
    tracker = MemoryTracker()
    x = torch.randn(4, 8)
    with tracker.phase("backward", category="grads"):
        g = x * 2                                  # 128 grads
        with tracker.category("activations"):
            r = x * 3                              # 128 activations (recompute)
            with tracker.category("other"):
                o = x * 4                          # 128 other
        g2 = x * 5                                 # 128 grads again
    assert tracker.live() == _zeros(grads=256, activations=128, other=128)
    del g, r, o, g2


def test_nested_phase_peaks_count_toward_outer_and_reentry_keeps_max():
    tracker = MemoryTracker()
    x = torch.randn(4, 8)                          # 128 B per x-shaped result
    with tracker.phase("step"):
        with tracker.phase("forward"):
            a, b = x * 2, x * 3                    # 256
            del a, b
        with tracker.phase("forward"):
            c = x * 2                              # 128: lower than the first entry
        del c
    peaks = tracker.peaks()
    assert peaks["forward"]["total"] == 256 and peaks["step"]["total"] == 256
    assert tracker.peak_total() == 256


def test_reset_peaks_restarts_from_current_live_bytes():
    tracker = MemoryTracker()
    x = torch.randn(4, 8)
    with tracker.phase("forward"):
        keep, tmp = x * 2, x * 3
    del tmp
    tracker.reset_peaks()
    assert tracker.peaks() == {} and tracker.peak_total() == 128
    with tracker.phase("forward"):
        pass
    assert tracker.peaks() == {"forward": _zeros(activations=128)}
    del keep


def test_tracker_holds_no_strong_reference_to_storages_and_can_die_first():
    tracker = MemoryTracker()
    x = torch.randn(4, 8)
    with tracker.phase("forward"):
        y = x * 2
    ref = weakref.ref(y.untyped_storage())
    del y
    assert ref() is None and tracker.live()["total"] == 0
    with tracker.phase("forward"):
        z = x * 2
    del tracker
    gc.collect()
    del z  # the storage's free callback finds no tracker: must be silent


def test_storageless_and_meta_tensors_are_skipped():
    tracker = MemoryTracker()
    with tracker.phase("forward"):
        sparse = torch.eye(3).to_sparse()          # eye (36 B) is freed; sparse has no storage
        meta = torch.empty(1000, device="meta")
        tracker.register(meta, "params")
        doubled = sparse * 2
    assert tracker.live()["total"] == 0
    assert doubled.is_sparse and meta.is_meta


def test_unknown_category_and_bad_arguments_raise_value_error():
    tracker = MemoryTracker()
    with pytest.raises(ValueError, match="'weights'"):
        tracker.register(torch.zeros(1), "weights")
    with pytest.raises(ValueError, match="'weights'"):
        with tracker.phase("forward", category="weights"):
            pass
    with pytest.raises(ValueError, match="budget_bytes"):
        MemoryTracker(budget_bytes=0)
    with pytest.raises(ValueError, match="'meta'"):
        MemoryTracker("meta")


def test_tiny_gpt_forward_backward_is_reproducible():
    from mct.config import ModelConfig
    from mct.models.gpt import GPT, gpt_loss

    def run() -> tuple[dict, dict]:
        torch.manual_seed(0)
        model = GPT(ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, vocab_size=64))
        batch = (torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))
        tracker = MemoryTracker()
        for p in model.parameters():
            tracker.register(p, "params")
        with tracker.phase("forward"):
            loss = gpt_loss(model, batch)
        with tracker.phase("backward", category="grads"):
            loss.backward()
        return tracker.peaks(), tracker.live()

    (peaks, live), again = run(), run()
    assert (peaks, live) == again
    n_params = sum(p.numel() for p in GPT(ModelConfig(n_layer=2, n_head=2, d_model=32,
                                                      seq_len=16, vocab_size=64)).parameters())
    assert live["params"] == n_params * F32 and live["grads"] == n_params * F32
    assert peaks["forward"]["activations"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_phase_peak_covers_allocations_and_splits_registered_bytes():
    tracker = MemoryTracker("cuda")
    w = torch.randn(256, 256, device="cuda")       # 256 KiB
    tracker.register(w, "params")
    with tracker.phase("forward"):
        y = w @ w                                  # 256 KiB more
        del y
    peak = tracker.peaks()["forward"]
    assert peak["params"] == 256 * 256 * F32
    assert peak["activations"] >= 256 * 256 * F32
    assert peak["total"] == sum(peak[c] for c in CATEGORIES)
    assert _get_current_dispatch_mode() is None


def test_fake_tensors_allocate_nothing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    tracker = MemoryTracker()
    with FakeTensorMode():
        with tracker.phase("forward"):
            x = torch.randn(4, 8)
            y = (x @ x.t()).relu()
    assert tracker.live()["total"] == 0 and y.shape == (4, 4)


def test_jagged_nested_tensor_counts_new_values_not_shared_offsets():
    nt = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)], layout=torch.jagged)
    tracker = MemoryTracker()
    with tracker.phase("forward"):
        doubled = nt * 2       # new values (5 fp32); the int64 offsets are the input's
    assert tracker.live() == _zeros(activations=5 * F32)
    del doubled


def test_tracked_tensors_alive_at_interpreter_exit_free_silently():
    import subprocess
    import sys

    code = ("import torch\nfrom mct.memory import MemoryTracker\n"
            "t = MemoryTracker()\nx = torch.randn(8)\n"
            "with t.phase('forward'):\n    y = [x * 2 for _ in range(3)]\n"
            "t.register(x, 'params')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Exception" not in proc.stderr, proc.stderr


class _FakeCudaStats:
    """Stands in for torch.cuda's allocator counters so the CUDA bookkeeping runs on CPU."""

    def __init__(self) -> None:
        self.allocated = self.max = 0

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.max = max(self.max, self.allocated)

    def reset(self, device=None) -> None:
        self.max = self.allocated


def test_cuda_path_peaks_from_allocator_stats_across_nested_phases(monkeypatch):
    stats = _FakeCudaStats()
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: stats.allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: stats.max)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", stats.reset)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)  # no CUDA to start here
    stats.alloc(1000)                       # before the tracker: not a peak of its steps
    stats.alloc(-1000)
    tracker = MemoryTracker("cuda")
    stats.alloc(100)
    with tracker.phase("step"):
        assert _get_current_dispatch_mode() is None
        stats.alloc(500)                    # 600: the outer phase's own peak
        stats.alloc(-500)
        with tracker.phase("forward"):      # resets the device counter: 600 must survive
            stats.alloc(200)                # 300
            stats.alloc(-200)
    peaks = tracker.peaks()
    assert peaks["step"] == _zeros(activations=600)
    assert peaks["forward"] == _zeros(activations=300)
    assert tracker.peak_total() == 600 and tracker.live() == _zeros(activations=100)
    tracker.reset_peaks()
    assert tracker.peaks() == {} and tracker.peak_total() == 100


def test_cuda_path_budget_is_checked_at_phase_exit(monkeypatch):
    stats = _FakeCudaStats()
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: stats.allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: stats.max)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", stats.reset)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)  # no CUDA to start here
    tracker = MemoryTracker("cuda", budget_bytes=1000)
    with pytest.raises(MemoryBudgetExceeded, match="'forward'"):
        with tracker.phase("forward"):
            stats.alloc(1500)
            stats.alloc(-1500)          # freed before exit: the peak still counts


def test_uncounted_installs_no_mode_records_no_peak_and_keeps_registered_books():
    tracker = MemoryTracker()
    w = torch.randn(8, 8)                              # 256 bytes
    tracker.register(w, "params")
    with tracker.phase("forward"):
        before = w @ w                                 # counted: 256 activations
    tracker.reset_peaks()
    with tracker.uncounted():
        assert not tracker.counting
        with tracker.phase("forward"), tracker.category("grads"):
            assert _get_current_dispatch_mode() is None
            y = w @ w @ w                              # not counted
        g = torch.zeros(4)
        tracker.register(g, "grads")                   # explicit registration still counts
        del before                                     # a counted storage freed inside is subtracted
        gc.collect()
    assert tracker.counting
    assert tracker.peaks() == {}
    assert tracker.live() == _zeros(params=256, grads=16)
    with tracker.phase("forward"):                     # counting resumes, exact
        z = w + 1
    assert tracker.peaks()["forward"] == _zeros(params=256, grads=16, activations=256)
    assert y.shape == z.shape == (8, 8)


def test_uncounted_is_a_no_op_under_a_budget():
    tracker = MemoryTracker(budget_bytes=300)
    w = torch.randn(8, 8)
    with pytest.raises(MemoryBudgetExceeded):
        with tracker.uncounted(), tracker.phase("forward"):
            assert tracker.counting and _get_current_dispatch_mode() is not None
            w @ w @ w


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_tracker_is_a_fresh_process_first_use_of_cuda():
    """An engine built before anything touched CUDA (its model still on the CPU) starts its
    tracker first: resetting the allocator's peak before CUDA started raised 'Invalid device
    argument'. A fresh interpreter, as a user's script is."""
    import subprocess
    import sys
    code = ("import torch\nfrom mct.memory import MemoryTracker\nt = MemoryTracker('cuda')\n"
            "x = torch.ones(1 << 20, device='cuda')\nassert t.peak_total() >= 4 << 20, t.peak_total()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_counting_mode_is_dynamo_safe_only_where_torch_dynamo_is_loaded(monkeypatch):
    """Without torch._dynamo loaded the tracker's dispatch mode is the plain method (its
    wrapper would import torch._dynamo, about 70 MiB); with it loaded, torch's wrapped one."""
    import sys
    from mct.memory import tracker as tracker_module
    t = tracker_module.MemoryTracker("cpu")
    monkeypatch.delitem(sys.modules, "torch._dynamo", raising=False)
    plain = tracker_module._counting_mode(t)
    monkeypatch.setitem(sys.modules, "torch._dynamo", object())
    safe = tracker_module._counting_mode(t)
    assert type(plain).__dict__.get("__torch_dispatch__") is tracker_module._CountingMode.__dict__["__torch_dispatch__"]
    assert not hasattr(type(plain).__torch_dispatch__, "__wrapped__")
    assert type(safe) is tracker_module._DynamoSafeCountingMode
    assert type(safe).__torch_dispatch__.__wrapped__ is tracker_module._CountingMode.__dict__["__torch_dispatch__"]
