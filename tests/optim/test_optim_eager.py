"""``mct.optim.eager``: torch's AdamW, bit for bit, without importing ``torch._dynamo``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mct.optim import AdamW, EagerOptimizer, LowPrecisionAdamW


def _groups(seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (300, 17, 64)]
    return [{"params": params[:2], "weight_decay": 0.1},
            {"params": params[2:], "weight_decay": 0.0, "lr": 3e-3}]


def _step(opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    opt.zero_grad()


def _same(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    pa = [p for g in a.param_groups for p in g["params"]]
    pb = [p for g in b.param_groups for p in g["params"]]
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    return all(torch.equal(x, y) for x, y in zip(pa, pb)) and sa.keys() == sb.keys() and all(
        sa[i].keys() == sb[i].keys() and all(torch.equal(sa[i][k], sb[i][k]) for k in sa[i]) for i in sa)


@pytest.mark.parametrize("kwargs", [{"foreach": False}, {"fused": True}, {"foreach": False, "amsgrad": True},
                                    {"foreach": False, "maximize": True}])
def test_eager_adamw_matches_torch_adamw_bit_for_bit_through_a_state_dict_round_trip(kwargs):
    """Weight decay on one group, another lr on the other; after 3 steps each optimizer's
    state_dict is loaded by a fresh one of the other class (a checkpoint written before
    and resumed after, and the reverse) and 3 more steps still agree to the bit."""
    ours = AdamW(_groups(0), lr=1e-3, betas=(0.9, 0.95), **kwargs)
    ref = torch.optim.AdamW(_groups(0), lr=1e-3, betas=(0.9, 0.95), **kwargs)
    sched = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (ours, ref)]
    for step in range(3):
        _step(ours, step), _step(ref, step), [s.step() for s in sched]
    assert _same(ours, ref) and ours.state_dict()["param_groups"] == ref.state_dict()["param_groups"]
    resumed_ours, resumed_ref = AdamW(_groups(0), **kwargs), torch.optim.AdamW(_groups(0), **kwargs)
    for new, old in ((resumed_ours, ref), (resumed_ref, ours)):
        for p_new, p_old in zip(*([p for g in o.param_groups for p in g["params"]] for o in (new, old))):
            p_new.data.copy_(p_old.data)
        new.load_state_dict(old.state_dict())
    assert resumed_ours.param_groups[1]["lr"] == ref.param_groups[1]["lr"]
    for step in range(3, 6):
        _step(resumed_ours, step), _step(resumed_ref, step)
    assert _same(resumed_ours, resumed_ref)
    assert not _same(resumed_ours, ours)  # it moved: the comparison can fail


def test_eager_adamw_is_a_torch_adamw_and_refuses_what_torch_refuses():
    opt = AdamW(_groups(0))
    assert isinstance(opt, torch.optim.AdamW) and isinstance(opt, EagerOptimizer)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        AdamW(_groups(0), lr=-1.0)


def test_a_training_process_with_mcts_optimizers_and_tracker_never_imports_dynamo():
    """A fresh interpreter: mct.Engine with its default optimizer and memory tracker, an LR
    scheduler, checkpoint state out and back in, and LowPrecisionAdamW's step: no
    ``torch._dynamo`` (about 70 MiB resident) at the end."""
    code = """
import sys, torch
from mct import Engine
from mct.optim import LowPrecisionAdamW
from tests.helpers import tiny_config, batches
from mct.models.gpt import GPT, gpt_loss
cfg = tiny_config()
torch.manual_seed(0)
engine = Engine(GPT(cfg.model), None, cfg)
sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1.0)
for batch in [batches(step, 0)[0] for step in range(2)]:
    engine.train_step(batch, gpt_loss)
    sched.step()
engine.load_state_dict(engine.state_dict())
low = LowPrecisionAdamW([torch.nn.Parameter(torch.zeros(256))], state_dtype="bf16", native=False)
low.param_groups[0]["params"][0].grad = torch.ones(256)
low.step()
low.load_state_dict(low.state_dict())
print(type(engine.optimizer).__module__, engine.tracker.peak_total() > 0, "torch._dynamo" in sys.modules)
"""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root,
                         env=dict(os.environ, PYTHONPATH=f"{root / 'src'}{os.pathsep}{root}", OMP_NUM_THREADS="1"))
    assert out.stdout.split()[-3:] == ["mct.optim.eager", "True", "False"], out.stdout + out.stderr


def test_undecorated_removes_only_torchs_dynamo_wrappers():
    from mct.optim.eager import undecorated

    def f(x):
        return x
    no_grad = torch.no_grad()(f)
    assert undecorated(torch._disable_dynamo(f)) is f
    assert undecorated(torch.optim.Optimizer.profile_hook_step(torch._disable_dynamo(f))) is f
    assert undecorated(no_grad) is no_grad  # another wrapper keeps its meaning
    assert undecorated(torch._disable_dynamo(no_grad)) is no_grad
