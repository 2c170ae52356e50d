"""DistContext: who this process is in the data-parallel group.

Built from torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT) or
from an already-initialized default process group. gloo on CPU, nccl on CUDA, always
with a timeout so a missing rank fails instead of hanging. No module-level state.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, kw_only=True)
class DistContext:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str = "none"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def current(cls, device: torch.device | None = None) -> "DistContext":
        """The context of the default process group if one is initialized, else a
        single process on ``device`` (CUDA if available, else CPU)."""
        if dist.is_available() and dist.is_initialized():
            backend = dist.get_backend()
            if device is None:
                device = _default_device(backend, int(os.environ.get("LOCAL_RANK", 0)))
            return cls(rank=dist.get_rank(), world_size=dist.get_world_size(),
                       local_rank=int(os.environ.get("LOCAL_RANK", dist.get_rank())),
                       device=device, backend=backend)
        return cls(device=device or _default_device("none", 0))

    @classmethod
    def simulated(cls, world_size: int, device: torch.device | str = "cpu") -> "DistContext":
        """Rank 0 of a ``world_size``-rank group that does not exist: its ``Comm`` runs
        the engine's collectives as shape-checked no-ops (the planner's fake runs).
        Raises ValueError for a world size below 1."""
        if world_size < 1:
            raise ValueError(f"world size must be >= 1, got {world_size}")
        return cls(world_size=world_size, device=torch.device(device), backend="simulated")


def _default_device(backend: str, local_rank: int) -> torch.device:
    if backend in ("nccl", "none") and torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer (set by torchrun)") from None


def init_distributed(backend: str = "auto", timeout_s: float = 300.0) -> DistContext:
    """Initialize the default process group from torchrun's environment when
    WORLD_SIZE > 1; otherwise return a single-process context. Idempotent."""
    if dist.is_initialized():
        return DistContext.current()
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", rank)
    if not 0 <= rank < world:
        raise ValueError(f"RANK must be in [0, {world}), got {rank}")
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("distributed.backend = 'nccl' needs CUDA, and none is available; use 'gloo' or 'auto'")
    if world == 1:
        return DistContext(device=_default_device(backend, 0))
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise ValueError(f"WORLD_SIZE={world} but {var} is not set: launch with torchrun or `mct train --nproc N`")
    device = _default_device(backend, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timeout,
                            store=_attempt_store(world, timeout),
                            device_id=device if device.type == "cuda" else None)
    return DistContext(rank=rank, local_rank=local_rank, world_size=world, device=device, backend=backend)


def _attempt_store(world: int, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun's agent store, a store whose keys are private to this restart
    attempt (None otherwise: the default ``env://`` set-up). torchrun reuses the agent's
    store when it restarts a group, and a restarted rank could read the address a dead
    rank of the previous attempt published there, then fail to connect to it."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"mct/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def teardown() -> None:
    """Destroy the default process group if this process created one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def broadcast_from_main(obj):
    """Rank 0's ``obj`` on every rank (identity without a process group); used to agree
    on values such as the run directory before any collective-heavy work."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agree(error: str | None, all_gather: Callable[[Any], list[Any]] | None = None) -> None:
    """Raise one rank's ``error`` as ValueError on every rank (so no rank goes on alone);
    nothing when there is none. Every rank must call it. Without ``all_gather``: rank
    0's ``error`` (broadcast). With ``all_gather`` (e.g. ``Comm.all_gather_object``):
    the error of the lowest rank that has one (a fault any rank may find)."""
    if all_gather is None:
        error = broadcast_from_main(error)
    else:
        error = next((e for e in all_gather(error) if e is not None), None)
    if error is not None:
        raise ValueError(error)


def error_of(check: Callable[..., Any], *args: Any) -> str | None:
    """The message of the ValueError ``check(*args)`` raises, or None (what a rank
    hands to ``agree`` or an all-gather so every rank raises alike)."""
    try:
        check(*args)
    except ValueError as e:
        return str(e)
    return None
