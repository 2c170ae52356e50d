"""Token-tiled MLP (``checkpointing.mlp_tile_tokens``): each block's MLP runs over tiles of
its tokens, so neither forward nor backward ever holds its ``[tokens, intermediate]``
tensors for more than one tile (DeepSpeed ALST's ``TiledMLP``, Liger's tiled MLP).

Forward runs the MLP tile by tile under no-grad and keeps only its input (under a
checkpointed block, torch's checkpoint drops even that and recomputes it). Backward takes
one tile at a time: restore the tile's RNG state, rerun the MLP on it with grad, and
back-propagate the tile's slice of the output gradient, which gives the tile's input
gradient and adds the tile's share into each weight's ``.grad``. The weight gradients
are sums over tiles instead of one matmul over all tokens: the only numeric change is
the summation order (and, in a low-precision dtype, one rounding per tile, as gradient
accumulation over micro-batches has).

Which module is the MLP: a block's child named ``mlp``, ``feed_forward`` or ``ffn``
(``MLP_NAMES``: Hugging Face Llama/Mistral/Qwen/GPT-2 layers, mct's GPT), called with one
tensor ``[..., hidden]`` and returning one tensor ``[..., out]``, token by token (no
token sees another: what an MLP is). The module keeps its parameters and names; only
its instance ``forward`` is patched, as checkpointing patches blocks.

A weight's gradient arrives once per tile: torch runs its post-accumulate-grad hooks once
per tile. ``TiledMLPs.more_tiles`` is True while a tile other than the last is being
back-propagated, so a consumer that counts arrivals (mct's ZeRO units) adds each tile's
share and counts only the last.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator

import torch
import torch.nn as nn
from torch.utils.checkpoint import _infer_device_type, get_device_states, set_device_states

from mct.checkpointing.offload import outside_selective_cache

MLP_NAMES = ("mlp", "feed_forward", "ffn")
"""Names of a block's child that is its MLP, in order of preference."""


def find_mlps(blocks: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Each block's MLP as ``(qualified_name, module)``: its first child named in
    ``MLP_NAMES``; blocks without one are left out. Mutates nothing."""
    found = []
    for name, block in blocks:
        child = next((block._modules[n] for n in MLP_NAMES if isinstance(block._modules.get(n), nn.Module)), None)
        if child is not None:
            found.append((f"{name}.{next(n for n in MLP_NAMES if block._modules.get(n) is child)}", child))
    return found


def token_spans(n: int, size: int) -> list[tuple[int, int]]:
    """[start, end) of each tile of ``size`` tokens over ``n`` (the last one may be short)."""
    return [(a, min(a + size, n)) for a in range(0, n, size)]


class PatchedForwards:
    """Modules whose instance ``forward`` was replaced (``patch``) and can be put back
    (``remove``: the instance ``forward`` it had before, or none); ``names`` in order."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._patched: list[tuple[nn.Module, Any]] = []

    def patch(self, name: str, module: nn.Module, forward: Callable) -> None:
        self._patched.append((module, module.__dict__.get("forward")))
        module.forward = forward
        self.names.append(name)

    def remove(self) -> None:
        for module, saved in self._patched:
            if saved is None:
                del module.forward
            else:
                module.forward = saved
        self._patched, self.names = [], []


class TiledMLPs(PatchedForwards):
    """The MLPs whose ``forward`` runs over tiles of ``tile_tokens`` tokens.

    ``install(mlps)`` patches each module's instance ``forward``; ``remove()`` restores
    it. ``recompute_context`` is entered around backward's per-tile recompute (the engine
    passes its tracker's ``activations`` category). ``more_tiles``: True while backward
    runs a tile other than a module's last (its weight gradients are partial). Per step
    (``reset_step`` zeroes it): ``tiles`` back-propagated."""

    def __init__(self, tile_tokens: int,
                 recompute_context: Callable[[], ContextManager] = contextlib.nullcontext) -> None:
        assert tile_tokens > 0, tile_tokens
        super().__init__()
        self.tile_tokens = tile_tokens
        self.recompute_context = recompute_context
        self.more_tiles = False
        self.tiles = 0

    def install(self, mlps: list[tuple[str, nn.Module]]) -> None:
        for name, module in mlps:
            if getattr(module.forward, "_mct_tiled", False):
                raise ValueError(f"MLP {name!r} is already tiled; call remove() on the earlier CheckpointState "
                                 "before applying again")
            original = module.forward

            def patched(*args: Any, _name: str = name, _module: nn.Module = module, _fn: Callable = original,
                        **kwargs: Any) -> Any:
                return self._forward(_name, _module, _fn, args, kwargs)
            patched._mct_tiled = True  # type: ignore[attr-defined]
            self.patch(name, module, patched)

    def metrics(self) -> dict[str, Any]:
        return {"mlp_tile_tokens": self.tile_tokens, "mlp_tiled_modules": len(self.names), "mlp_tiles": self.tiles}

    def _forward(self, name: str, module: nn.Module, fn: Callable, args: tuple, kwargs: dict) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing is kept for a backward
            return fn(*args, **kwargs)
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor) or args[0].dim() < 2:
            got = ", ".join([*(_describe(a) for a in args), *(f"{k}=" + _describe(v) for k, v in kwargs.items())])
            raise ValueError(f"checkpointing.mlp_tile_tokens = {self.tile_tokens}: {name} was called with ({got}); "
                             "a tiled MLP takes one tensor [..., hidden]: set checkpointing.mlp_tile_tokens = 0 "
                             "for this model")
        x, params = args[0], [p for p in module.parameters() if p.requires_grad]
        if not (x.requires_grad or params):
            return fn(x)
        # only the weights train (a frozen input): an empty leaf makes the output need a gradient
        anchor = () if x.requires_grad else (x.new_empty(0).requires_grad_(),)
        return _TiledMLP.apply(_TileRun(self, name, fn, params, x), x, *anchor)


def _describe(value: Any) -> str:
    return f"tensor {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


class _TileRun:
    """One call of a tiled MLP: its tiles, the RNG state before each tile and the autocast
    state of its forward, which backward's per-tile recompute restores."""

    def __init__(self, owner: TiledMLPs, name: str, fn: Callable, params: list[nn.Parameter],
                 x: torch.Tensor) -> None:
        self.owner, self.name, self.fn, self.params = owner, name, fn, params
        n, size = x.shape[:-1].numel(), owner.tile_tokens
        self.spans = token_spans(n, size)
        device = x.device.type
        self.autocast = dict(device_type=device, enabled=torch.is_autocast_enabled(device),
                             dtype=torch.get_autocast_dtype(device), cache_enabled=torch.is_autocast_cache_enabled())
        self.rng: list[tuple[torch.Tensor, list[int], list[torch.Tensor]]] = []

    def _tile(self, flat: torch.Tensor, like: torch.Tensor, a: int, b: int) -> torch.Tensor:
        # the input's own rank: [1, n, hidden] for [batch, tokens, hidden]
        return flat[a:b].view(*([1] * (like.dim() - 2)), b - a, flat.shape[-1])

    def _call(self, tile: torch.Tensor) -> torch.Tensor:
        y = self.fn(tile)
        if not isinstance(y, torch.Tensor) or y.shape[:-1] != tile.shape[:-1]:
            raise ValueError(f"checkpointing.mlp_tile_tokens: {self.name} returned {_describe(y)} for a tile "
                             f"{tuple(tile.shape)}; only a module that maps each token's vector to one vector can "
                             "be tiled: set checkpointing.mlp_tile_tokens = 0 for this model")
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = None
        for a, b in self.spans:
            self.rng.append((torch.get_rng_state(), *get_device_states(x)))
            y = self._call(self._tile(flat, x, a, b))
            if out is None:
                out = y.new_empty(flat.shape[0], y.shape[-1])
            out[a:b].copy_(y.reshape(b - a, -1))
            del y
        assert out is not None  # x has tokens: an empty input fails in _call's reshape first
        return out.view(*x.shape[:-1], out.shape[-1])

    def backward(self, x: torch.Tensor, grad: torch.Tensor, need_x: bool) -> torch.Tensor | None:
        flat, g = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        grad_x = torch.empty_like(flat) if need_x else None
        owner, last = self.owner, len(self.spans) - 1
        try:
            with owner.recompute_context(), torch.enable_grad(), torch.autocast(**self.autocast):
                for i, (a, b) in enumerate(self.spans):
                    owner.more_tiles = i < last
                    tile = self._tile(flat, x, a, b).detach().requires_grad_(need_x)
                    with _rng_restored(self.rng[i], x):
                        y = self._call(tile)
                    inputs = ([tile] if need_x else []) + self.params
                    if inputs and y.requires_grad:
                        torch.autograd.backward(y, g[a:b].view(y.shape), inputs=inputs)
                    if grad_x is not None and tile.grad is not None:
                        grad_x[a:b].copy_(tile.grad.reshape(b - a, -1))
                    elif grad_x is not None:
                        grad_x[a:b].zero_()
                    owner.tiles += 1
                    del y, tile
        finally:
            owner.more_tiles = False
        return None if grad_x is None else grad_x.view(x.shape)


@contextlib.contextmanager
def _rng_restored(state: tuple[torch.Tensor, list[int], list[torch.Tensor]], x: torch.Tensor) -> Iterator[None]:
    """The RNG streams as they were before a tile's forward, restored after (checkpoint's way)."""
    cpu, devices, states = state
    device_type = _infer_device_type(x)
    with torch.random.fork_rng(devices=devices, device_type=device_type):
        torch.set_rng_state(cpu)
        if devices:
            set_device_states(devices, states, device_type=device_type)
        yield


class _TiledMLP(torch.autograd.Function):
    """y = mlp(x), computed and differentiated tile by tile (``_TileRun``). The weights'
    gradients reach them inside backward, tile by tile, not through this node: were they
    its inputs, torch would also run their hooks for the None it returns for them."""

    @staticmethod
    def forward(ctx: Any, run: _TileRun, x: torch.Tensor, *anchor: torch.Tensor) -> torch.Tensor:
        ctx.run = run
        ctx.save_for_backward(x)
        # selective checkpointing must not keep (or replay) the tiles' matmuls: they are
        # recomputed tile by tile in backward anyway
        with outside_selective_cache():
            return run.forward(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (x,) = ctx.saved_tensors
        grad_x = ctx.run.backward(x, grad, ctx.needs_input_grad[1])
        return (None, grad_x, *([None] * (len(ctx.needs_input_grad) - 2)))
