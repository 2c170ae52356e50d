"""Packed documents against the two other ways to cut windows, on this CPU
(``data.packing``): the built-in GPT's training step (forward, backward, AdamW) on a
corpus of documents of varied lengths.

- ``documents``: windows of documents packed back to back, block-causal mask, positions
  restarting per document (mct's ``data.packing = 'documents'``; the sampler's own code);
- ``padded``: one document per row, padded to the window (a longer document goes on in
  the next row), pad targets ignored: what training without packing costs;
- ``stream``: windows at any offset, plain causal attention (``data.packing = 'stream'``).

Targets: real tokens/s of ``documents`` >= 1.5x ``padded``; step time of ``documents``
within 1.15x of ``stream``. Run: ``python benchmarks/packing.py [--seq-len 256]
[--steps 8] [--threads 1]``; prints a table and writes benchmarks/results/packing.json.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from common import cpu_line, format_table, interleave, summarize, write_json
from mct.config import ModelConfig
from mct.data.packing import IGNORE_INDEX, pack, window_documents
from mct.models.gpt import GPT, gpt_loss


def _corpus(n_docs: int, vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and document bounds: lengths log-normal (median ~90 tokens, 8..2000)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(4.5, 1.0, n_docs).astype(np.int64), 8, 2000)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return rng.integers(0, vocab, int(bounds[-1])), bounds


def _packed(tokens, bounds, B: int, T: int, rng) -> tuple:
    offsets = rng.choice((tokens.size - T - 1) // T + 1, size=B, replace=False) * T
    idx = offsets[:, None] + np.arange(T + 1)
    return pack(tokens[idx], window_documents(bounds, offsets, T))


def _padded(tokens, bounds, B: int, T: int, rng) -> tuple:
    """B rows, each one document (its first T + 1 tokens; a longer one's rest would be
    more rows) padded with token 0 and ignored targets."""
    x = np.zeros((B, T), np.int64)
    y = np.full((B, T), IGNORE_INDEX, np.int64)
    for row, d in enumerate(rng.choice(bounds.size - 1, size=B, replace=False)):
        doc = tokens[bounds[d]:min(bounds[d + 1], bounds[d] + T + 1)]
        x[row, :doc.size - 1], y[row, :doc.size - 1] = doc[:-1], doc[1:]
    return torch.from_numpy(x), torch.from_numpy(y)


def _stream(tokens, B: int, T: int, rng) -> tuple:
    idx = rng.choice(tokens.size - T, size=B, replace=False)[:, None] + np.arange(T + 1)
    chunk = torch.from_numpy(tokens[idx].astype(np.int64))
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="packing")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    B, T = args.batch, args.seq_len
    cfg = ModelConfig(n_layer=args.layers, n_head=4, d_model=args.d_model, seq_len=T, vocab_size=512, dropout=0.0)
    tokens, bounds = _corpus(4000, cfg.vocab_size, seed=0)
    makers = {"documents": lambda r: _packed(tokens, bounds, B, T, r),
              "padded": lambda r: _padded(tokens, bounds, B, T, r),
              "stream": lambda r: _stream(tokens, B, T, r)}
    real: dict[str, list[int]] = {name: [] for name in makers}
    steps = {}
    for name, make in makers.items():
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        rng = np.random.default_rng(1)

        def step(_: int, model=model, opt=opt, make=make, rng=rng, name=name) -> None:
            batch = make(rng)
            real[name].append(B * T if name != "padded" else int((batch[1] != IGNORE_INDEX).sum()))  # padding: the rest
            gpt_loss(model, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        steps[name] = step
    times = interleave(steps, args.steps)
    rows = []
    for name in makers:
        med = summarize(times[name])["median"]
        tok = float(np.mean(real[name]))
        rows.append({"variant": name, "step_s": med, "real_tokens": tok, "padding": B * T - tok,
                     "real_tokens_per_s": tok / med})
    by = {r["variant"]: r for r in rows}
    ratios = {"documents_vs_padded_real_tokens_per_s":
              by["documents"]["real_tokens_per_s"] / by["padded"]["real_tokens_per_s"],
              "documents_vs_stream_step_time": by["documents"]["step_s"] / by["stream"]["step_s"]}
    lengths = np.diff(bounds)
    print(cpu_line())
    print(f"GPT {args.layers} layers d_model {args.d_model}, B={B} T={T}, fp32, {args.threads} thread(s); document "
          f"lengths median {int(np.median(lengths))} (p10 {int(np.percentile(lengths, 10))}, p90 "
          f"{int(np.percentile(lengths, 90))}); median of {args.steps} interleaved steps")
    print(format_table(rows, [("variant", "variant"), ("step_s", "s/step"), ("real_tokens", "real tokens"),
                              ("padding", "padding"), ("real_tokens_per_s", "real tokens/s")]))
    print(f"documents / padded, real tokens/s: {ratios['documents_vs_padded_real_tokens_per_s']:.2f}x (target >= 1.5x)")
    print(f"documents / stream, step time:     {ratios['documents_vs_stream_step_time']:.2f}x (target <= 1.15x)")
    print(f"wrote {write_json(args.out, {'rows': rows, 'ratios': ratios, 'args': vars(args)})}")


if __name__ == "__main__":
    main()
