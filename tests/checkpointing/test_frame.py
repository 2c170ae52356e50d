"""mct's checkpoint frame (``mct.checkpointing.frame``) is torch's non-reentrant checkpoint
without ``torch._dynamo``: the same losses and gradients to the bit (dropout replayed), the
same early stop, the same errors, and torch's own frame where dynamo is loaded."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointError, set_checkpoint_early_stop

from mct.checkpointing import frame, region
from mct.checkpointing.region import Region
from mct.models.gpt import gpt_loss
from tests.checkpointing.test_checkpointing import _assert_bitwise, _batch, _gpt, _loss_and_grads

FRAMES = ["mct", "torch"]


@pytest.fixture
def use_frame(monkeypatch):
    """Force one frame (whatever this process has imported) and count the regions it opened."""
    def use(which: str) -> dict[str, int]:
        opened = {"mct": 0, "torch": 0}

        def counting(name, start):
            def spy(*args, **kwargs):
                opened[name] += 1
                return start(*args, **kwargs)
            return spy
        monkeypatch.setattr(frame, "needs_torch_frame", lambda: which == "torch")
        monkeypatch.setattr(frame, "checkpoint_without_reentrant",
                            counting("mct", frame.checkpoint_without_reentrant))
        monkeypatch.setattr(region, "_checkpoint_without_reentrant_generator",
                            counting("torch", region._checkpoint_without_reentrant_generator))
        return opened
    return use


def _gpt_run(policy: str, early_stop: bool, autocast: bool = False):
    model, state = _gpt(policy)
    with set_checkpoint_early_stop(early_stop):
        out = _loss_and_grads(model, _batch(), autocast=autocast)
    return out, state.metrics()["recompute_calls"]


@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("policy", ["all", "selective", "sqrt"])
def test_mct_frame_matches_torch_frame_bitwise_with_dropout(use_frame, policy, early_stop):
    """The built-in GPT (dropout 0.1: every recompute replays its masks from the forward's RNG
    state) gives the same loss and gradients to the bit on both frames, each recomputing."""
    runs = {}
    for which in FRAMES:
        opened = use_frame(which)
        runs[which] = _gpt_run(policy, early_stop)
        assert opened[which] > 0 and opened["mct" if which == "torch" else "torch"] == 0, opened
    _assert_bitwise(runs["mct"][0], runs["torch"][0])
    assert runs["mct"][1] == runs["torch"][1] > 0


def test_mct_frame_replays_autocast_bitwise(use_frame):
    """A bf16-autocast forward is recomputed under the same autocast state."""
    runs = {}
    for which in FRAMES:
        use_frame(which)
        runs[which] = _gpt_run("all", True, autocast=True)[0]
    _assert_bitwise(runs["mct"], runs["torch"])


def test_mct_frame_recomputes_again_for_a_second_grad_with_retain_graph(use_frame):
    """``torch.autograd.grad`` twice over one retained graph recomputes for each (a new graph
    task each time) and gives the same gradients, on both frames alike."""
    grads = {}
    for which in FRAMES:
        use_frame(which)
        model, state = _gpt("all")
        torch.manual_seed(2)
        loss = gpt_loss(model, _batch())
        params = [p for p in model.parameters()]
        first = torch.autograd.grad(loss, params, retain_graph=True)
        second = torch.autograd.grad(loss, params)
        assert all(torch.equal(a, b) for a, b in zip(first, second))
        assert state.metrics()["recompute_calls"] == 2 * len(state.regions)
        grads[which] = first
    assert all(torch.equal(a, b) for a, b in zip(grads["mct"], grads["torch"]))


class _Counted(nn.Module):
    """sin, then cos (each saves its input), then counts a forward run to its end."""

    def __init__(self) -> None:
        super().__init__()
        self.finished = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.sin().cos()
        self.finished += 1
        return y * 2


@pytest.mark.parametrize("early_stop", [True, False])
def test_early_stop_ends_the_recompute_at_the_last_saved_tensor_on_both_frames(use_frame, early_stop):
    """With early stop the recompute ends inside the block, at cos's saved input (the count after
    it never runs again); without it the replay runs to the end."""
    finished = {}
    for which in FRAMES:
        use_frame(which)
        block = _Counted()
        Region([("b", block)], None).install()
        x = torch.randn(8, requires_grad=True)
        with set_checkpoint_early_stop(early_stop):
            out = block(x)
        out.sum().backward()
        assert torch.equal(x.grad, (-(x.sin().sin()) * x.cos() * 2).detach())
        finished[which] = block.finished
    assert finished["mct"] == finished["torch"] == (1 if early_stop else 2)


class _Changing(nn.Module):
    """A block whose replay is not its forward: ``kind`` says how it differs."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.calls = kind, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        replay, self.calls = self.calls > 0, self.calls + 1
        if self.kind == "fewer":
            return x.sin() if replay else x.sin().sin()
        if self.kind == "more":
            return x.sin().sin() if replay else x.sin()
        return (x[:4] if replay else x).sin().sum()  # "shape": sin saves a smaller input


@pytest.mark.parametrize("kind", ["fewer", "more", "shape"])
def test_a_recompute_that_differs_from_forward_raises_torchs_checkpoint_error_on_both_frames(use_frame, kind):
    """Fewer saved tensors, more (early stop off, so the replay runs on) or other metadata in the
    recompute: torch's CheckpointError with torch's message, from either frame."""
    errors = {}
    for which in FRAMES:
        use_frame(which)
        block = _Changing(kind)
        Region([("b", block)], None).install()
        with set_checkpoint_early_stop(kind != "more"):
            out = block(torch.randn(8, requires_grad=True))
        with pytest.raises(CheckpointError) as e:
            out.sum().backward()
        errors[which] = str(e.value)
    assert errors["mct"] == errors["torch"]
    assert {"fewer": "A different number of tensors", "more": "trying to save more tensors",
            "shape": "different metadata"}[kind] in errors["mct"]


def test_selective_contexts_are_torchs_modes_unwrapped_unless_torch_frame_is_needed(monkeypatch):
    """Where dynamo is not loaded the selective modes' ``__torch_dispatch__`` is torch's own
    function, not the ``torch._disable_dynamo`` wrapper that imports it; else torch's classes."""
    from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode
    policy = lambda ctx, op, *a, **k: False  # noqa: E731
    monkeypatch.setattr(frame, "needs_torch_frame", lambda: False)
    caching, cached = frame.selective_contexts(policy)
    assert isinstance(caching, _CachingTorchDispatchMode) and isinstance(cached, _CachedTorchDispatchMode)
    for mode, torch_cls in ((caching, _CachingTorchDispatchMode), (cached, _CachedTorchDispatchMode)):
        assert type(mode).__torch_dispatch__ is torch_cls.__torch_dispatch__.__wrapped__
    monkeypatch.setattr(frame, "needs_torch_frame", lambda: True)
    assert [type(m) for m in frame.selective_contexts(policy)] == [_CachingTorchDispatchMode, _CachedTorchDispatchMode]


def test_torch_frame_is_needed_where_dynamo_is_loaded_or_checkpoint_debug_is_on(monkeypatch):
    import sys
    from torch.utils.checkpoint import set_checkpoint_debug_enabled
    monkeypatch.delitem(sys.modules, "torch._dynamo", raising=False)
    assert not frame.needs_torch_frame()
    with set_checkpoint_debug_enabled(True):
        assert frame.needs_torch_frame()
    monkeypatch.setitem(sys.modules, "torch._dynamo", object())
    assert frame.needs_torch_frame()


def _grad_inside(x: torch.Tensor) -> torch.Tensor:
    """torch's "backward inside the checkpointed forward" (its Rule 6): a grad of the
    frame's own saved tensors while the frame is still open."""
    z = x.sin().cos()
    gx, = torch.autograd.grad(z.sum(), x)
    return x.cos() * gx


@pytest.mark.parametrize("early_stop", [True, False])
def test_a_backward_inside_the_checkpointed_forward_gives_torchs_gradient(early_stop):
    """The generators driven directly, as torch's ``checkpoint`` drives its own: a grad taken
    inside the open frame recomputes it there, and the outer backward again; same bits."""
    from torch.utils.checkpoint import _checkpoint_without_reentrant_generator, noop_context_fn
    grads = []
    for start in (frame.checkpoint_without_reentrant, _checkpoint_without_reentrant_generator):
        x = torch.linspace(-2.0, 2.0, 7, requires_grad=True)
        gen = start(_grad_inside, True, noop_context_fn, "default", False, early_stop, x)
        next(gen)
        out = _grad_inside(x)
        next(gen, None)
        out.sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
