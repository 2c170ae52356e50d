"""How a frozen flat unit's shard is stored: the codec protocol and the identity codec.

A frozen unit (``mct.zero.frozen``) keeps, on each rank, only its shard of the unit's
flat buffer, encoded by a ``FrozenCodec``; a gather all-gathers the *stored* tensors
and decodes the whole unit into the working buffer the parameters view. The identity
codec (the default) stores the shard as it is, in the working dtype: the gather then
lands straight in the working buffer, no decode. A block codec (NF4) declares its
block size as ``align``: shard boundaries and each parameter's start offset fall on
multiples of it, so no shard (and no parameter) splits a quantization block, and the
stored bytes of a unit are the same at any world size.
"""

from __future__ import annotations

from typing import Protocol

import torch


class FrozenCodec(Protocol):
    """Storage of a frozen unit's shard.

    ``align``: elements; every slice ``encode`` gets holds a multiple of it and starts at
    a multiple of it on the unit's flat index. ``encode(flat)``: a 1-D slice (the working
    dtype) -> the stored tensors, each 1-D, contiguous, new (never a view of ``flat``),
    their lengths proportional to ``flat``'s (so every rank's parts concatenate into the
    whole unit's). ``decode(parts, numel, dtype)``: the concatenated parts of ``numel``
    elements -> a 1-D tensor of ``numel`` elements in ``dtype``. ``stored_bytes(numel)``:
    what ``encode`` keeps for ``numel`` elements (scales included)."""

    align: int

    def encode(self, flat: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def decode(self, parts: dict[str, torch.Tensor], numel: int, dtype: torch.dtype) -> torch.Tensor: ...

    def stored_bytes(self, numel: int) -> int: ...


class IdentityCodec:
    """Stores the shard as it is, in the dtype it comes in (the working dtype): a frozen
    unit's stored bytes are its parameters' own bytes over the world size."""

    align = 1

    def __init__(self, dtype: torch.dtype) -> None:
        """``dtype``: the working (parameter) dtype; only ``stored_bytes`` reads it."""
        self.dtype = dtype

    def encode(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"data": flat.detach().clone()}

    def decode(self, parts: dict[str, torch.Tensor], numel: int, dtype: torch.dtype) -> torch.Tensor:
        return parts["data"][:numel].to(dtype)

    def stored_bytes(self, numel: int) -> int:
        return numel * self.dtype.itemsize
