"""Shared test helpers: a tiny GPT config, batches, and engine-vs-reference runs."""

from __future__ import annotations

import copy
from typing import Any

import torch

from mct.config import EngineConfig
from mct.engine import Engine
from mct.models.gpt import GPT, gpt_loss, optimizer_groups
from mct.reference import ReferenceTrainer

TINY_MODEL = {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16, "vocab_size": 256, "dropout": 0.0}


def tiny_config(**sections: dict[str, Any]) -> EngineConfig:
    d: dict[str, Any] = {"model": dict(TINY_MODEL), "train": {"grad_clip": 0.0}}
    for k, v in sections.items():
        d.setdefault(k, {}).update(v) if isinstance(v, dict) else d.__setitem__(k, v)
    return EngineConfig.from_dict(d)


def batches(step: int, rank: int, n_micro: int = 1, B: int = 2, T: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic random token batches for (step, rank): the same in every process."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [(torch.randint(0, 256, (B, T), generator=g), torch.randint(0, 256, (B, T), generator=g))
            for _ in range(n_micro)]


def adamw(groups: list[dict]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)


def sgd_momentum(groups: list[dict]) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9)


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Worst per-tensor ||a - b|| / ||b|| and its name."""
    worst, name = 0.0, ""
    for k in b:
        rel = float((a[k].float() - b[k].float()).norm() / b[k].float().norm().clamp_min(1e-12))
        if rel >= worst:
            worst, name = rel, k
    return worst, name


def engine_vs_reference(cfg: EngineConfig, rank: int, world: int, steps: int, optimizer=adamw,
                        n_micro: int = 1, model_fn=None, loss_fn=gpt_loss, batch_fn=batches):
    """Train the engine (this rank) and, on rank 0, the reference over every rank's
    batches. Returns (engine losses, reference losses, worst relative param diff, name)
    on rank 0 and (losses, None, None, None) elsewhere."""
    torch.manual_seed(cfg.seed)
    model = model_fn() if model_fn else GPT(cfg.model)
    ref = None
    if rank == 0:
        r = copy.deepcopy(model)
        ref = ReferenceTrainer(r, optimizer, grad_clip=cfg.train.grad_clip,
                               param_groups=optimizer_groups(r, 0.1))
    engine = Engine(model, optimizer, cfg, param_groups=optimizer_groups(model, 0.1))
    losses, ref_losses = [], []
    for step in range(steps):
        out = engine.train_step(batch_fn(step, rank, n_micro), loss_fn)
        losses.append(out.loss)
        if ref is not None:
            ref_losses.append(ref.step([batch_fn(step, r, n_micro) for r in range(world)], loss_fn).loss)
    state = engine.full_state_dict()
    if ref is None:
        return losses, None, None, None
    rel, name = max_rel_diff(state, ref.state_dict())
    return losses, ref_losses, rel, name
