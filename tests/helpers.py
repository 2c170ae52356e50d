"""Shared test helpers: a tiny GPT config, batches, and engine-vs-reference runs."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch

from mct.config import EngineConfig
from mct.engine import Engine
from mct.machine.load import Load
from mct.models.gpt import GPT, gpt_loss, optimizer_groups
from mct.verify.reference import ReferenceTrainer

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


def reference_run(cfg: EngineConfig, world: int, steps: int, optimizer=adamw, n_micro: int = 1,
                  model_fn=None, loss_fn=gpt_loss, batch_fn=batches, order: str = "rank"):
    """Train the fp32 reference on every rank's batches; returns (losses, state dict).

    ``order="rank"`` is ``ReferenceTrainer``'s own reduction: each rank's micro-batch
    gradients are summed first, then the ranks. ``order="micro"`` sums over ranks for
    each micro-batch first, then over micro-batches: the order of ZeRO stages 2/3,
    which reduce-scatter after every backward. Both are exact averages; they differ
    only in floating-point rounding."""
    if order not in ("rank", "micro"):
        raise ValueError(f"order must be 'rank' or 'micro', got {order!r}")
    torch.manual_seed(cfg.seed)
    model = model_fn() if model_fn else GPT(cfg.model)
    ref = ReferenceTrainer(model, optimizer, grad_clip=cfg.train.grad_clip, param_groups=optimizer_groups(model, 0.1))
    losses = []
    for step in range(steps):
        per_rank = [batch_fn(step, r, n_micro) for r in range(world)]
        if order == "rank":
            losses.append(ref.step(per_rank, loss_fn).loss)
        else:
            losses.append(_micro_major_step(ref, per_rank, loss_fn))
    return losses, ref.state_dict()


def _micro_major_step(ref: ReferenceTrainer, per_rank: list[list[Any]], loss_fn) -> float:
    """One reference step that sums rank gradients per micro-batch, then micro-batches."""
    world, n_micro = len(per_rank), len(per_rank[0])
    total = [torch.zeros_like(p) for p in ref.params]
    loss_sum = 0.0
    for m in range(n_micro):
        summed = [torch.zeros_like(p) for p in ref.params]
        for r in range(world):
            for p in ref.params:
                p.grad = None
            loss = loss_fn(ref.model, per_rank[r][m])
            (loss / n_micro).backward()
            loss_sum += loss.item() / n_micro
            for s, p in zip(summed, ref.params):
                if p.grad is not None:
                    s.add_(p.grad)
        for t, s in zip(total, summed):
            t.add_(s)
    for t, p in zip(total, ref.params):
        p.grad = t.div_(world)
    norm = math.sqrt(sum(float(torch.linalg.vector_norm(p.grad, dtype=torch.float64)) ** 2 for p in ref.params))
    if ref.grad_clip > 0:
        torch._foreach_mul_([p.grad for p in ref.params], min(1.0, ref.grad_clip / (norm + 1e-6)))
    ref.optimizer.step()
    for p in ref.params:
        p.grad = None
    return loss_sum / world


def engine_run(cfg: EngineConfig, rank: int, steps: int, optimizer=adamw, n_micro: int = 1,
               model_fn=None, loss_fn=gpt_loss, batch_fn=batches):
    """Train the engine on this rank's batches (collective: every rank calls it).
    Returns (losses, full fp32 state dict, engine, last StepResult)."""
    torch.manual_seed(cfg.seed)
    model = model_fn() if model_fn else GPT(cfg.model)
    engine = Engine(model, optimizer, cfg, param_groups=optimizer_groups(model, 0.1))
    losses, out = [], None
    for step in range(steps):
        out = engine.train_step(batch_fn(step, rank, n_micro), loss_fn)
        losses.append(out.loss)
    return losses, engine.full_state_dict(), engine, out


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


def shared_work(rank: int, world: int, jobs: dict[Any, Any]) -> dict[Any, Any] | None:
    """Run ``jobs`` (key -> zero-argument callable) split round-robin over the ranks
    and gather the results on rank 0 (None elsewhere). Collective: every rank calls it
    with the same keys. Reference runs are independent of the rank, so spreading
    them keeps the other ranks from idling while rank 0 works alone."""
    import torch.distributed as dist
    mine = {k: fn() for i, (k, fn) in enumerate(jobs.items()) if i % world == rank}
    if world == 1:
        return mine
    parts: list[Any] = [None] * world if rank == 0 else None
    dist.gather_object(mine, parts, dst=0)
    return {k: v for p in parts for k, v in p.items()} if rank == 0 else None


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Autouse in a module that imports it: one intra-op thread, as the spawned ranks run.
    Two threads on a busy 2-core machine spin against each other and make a tiny model's
    step ~40x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


SEEDED_RATES = {"fp32": 50e9, "bf16": 100e9, "fp16": 100e9}
"""The matmul rates (FLOP/s per core) of the machine profile every test run starts
with (conftest.py's ``machine_profile_cache``): MFU in tests divides by these."""
SEEDED_EXTRA = {"op_overhead_s": {**{str(t): 20e-6 for t in range(1, 65)},
                                  **{f"{t}x{w}": 20e-6 for t in range(1, 65) for w in range(2, 9)}},
                "byte_overhead_s": {**{str(t): 0.0 for t in range(1, 65)},
                                    **{f"{t}x{w}": 0.0 for t in range(1, 65) for w in range(2, 9)}},
                "random_elements_per_s": 1e8,
                "collectives": {**{f"gloo:{w}": {"all_reduce": [1e-4, 1e9], "reduce_scatter": [1e-4, 1e9],
                                                 "all_gather": [1e-4, 1e9]} for w in range(2, 9)},
                                **{f"gloo:{w}/{g}": {"all_gather": [1e-4, 1e9], "reduce_scatter": [1e-4, 1e9],
                                                     "all_to_all": [1e-4, 1e9]}
                                   for w in range(2, 9) for g in range(2, w + 1) if w % g == 0}},
                "disk_bytes_per_s": 5e8}
"""The time model's rates of that profile (``mct.planner.steptime``): no test waits for
the per-op overhead or the collectives to be measured unless it asks for it."""


class FakeWatch:
    """A ``LoadWatch`` whose passes see the loads (other processes' cores) of ``script`` in turn."""

    def __init__(self, script: list[float]) -> None:
        self.script = script

    def __call__(self) -> "FakeWatch":
        return self

    def __enter__(self) -> "FakeWatch":
        self.now = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        return self

    def __exit__(self, *exc) -> None:
        pass

    def load(self) -> Load:
        return Load(self.now, 2, 1.0, 5.0)


def checkpointed_run(root: Any) -> tuple[Any, Engine, EngineConfig]:
    """``root/run`` shaped as a run around a real one-step checkpoint of the tiny GPT
    (``checkpoints/step_00000001``); returns (run dir, its engine, its config). The caller
    writes the run's other files (metadata.json, metrics rows) as its test needs."""
    torch.manual_seed(0)
    cfg = tiny_config()
    model = GPT(cfg.model)
    engine = Engine(model, adamw, cfg, param_groups=optimizer_groups(model, 0.1))
    engine.train_step(batches(0, 0), gpt_loss)
    run = root / "run"
    engine.save(str(run / "checkpoints" / "step_00000001"))
    return run, engine, cfg
