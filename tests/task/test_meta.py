"""build_on_meta: a model's shapes on the meta device, its random initializers skipped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import torch
import torch.nn as nn

from mct.task.meta import build_on_meta

REPO = Path(__file__).resolve().parents[2]


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.lin = nn.Linear(6, 11, bias=False)
        self.lin.weight = self.emb.weight  # tied
        self.conv = nn.Conv1d(6, 4, 3)
        self.norm = nn.LayerNorm(4)
        self.register_buffer("scale", torch.ones(4) * 2)
        nn.init.trunc_normal_(self.conv.weight, std=0.02)
        nn.init.xavier_uniform_(self.emb.weight)
        self.conv.bias.data.uniform_(-1, 1)


def test_same_parameters_as_a_meta_device_build_and_no_random_draws():
    state = torch.get_rng_state()
    skipped = build_on_meta(Mixed)
    with torch.device("meta"):
        plain = Mixed()
    assert torch.equal(torch.get_rng_state(), state)
    assert [(n, p.shape, p.dtype, p.device.type) for n, p in skipped.named_parameters()] == \
        [(n, p.shape, p.dtype, p.device.type) for n, p in plain.named_parameters()]
    assert all(p.is_meta for p in skipped.parameters()) and skipped.scale.is_meta
    assert skipped.lin.weight is skipped.emb.weight
    assert sum(p.numel() for p in skipped.parameters()) == 11 * 6 + 4 * 6 * 3 + 4 + 4 + 4


@pytest.mark.slow  # a fresh interpreter importing torch: seconds
def test_the_builtin_gpt_builds_without_importing_dynamo():
    """The point of skipping: meta initializers import torch._dynamo (about a second)."""
    code = ("import sys; from mct.config import EngineConfig; from mct.task import task_for; "
            "from mct.task.meta import build_on_meta; m = build_on_meta(task_for(EngineConfig()).model_fn); "
            "assert all(p.is_meta for p in m.parameters()); print('torch._dynamo' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", out.stdout
