"""Chunked linear cross-entropy (``train.loss_chunk_tokens``) end to end on CPU: a
transformers Llama with a 32k vocabulary (hidden 128, 2 layers, GQA 4/2), window 1024,
micro-batch 4, 2 gloo ranks, fp32, ZeRO stage 0 (``--stage``). Both variants train
interleaved step by step in the same processes (the default loss, unchunked and chunked),
so a shared CPU slows them alike. Prints the per-rank step peak (the engine tracker's,
steady state) and the median step time of each, the peak saved against the logits' fp32
bytes x 2 (the logits and their gradient), the MFU of each (model FLOPs with the unchunked
loss, one-thread ranks), and writes JSON.

    PYTHONPATH=src:. python benchmarks/loss_chunk.py [--chunk 1024] [--steps 4] [--json PATH]

Target (issue "Levers"): the peak falls by >= 75% of the logits' fp32 bytes x 2 at <= 1.1x
the step time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks` and `tests` importable
from benchmarks.common import (MFU_COLUMNS, add_mfu, cpu_line, format_table, interleave, mfu_line, mib,  # noqa: E402
                               step_utilization, summarize, write_json)
from mct.config import EngineConfig  # noqa: E402
from mct.engine import Engine  # noqa: E402
from mct.task.tokens import causal_lm_loss, loss_for  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

VOCAB, WINDOW, MBS = 32000, 1024, 4


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging
    logging.set_verbosity_error()
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=WINDOW, tie_word_embeddings=False,
                                        use_cache=False))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, VOCAB, (MBS, WINDOW), generator=g)
    return x, torch.roll(x, -1, 1)


def _worker(rank: int, world: int, chunk: int, stage: int, steps: int) -> dict[str, Any] | None:
    import torch.distributed as dist
    engines, losses, peaks = {}, {}, {}
    for name, c in (("unchunked", 0), ("chunked", chunk)):
        cfg = EngineConfig.from_dict({"zero": {"stage": stage}, "train": {"loss_chunk_tokens": c}})
        engines[name] = Engine(llama(), lambda g: torch.optim.AdamW(g, lr=1e-3), cfg)
        losses[name] = loss_for(cfg, causal_lm_loss)
        peaks[name] = []

    def step_of(name: str):
        def step(i: int) -> None:
            out = engines[name].train_step(_batch(i, rank), losses[name])
            peaks[name].append((out.metrics["peak_bytes"], out.loss))
        return step
    times = interleave({n: step_of(n) for n in engines}, steps, warmup=1, before_each=dist.barrier)
    if rank != 0:
        return None
    return {n: {"time": summarize(times[n]), "peak": min(p for p, _ in peaks[n][1:]),
                "losses": [loss for _, loss in peaks[n]]} for n in engines}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--stage", type=int, default=0)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json", default="loss_chunk")
    args = ap.parse_args(argv)
    res = run_distributed(_worker, 2, args.chunk, args.stage, args.steps, timeout=3600)[0]
    logits2 = 2 * MBS * WINDOW * VOCAB * 4
    saved = res["unchunked"]["peak"] - res["chunked"]["peak"]
    ratio = res["chunked"]["time"]["median"] / res["unchunked"]["time"]["median"]
    cfg = EngineConfig.from_dict({"zero": {"stage": args.stage}})  # model FLOPs: the unchunked loss's
    util = step_utilization(llama, loss_for(cfg, causal_lm_loss), _batch(0, 0), cfg, ranks=2, threads=1)
    rows = [add_mfu({"variant": n, "peak_mib": mib(r["peak"]), "step_s": r["time"]["median"],
                     "iqr_s": r["time"]["iqr"]}, util, r["time"]["median"]) for n, r in res.items()]
    print(f"HF Llama, vocab {VOCAB}, window {WINDOW}, micro-batch {MBS}, 2 ranks, stage {args.stage}, "
          f"chunk {args.chunk}; {cpu_line()}")
    print(format_table(rows, [("variant", "variant"), ("peak_mib", "peak MiB/rank"), ("step_s", "step s (median)"),
                              ("iqr_s", "IQR s"), *MFU_COLUMNS]))
    print(mfu_line(util))
    print(f"peak saved: {mib(saved)} MiB = {saved / logits2:.0%} of the logits' fp32 bytes x 2 ({mib(logits2)} MiB); "
          f"step time {ratio:.2f}x")
    path = write_json(args.json, {"chunk": args.chunk, "stage": args.stage, "results": res,
                                  "logits_fp32_x2_bytes": logits2, "peak_saved_bytes": saved,
                                  "saved_fraction": saved / logits2, "step_time_ratio": ratio, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
