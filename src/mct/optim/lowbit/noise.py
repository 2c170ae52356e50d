"""Counter-based rounding noise: a pure function of (seed, stream, step, global index).

Stochastic rounding needs random bits, but a generator's stream would depend on how
the state is cut into shards and on how many elements came before. Here the bits of
element i are a hash of its global flat index, the unit (``stream``), the step and the
seed (splitmix64's finalizer), so any rank of any world size draws the same bits for
the same element, and a resumed run draws what the uninterrupted one would have.
"""

from __future__ import annotations

import torch

_M1, _M2, _GOLDEN = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x9E3779B97F4A7C15


def _signed(v: int) -> int:
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def _key(seed: int, stream: int, step: int, salt: int) -> int:
    return _signed((seed * _GOLDEN) ^ (stream * _M1) ^ (step * _M2) ^ (salt * 0xD6E8FEB86659FD93))


def bits(seed: int, stream: int, step: int, salt: int, start: int, n: int,
         device: torch.device) -> torch.Tensor:
    """int64 [n]: 64 hashed bits per global index ``start .. start + n - 1``."""
    x = torch.arange(start, start + n, dtype=torch.int64, device=device)
    x.mul_(_signed(_GOLDEN)).bitwise_xor_(_key(seed, stream, step, salt))
    for m, s in ((_M1, 30), (_M2, 27)):
        x.bitwise_xor_(x >> s).mul_(_signed(m))  # int64 multiplication wraps, as uint64's does
    return x.bitwise_xor_(x >> 31)


def uniform(seed: int, stream: int, step: int, salt: int, start: int, n: int,
            device: torch.device) -> torch.Tensor:
    """fp32 [n] in [0, 1): 24 of each element's hashed bits."""
    return (bits(seed, stream, step, salt, start, n, device) & 0xFFFFFF).float().mul_(2.0**-24)


def noise16(seed: int, stream: int, step: int, salt: int, start: int, n: int,
            device: torch.device) -> torch.Tensor:
    """int32 [n] in [0, 2^16): the bits bf16 stochastic rounding adds."""
    return (bits(seed, stream, step, salt, start, n, device) & 0xFFFF).to(torch.int32)
