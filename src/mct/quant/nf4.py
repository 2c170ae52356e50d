"""NF4: 4-bit NormalFloat with double-quantized block scales (QLoRA, Dettmers et al. 2023).

A flat tensor is cut into blocks of ``NF4_BLOCK`` (64) elements. Each block keeps its
absolute maximum ``a`` and, per element, the index (4 bits) of the nearest of the 16 NF4
levels to ``x / a``. The block maxima are quantized in turn ("double quantization"): per
group of ``NF4_GROUP`` (256) blocks, their mean is subtracted and the rest is stored as int8
codes with one fp32 scale. Stored per group of ``NF4_ALIGN`` = 16384 elements:

  codes    uint8 [8192]   two levels per byte, the even element in the high nibble
  absmax   int8  [256]    round((a - mean) / scale), in [-127, 127]
  scale    fp32  [1]      max |a - mean| / 127 (1.0 where every block's a equals the mean)
  mean     fp32  [1]      the group's mean block maximum

0.5 + 1/64 + 8/16384 = 0.5161 bytes per element. The paper and both libraries take one
mean over the whole tensor; here it is one per group, so that a group's bytes depend on
its own 16384 values only: the encode of a flat equals the concatenation of the encodes
of its ``NF4_ALIGN``-aligned slices, whatever shards cut it (``mct.zero`` lays a frozen unit's
shards and parameters on multiples of ``NF4_ALIGN``). Costs 4 bytes per 16384 elements.

Elements are normalized by the *decoded* block maximum ``q`` (what decode multiplies by),
so the error of an element is at most ``0.1386 * a + 0.5 * scale``: half the widest gap
between levels (1 - 0.7230) times ``q``, plus the int8 rounding of ``a``.

Decode is two table look-ups per byte and one multiply, in chunks that stay in cache,
written straight into the caller's buffer in its dtype (product taken in fp32, then cast).
Why our own code, not torchao's or bitsandbytes' NF4: ``docs/adapters.md``.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

NF4_BLOCK = 64
"""Elements per block (one double-quantized absmax each)."""
NF4_GROUP = 256
"""Blocks per double-quantization group (one fp32 scale and one fp32 mean each)."""
NF4_ALIGN = NF4_BLOCK * NF4_GROUP
"""Elements per group: the unit of encoding. Flats, shards and parameters start on multiples of it."""

LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
"""The 16 NF4 levels (quantiles of N(0, 1) scaled to [-1, 1], an exact zero), as
bitsandbytes ships them."""

NF4_CHUNK = 1 << 16
"""Elements decoded (or encoded) per pass: 256 KiB of fp32, so a chunk's temporaries stay in cache."""

MAX_ERROR_PER_ABSMAX = 0.1386
"""Half the widest gap between adjacent levels (between 0.7230 and 1.0), rounded up."""


def groups_of(numel: int) -> int:
    """Groups covering ``numel`` elements (a flat is encoded padded with zeros to whole groups)."""
    return -(-numel // NF4_ALIGN)


def _midpoints(device: torch.device) -> torch.Tensor:
    """[15] fp32: the boundaries between adjacent levels."""
    lv = torch.tensor(LEVELS, dtype=torch.float32, device=device)
    return (lv[1:] + lv[:-1]) / 2


def _pair_table(device: torch.device) -> torch.Tensor:
    """[256, 2] fp32: the two levels a byte encodes (high nibble first)."""
    lv = torch.tensor(LEVELS, dtype=torch.float32, device=device)
    b = torch.arange(256, device=device)
    return torch.stack([lv[b >> 4], lv[b & 15]], dim=1)


class NF4Codec:
    """The frozen-unit storage codec (``mct.zero``'s protocol): ``align``, ``encode``,
    ``decode``/``decode_into``, ``stored_bytes``. Stateless: its two small tables (2 KiB)
    are built per call, transients on the device of the tensors (a planner's dry run counts
    them as the run does)."""

    name = "nf4"
    align = NF4_ALIGN

    def stored_bytes(self, numel: int) -> int:
        """Bytes ``encode`` stores for a flat of ``numel`` elements (codes, absmax codes,
        scales, means), padding to whole groups included."""
        g = groups_of(numel)
        return g * (NF4_ALIGN // 2 + NF4_GROUP + 4 + 4)

    def empty(self, numel: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Uninitialized parts for ``numel`` elements (the shapes ``encode`` returns)."""
        g = groups_of(numel)
        return {"codes": torch.empty(g * NF4_ALIGN // 2, dtype=torch.uint8, device=device),
                "absmax": torch.empty(g * NF4_GROUP, dtype=torch.int8, device=device),
                "scale": torch.empty(g, dtype=torch.float32, device=device),
                "mean": torch.empty(g, dtype=torch.float32, device=device)}

    def encode(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """``flat`` (1-D, any float dtype; read, not changed) -> its parts (new tensors),
        padded with zeros to whole groups. Deterministic: the same values give the same
        bytes, and group g's bytes depend only on elements [g * NF4_ALIGN, (g + 1) * NF4_ALIGN).
        Non-finite values raise ValueError (a frozen base holding them is corrupt)."""
        if flat.dim() != 1:
            raise ValueError(f"NF4 encodes a 1-D flat tensor, got shape {tuple(flat.shape)}")
        n = flat.numel()
        parts = self.empty(n, flat.device)
        mid = _midpoints(flat.device)
        with torch.no_grad():
            padded = groups_of(n) * NF4_ALIGN
            for a in _chunk_starts(padded, is_fake(flat)):
                self._encode_chunk(flat[a:a + NF4_CHUNK], a, min(NF4_CHUNK, padded - a), parts, mid)
        return parts

    def _encode_chunk(self, x: torch.Tensor, at: int, m: int, parts: dict[str, torch.Tensor],
                      mid: torch.Tensor) -> None:
        """Encode elements [at, at + m) (whole groups; ``x``: those that exist, zeros after) into ``parts``."""
        if x.numel() < m:
            x = torch.cat([x.float(), x.new_zeros(m - x.numel(), dtype=torch.float32)])
        xb = x.float().view(-1, NF4_BLOCK)
        if not is_fake(xb) and not torch.isfinite(xb).all():  # a dry run's fake values are not read
            raise ValueError(f"NF4 cannot encode non-finite values (elements {at}..{at + m})")
        g0, ng = at // NF4_ALIGN, m // NF4_ALIGN
        a = xb.abs().amax(dim=1).view(ng, NF4_GROUP)
        mean = a.mean(dim=1)
        dev = a - mean[:, None]
        scale = dev.abs().amax(dim=1) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes8 = (dev / scale[:, None]).round_().clamp_(-127, 127)
        q = (codes8 * scale[:, None] + mean[:, None]).view(-1, 1)  # what decode multiplies by
        y = xb / torch.where(q != 0, q, torch.ones_like(q))
        idx = torch.bucketize(y, mid).to(torch.uint8).view(-1, 2)
        parts["codes"][at // 2:(at + m) // 2] = (idx[:, 0] << 4) | idx[:, 1]
        parts["absmax"][g0 * NF4_GROUP:(g0 + ng) * NF4_GROUP] = codes8.view(-1).to(torch.int8)
        parts["scale"][g0:g0 + ng] = scale
        parts["mean"][g0:g0 + ng] = mean

    def block_absmax(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """The decoded block maxima (fp32 [blocks]): what each block's levels are multiplied by."""
        codes8 = parts["absmax"].view(-1, NF4_GROUP).float()
        return (codes8 * parts["scale"][:, None] + parts["mean"][:, None]).view(-1)

    def decode(self, parts: dict[str, torch.Tensor], numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A new [numel] tensor of ``dtype``: the first ``numel`` decoded elements."""
        out = torch.empty(numel, dtype=dtype, device=parts["codes"].device)
        return self.decode_into(parts, out)

    def decode_into(self, parts: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Write the first ``out.numel()`` decoded elements into ``out`` (1-D, any float
        dtype: level x block maximum in fp32, cast once). Returns ``out``. ValueError
        when the parts hold fewer elements than ``out``."""
        n = out.numel()
        have = parts["codes"].numel() * 2
        if n > have:
            raise ValueError(f"NF4 parts hold {have} elements, {n} asked")
        q = self.block_absmax(parts)
        pairs = _pair_table(out.device)
        fake = is_fake(out)
        with torch.no_grad():
            whole = n // NF4_CHUNK * NF4_CHUNK
            for a in _chunk_starts(whole, fake):
                _decode_chunk(pairs, parts["codes"], q, out[a:a + NF4_CHUNK], a)
            if whole < n:
                _decode_tail(pairs, parts["codes"], q, out[whole:], whole)
            if fake:  # the chunks skipped, priced as one pass over the output (a dry run's time model)
                out.mul_(1.0)
        return out


def _chunk_starts(n: int, fake: bool) -> list[int]:
    """Starts of the ``NF4_CHUNK``-element chunks of [0, n). On fake tensors (a dry run) only the
    first and the last: every chunk's temporaries are freed before the next is made, and the
    middle ones equal the first, so these two give the run's peak (and a dry run of an 8B base
    does not spend minutes on thousands of identical fake ops)."""
    starts = list(range(0, n, NF4_CHUNK))
    return sorted({starts[0], starts[-1]}) if fake and starts else starts


def _decode_chunk(pairs: torch.Tensor, codes: torch.Tensor, q: torch.Tensor, out: torch.Tensor, at: int) -> None:
    """``out`` (``NF4_CHUNK`` elements from ``at``) <- level x block maximum. int32 indices:
    index_select's fast path (a long cast was 2.5x slower). Its temporaries die on return."""
    vals = pairs.index_select(0, codes[at // 2:(at + NF4_CHUNK) // 2].int()).view(-1, NF4_BLOCK)
    torch.mul(vals, q[at // NF4_BLOCK:(at + NF4_CHUNK) // NF4_BLOCK, None], out=out.view(-1, NF4_BLOCK))


def _decode_tail(pairs: torch.Tensor, codes: torch.Tensor, q: torch.Tensor, out: torch.Tensor, at: int) -> None:
    """``out`` (the last, partial chunk from ``at``): its whole blocks decoded, the first
    ``out.numel()`` elements kept."""
    nb = -(-out.numel() // NF4_BLOCK)
    vals = pairs.index_select(0, codes[at // 2:at // 2 + nb * NF4_BLOCK // 2].int()).view(nb, NF4_BLOCK)
    vals.mul_(q[at // NF4_BLOCK:at // NF4_BLOCK + nb, None])
    out.copy_(vals.view(-1)[:out.numel()])


def round_trip(t: torch.Tensor, codec: NF4Codec | None = None) -> torch.Tensor:
    """``t`` encoded and decoded on its own (flattened, padded to whole groups), in its
    dtype and shape: what a frozen unit gives back for a parameter that starts on a
    multiple of ``NF4_ALIGN`` (its own groups, zeros after its end)."""
    codec = codec or NF4Codec()
    flat = t.detach().reshape(-1)
    return codec.decode(codec.encode(flat), flat.numel(), t.dtype).view(t.shape)

