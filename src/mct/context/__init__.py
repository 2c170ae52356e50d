"""Context parallelism (``parallel.context = N``, docs/parallel.md): the ranks of a context
group share one window, each holding 1/N of its tokens (``layout``: two chunks of 2N for
the causal load balance), attention crossing the group by all-to-all over heads or an
all-gather of keys and values (``attention``, through ``comm``, the only collectives),
the model routed through them (``install``) and the loss of a split window
(``parallel``). ``context_parallel`` builds it from the config."""

from __future__ import annotations

import torch.nn as nn

from mct.config.run import ParallelConfig
from mct.context.comm import ContextComm, SimulatedContextComm, context_comm
from mct.context.install import install
from mct.context.layout import ContextShard, gathered_order, rank_indices, shard_batch
from mct.context.parallel import ContextParallel, NoContext

__all__ = ["ContextComm", "ContextParallel", "ContextShard", "NoContext", "SimulatedContextComm",
           "context_parallel", "data_parallel", "gathered_order", "rank_indices", "shard_batch"]


def data_parallel(rank: int, world: int, degree: int) -> tuple[int, int]:
    """(data-parallel rank, data-parallel world) of ``rank`` when groups of ``degree``
    consecutive ranks share one window: (rank // degree, world // degree). Raises
    ValueError when the degree does not divide the world."""
    if world % degree:
        raise ValueError(f"parallel.context = {degree} must divide the number of ranks ({world}): "
                         f"run a multiple of {degree} ranks (--nproc) or change parallel.context")
    return rank // degree, world // degree


def context_parallel(cfg: ParallelConfig, model: nn.Module, *, rank: int, world: int,
                     simulated: bool = False) -> ContextParallel | NoContext:
    """``NoContext`` at ``parallel.context = 1``; else this rank's ``ContextParallel``, its
    groups created (collective) and installed into ``model`` (mutated). Raises ValueError
    when the degree does not divide ``world`` or the model cannot be routed."""
    data_parallel(rank, world, cfg.context)  # the degree divides the world
    if cfg.context == 1:
        return NoContext()
    cp = ContextParallel(context_comm(cfg.context, rank, world, simulated), cfg.context_attention)
    install(model, cp)
    return cp
