"""Block-causal attention candidates on this CPU (``data.packing = 'documents'``):
forward + backward time and peak live bytes per window length.

Candidates, all computing causal attention restricted to each document of a packed
window (q, k, v [B, H, T, D] fp32, documents of varied lengths):

- ``sdpa_bool``: SDPA with the bool block-causal mask [B, 1, T, T] (what mct's GPT uses);
- ``sdpa_additive``: SDPA with the same mask as an additive fp32 tensor (0 / -inf);
- ``per_doc``: one SDPA(is_causal=True) call per document, outputs concatenated;
- ``flex``: ``torch.nn.attention.flex_attention`` with a document mask_mod (eager,
  then compiled), where it runs on this CPU;
- ``causal``: SDPA(is_causal=True) over the whole window, the stream baseline (no mask).

Run: ``python benchmarks/packing_attention.py [--lengths 128,256,512,1024] [--steps 5]``.
Prints a table and writes benchmarks/results/packing_attention.json. Never asserts timings.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
import torch.nn.functional as F

from common import cpu_line, format_table, interleave, summarize, write_json
from mct.memory.tracker import MemoryTracker
from mct.models.documents import block_causal_mask


def _segments(B: int, T: int, seed: int) -> torch.Tensor:
    """[B, T] document ids: documents of 16..T/2 tokens (varied), packed back to back."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        ids, doc = [], 0
        while len(ids) < T:
            ids += [doc] * int(torch.randint(16, max(17, T // 2), (1,), generator=g))
            doc += 1
        rows.append(ids[:T])
    return torch.tensor(rows)


def _per_doc(q, k, v, seg):
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        bounds = torch.nonzero(torch.diff(seg[b], prepend=seg[b, :1] - 1)).flatten().tolist() + [q.shape[2]]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            out[b, :, lo:hi] = F.scaled_dot_product_attention(q[b:b + 1, :, lo:hi], k[b:b + 1, :, lo:hi],
                                                              v[b:b + 1, :, lo:hi], is_causal=True)[0]
    return out


def candidates(seg: torch.Tensor) -> dict[str, Callable]:
    """name -> attention(q, k, v) for documents ``seg``; the mask is built inside (its cost counts)."""
    found: dict[str, Callable] = {
        "causal": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "sdpa_bool": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(seg)),
        "sdpa_additive": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=torch.zeros(block_causal_mask(seg).shape).masked_fill_(~block_causal_mask(seg),
                                                                                      float("-inf"))),
        "per_doc": lambda q, k, v: _per_doc(q, k, v, seg),
    }
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def mask_mod(b, h, qi, ki):
            return (seg[b, qi] == seg[b, ki]) & (ki <= qi)

        def flex(q, k, v):
            bm = create_block_mask(mask_mod, q.shape[0], None, q.shape[2], q.shape[2], device="cpu")
            return flex_attention(q, k, v, block_mask=bm)
        found["flex_eager"] = flex
        found["flex_compiled"] = torch.compile(flex)
    except Exception as e:  # noqa: BLE001 - reported, not fatal: a candidate that does not exist here
        print(f"flex attention unavailable: {type(e).__name__}: {e}")
    return found


def _step(fn, q, k, v) -> Callable[[int], None]:
    def run(_: int) -> None:
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        fn(qq, kk, vv).sum().backward()
    return run


def _peak(fn, q, k, v) -> int:
    tracker = MemoryTracker("cpu")
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    tracker.reset_peaks()
    with tracker.phase("step"):
        fn(qq, kk, vv).sum().backward()
    return tracker.peak_total()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="128,256,512,1024")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default="packing_attention")
    args = ap.parse_args()
    rows = []
    for T in (int(x) for x in args.lengths.split(",")):
        seg = _segments(args.batch, T, seed=T)
        q, k, v = (torch.randn(args.batch, args.heads, T, args.head_dim) for _ in range(3))
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(seg))
        usable = {}
        for name, fn in candidates(seg).items():
            try:
                t0 = time.perf_counter()
                err = (fn(q, k, v) - ref).abs().max().item() if name != "causal" else None
                _step(fn, q, k, v)(0)  # training needs the backward: flex attention has none on CPU
                usable[name] = (fn, err, time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - a candidate that does not run here is a row saying so
                rows.append({"T": T, "name": name, "error": f"{type(e).__name__}: {str(e)[:60]}"})
        times = interleave({n: _step(f, q, k, v) for n, (f, _, _) in usable.items()}, args.steps)
        base = summarize(times["causal"])["median"]
        for name, (fn, err, first) in usable.items():
            med = summarize(times[name])["median"]
            rows.append({"T": T, "name": name, "ms": med * 1e3, "x_causal": med / base,
                         "peak_mib": _peak(fn, q, k, v) / 2**20, "max_err": err, "first_call_s": first})
    print(cpu_line())
    print(f"B={args.batch} H={args.heads} D={args.head_dim} fp32, threads={torch.get_num_threads()}; "
          "forward + backward, median of interleaved steps")
    print(format_table(rows, [("T", "T"), ("name", "candidate"), ("ms", "ms"), ("x_causal", "x causal"),
                              ("peak_mib", "peak MiB"), ("max_err", "max err"), ("first_call_s", "1st call s"),
                              ("error", "error")]))
    print(f"wrote {write_json(args.out, {'rows': rows, 'args': vars(args)})}")


if __name__ == "__main__":
    main()
