"""Reference trainer: plain single-process fp32 training, no mct machinery.

The yardstick every configuration is checked against. It sees exactly what a
multi-rank run sees: for each step it runs every rank's micro-batches in turn,
keeps each rank's accumulated gradient apart, then sums them over ranks as an
all-reduce would and divides by the number of ranks (a single concatenated batch
rounds differently, and Adam amplifies such differences where gradients are near
zero). Gradient clipping is by the global L2 norm accumulated in fp64, as the engine
does on its shards: the clipping factor then does not depend on how gradients are
grouped, and both sides multiply by the same fp32 number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass
class ReferenceStep:
    loss: float
    grad_norm: float


class ReferenceTrainer:
    def __init__(self, model: nn.Module, optimizer: Callable[[list[dict]], torch.optim.Optimizer],
                 *, param_groups: list[dict] | None = None, grad_clip: float = 0.0) -> None:
        """``model`` is trained in place in fp32; ``optimizer`` is the same factory the
        engine gets, called once with ``param_groups`` (default: one group of all
        trainable parameters)."""
        self.model = model.float()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = optimizer(param_groups or [{"params": self.params}])
        self.grad_clip = grad_clip

    def step(self, per_rank: list[list[Any]], loss_fn: LossFn,
             before_micro: Callable[[int, int], None] | None = None) -> ReferenceStep:
        """One optimizer step. ``per_rank[r]`` is rank r's list of micro-batches;
        ``before_micro(rank, micro)`` runs before each forward (e.g. to seed dropout)."""
        world = len(per_rank)
        total = [torch.zeros_like(p) for p in self.params]
        loss_sum = 0.0
        self.model.train()
        for r, micro in enumerate(per_rank):
            for p in self.params:
                p.grad = None
            for m, batch in enumerate(micro):
                if before_micro is not None:
                    before_micro(r, m)
                loss = loss_fn(self.model, batch)
                (loss / len(micro)).backward()
                loss_sum += loss.item() / len(micro)
            for t, p in zip(total, self.params):
                if p.grad is not None:
                    t.add_(p.grad)
        for t, p in zip(total, self.params):
            p.grad = t.div_(world)
        grads = [p.grad for p in self.params]
        norm = math.sqrt(sum(float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2 for g in grads))
        if self.grad_clip > 0:
            torch._foreach_mul_(grads, min(1.0, self.grad_clip / (norm + 1e-6)))
        self.optimizer.step()
        for p in self.params:
            p.grad = None
        return ReferenceStep(loss=loss_sum / world, grad_norm=float(norm))

    @torch.no_grad()
    def eval_loss(self, batch: Any, loss_fn: LossFn) -> float:
        was = self.model.training
        self.model.eval()
        try:
            return float(loss_fn(self.model, batch))
        finally:
            self.model.train(was)

    @torch.no_grad()
    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Copy ``state`` (names as ``named_parameters()``, every one of them) into the
        model in place (tied parameters are one entry). Raises ValueError for a missing
        or unexpected name or a wrong shape, before changing anything."""
        params = dict(self.model.named_parameters())
        if set(params) != set(state) or any(params[k].shape != state[k].shape for k in params):
            bad = sorted(set(params) ^ set(state)) or [k for k in params if params[k].shape != state[k].shape]
            raise ValueError(f"reference weights do not match the model: {bad[:3]}")
        for k, p in params.items():
            p.copy_(state[k])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}
