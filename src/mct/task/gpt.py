"""The built-in recipe: the GPT of ``[model]`` trained with AdamW (weight decay on
matrices only), on token windows with a seeded dropout stream per micro-batch."""

from __future__ import annotations

import torch

from mct.config import EngineConfig
from mct.data.sampler import BatchSampler
from mct.models.gpt import GPT, gpt_loss, optimizer_groups
from mct.optim import make_adamw
from mct.task.init_program import InitProgram, record_init
from mct.task.seeding import micro_seed, seed_everything, seeded
from mct.task.spec import Task
from mct.task.tokens import chunk_choices, loss_for, token_batch


seeded_gpt_loss = seeded(gpt_loss)
"""(input_ids, targets, seed): seed the dropout stream, then the GPT loss."""

def make_optimizer(cfg: EngineConfig):
    """AdamW (betas (0.9, 0.95), eps 1e-8 unless ``[optimizer]`` says otherwise), with
    torch's fused kernel for fp32 state where every tensor it is given sits on a device
    that has one (CPU and CUDA): one pass over memory per step, about 7x faster than
    the default single-tensor loop on CPU (docs/stages.md, "offload"). bf16 / int8 state:
    ``mct.optim.LowPrecisionAdamW``."""
    return make_adamw(cfg.optimizer, lr=cfg.train.lr, seed=cfg.seed, betas=(0.9, 0.95), eps=1e-8, fused=True)


def build_gpt(cfg: EngineConfig) -> GPT:
    """The GPT, initialized from ``cfg.seed`` (identical on every rank)."""
    seed_everything(cfg.seed)
    return GPT(cfg.model)


def build_gpt_on_meta(cfg: EngineConfig) -> tuple[GPT, InitProgram]:
    """The GPT of ``build_gpt`` on the meta device, with the program that gives each
    parameter exactly ``build_gpt``'s values when the engine packs its unit."""
    seed_everything(cfg.seed)
    return record_init(lambda: GPT(cfg.model))


def param_groups(model: torch.nn.Module, cfg: EngineConfig) -> list[dict]:
    """The recipe's AdamW groups: weight decay on matrices only."""
    return optimizer_groups(model, cfg.train.weight_decay)


def gpt_task(cfg: EngineConfig) -> Task:
    """The GPT of ``cfg.model`` as a Task: its loss on one micro-batch of token ids,
    the recipe's optimizer and groups (what ``auto``, ``mct plan`` and ``mct train`` use)."""
    return Task(model_fn=lambda: GPT(cfg.model), loss_fn=loss_for(cfg, gpt_loss), batch=token_batch(cfg),
                optimizer=make_optimizer(cfg), param_groups=lambda m: param_groups(m, cfg), label="gpt",
                loss_for_chunk=chunk_choices(gpt_loss))


def step_batches(sampler: BatchSampler, cfg: EngineConfig, step: int, rank: int,
                 device: torch.device | str = "cpu") -> list[tuple]:
    """Rank ``rank``'s micro-batches of ``step`` with their dropout seeds, keyed by the
    global micro-batch index (the same on any world size for the same global batch)."""
    ga = cfg.data.grad_accum
    return [(*mb, micro_seed(cfg.seed, step, rank * ga + m))
            for m, mb in enumerate(sampler.micro_batches(step, rank, device))]
