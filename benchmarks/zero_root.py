"""The ZeRO root unit's gradients (embedding + head, untied) at stage 3, measured: a
transformers Llama with a 32k vocabulary (hidden 128, 2 layers, GQA 4/2), window 256,
micro-batch 2, 2 gloo ranks, bf16, checkpointing ``all``, loss chunking on (128 tokens),
``zero.bucket_mb = 1`` (the root unit's fp32 gradient is 31 MiB: dozens of buckets).

Two engines train interleaved step by step in the same processes (a shared CPU slows
both alike):

  previous  the root unit as the blocks are: a flat fp32 gradient ``[P]`` from its first
            gradient (the head's, at the start of backward) on, and every bucket's copy
            of it alive at once at its reduce-scatter;
  current   the engine as it is: the root's gradients kept as they arrive and read into
            the reduce-scatter's buckets, at most ``IN_FLIGHT_BUCKETS`` in flight.

Prints each one's per-rank step peak (the engine tracker's, steady state) and median
step time, whether the two end bit-identical (losses and fp32 master shards), and the
planner's prediction of the current one against its measured peak; writes JSON.

    PYTHONPATH=src:. python benchmarks/zero_root.py [--steps 6] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks` and `tests` importable
from benchmarks.common import cpu_line, format_table, interleave, mib, summarize, write_json  # noqa: E402
from mct.config import EngineConfig  # noqa: E402
from mct.engine import Engine  # noqa: E402
from mct.task.tokens import causal_lm_loss, loss_for  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

VOCAB, HIDDEN, WINDOW, MBS = 32000, 128, 256, 2
CONFIG = {"zero": {"stage": 3, "bucket_mb": 1.0}, "precision": {"mode": "bf16"}, "checkpointing": {"policy": "all"},
          "train": {"loss_chunk_tokens": 128}}


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging
    logging.set_verbosity_error()
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=256,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=WINDOW, tie_word_embeddings=False, use_cache=False))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, VOCAB, (MBS, WINDOW), generator=torch.Generator().manual_seed(1000 * step + rank))
    return x, torch.roll(x, -1, 1)


def _worker(rank: int, world: int, steps: int) -> dict[str, Any] | None:
    import torch.distributed as dist
    cfg = EngineConfig.from_dict(CONFIG)
    loss_fn = loss_for(cfg, causal_lm_loss)
    engines, runs = {}, {}
    for name in ("previous", "current"):
        engines[name] = Engine(llama(), lambda g: torch.optim.AdamW(g, lr=1e-3), cfg)
        if name == "previous":
            for u in engines[name].sharded.units:
                u.hold_grads, u.bucket_window = False, None
        runs[name] = []

    def step_of(name: str):
        def step(i: int) -> None:
            out = engines[name].train_step(_batch(i, rank), loss_fn)
            runs[name].append((out.metrics["peak_bytes"], out.loss))
        return step
    times = interleave({n: step_of(n) for n in engines}, steps, warmup=1, before_each=dist.barrier)
    masters = [engines[n].sharded.masters() for n in engines]
    same = all(torch.equal(a, b) for a, b in zip(*masters)) and \
        [loss for _, loss in runs["previous"]] == [loss for _, loss in runs["current"]]
    if rank != 0:
        return None
    from mct.planner import predict_peak
    predicted = predict_peak(llama, loss_fn, _batch(0, 0), cfg, world)
    return {"bit_identical": same, "predicted_current": predicted,
            **{n: {"time": summarize(times[n]), "peak": min(p for p, _ in runs[n][1:])} for n in engines}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", default="zero_root")
    args = ap.parse_args(argv)
    res = run_distributed(_worker, 2, args.steps, timeout=1800)[0]
    root_fp32 = 2 * VOCAB * HIDDEN * 4
    rows = [{"variant": n, "peak_mib": mib(res[n]["peak"]), "step_s": res[n]["time"]["median"],
             "iqr_s": res[n]["time"]["iqr"]} for n in ("previous", "current")]
    print(f"HF Llama, vocab {VOCAB}, window {WINDOW}, micro-batch {MBS}, 2 ranks, stage 3, bf16; {cpu_line()}")
    print(format_table(rows, [("variant", "variant"), ("peak_mib", "peak MiB/rank"), ("step_s", "step s (median)"),
                              ("iqr_s", "IQR s")]))
    saved = res["previous"]["peak"] - res["current"]["peak"]
    err = res["predicted_current"] / res["current"]["peak"] - 1
    print(f"peak saved: {mib(saved)} MiB (the root unit's fp32 gradient: {mib(root_fp32)} MiB); bit-identical: "
          f"{res['bit_identical']}; planned {mib(res['predicted_current'])} MiB ({100 * err:+.2f}% of measured)")
    path = write_json(args.json, {**res, "root_fp32_grad_bytes": root_fp32, "peak_saved_bytes": saved})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
