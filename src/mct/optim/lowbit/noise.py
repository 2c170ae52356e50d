"""Counter-based rounding noise: a pure function of (seed, stream, step, global index).

Stochastic rounding needs random bits, but a generator's stream would depend on how
the state is cut into shards and on how many elements came before. Here the noise of
element i at a step is ``table[(i + shift) mod T]``: a table of T uniforms hashed once
from the seed (splitmix64's finalizer), and a shift hashed from (seed, stream, step,
salt) on the host. Any rank of any world size draws the same noise for the same
element, and a resumed run draws what the uninterrupted one would have. Reading a
slice of the table costs about one memcpy; hashing every element every step cost ~35 ns
per element here (``benchmarks/optimizer_state.py``). Elements T apart share their
noise within a step; across steps the shift moves, so each element's sequence is
uniform over the table, which is what unbiased rounding needs.
"""

from __future__ import annotations

import torch

T = 1 << 16
"""Table length: the longest slice one call returns (the optimizer's chunk)."""

_M1, _M2, _GOLDEN = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def _signed(v: int) -> int:
    v &= _MASK
    return v - (1 << 64) if v >= 1 << 63 else v


def mix(*words: int) -> int:
    """splitmix64 of the words, on the host (unsigned 64-bit result)."""
    x = 0
    for w in words:
        x = (x + _GOLDEN + (w & _MASK)) & _MASK
        x = ((x ^ (x >> 30)) * _M1) & _MASK
        x = ((x ^ (x >> 27)) * _M2) & _MASK
        x ^= x >> 31
    return x


def bits(seed: int, salt: int, start: int, n: int, device: torch.device) -> torch.Tensor:
    """int64 [n]: hashed bits of indices ``start .. start + n - 1`` (device-side)."""
    x = torch.arange(start, start + n, dtype=torch.int64, device=device)
    x.mul_(_signed(_GOLDEN)).bitwise_xor_(_signed(mix(seed, salt)))
    for m, s in ((_M1, 30), (_M2, 27)):
        x.bitwise_xor_(x >> s).mul_(_signed(m))  # int64 multiplication wraps, as uint64's does
    return x.bitwise_xor_(x >> 31)


class NoiseTable:
    """The seed's tables (twice over, so any slice of up to T is contiguous): fp32
    uniforms in [0, 1) and int32 in [0, 2^16) (bf16 rounding bits). 3 * 4 * 2T bytes."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.seed = seed
        h = bits(seed, 0x5EED, 0, T, device)
        u = (h & 0xFFFFFF).float().mul_(2.0**-24)
        self.uniform_table = torch.cat([u, u])
        b = ((h >> 24) & 0xFFFF).to(torch.int32)
        self.bits16_table = torch.cat([b, b])

    def shift(self, stream: int, step: int, salt: int, start: int) -> int:
        """Where global index ``start``'s noise sits in either doubled table (in [0, T))."""
        return (start + mix(self.seed, stream, step, salt)) % T

    def _at(self, stream: int, step: int, salt: int, start: int, n: int) -> int:
        assert n <= T, f"a noise slice of {n} elements is longer than the table ({T})"
        return self.shift(stream, step, salt, start)

    def uniform(self, stream: int, step: int, salt: int, start: int, n: int) -> torch.Tensor:
        """fp32 [n] (a view: do not modify) for global indices ``start .. start + n - 1``."""
        o = self._at(stream, step, salt, start, n)
        return self.uniform_table[o:o + n]

    def bits16(self, stream: int, step: int, salt: int, start: int, n: int) -> torch.Tensor:
        """int32 [n] in [0, 2^16) (a view) for global indices ``start .. start + n - 1``."""
        o = self._at(stream, step, salt, start, n)
        return self.bits16_table[o:o + n]
