"""Context parallelism on this CPU (``parallel.context``): one window of ``--seq-len``
tokens (default 8192, packed documents) on a small transformers Llama, trained by
``mct.Engine`` at context degree 1 on one rank and degree 2 on two gloo ranks (the same
global tokens: one window a step), with each attention of ``parallel.context_attention``
(the ring's profile splits its block attention from its waits for the exchanges in flight,
and the ring's row times one exchange alone: what the waits would cost if nothing
overlapped them).

Reports per variant: the median step time, each rank's activation peak (the engine's
tracker: the most bytes of the 'activations' category in any phase) and its ratio to
degree 1's (target <= 0.55x), and where rank 0's step goes (torch.profiler, self CPU
time by kind: attention kernels, collectives, matmuls, the rest). torch's own
``torch.distributed.tensor.experimental.context_parallel`` is tried on gloo beside them
and the table says whether it ran.

Run: ``python benchmarks/context_parallel.py [--seq-len 8192] [--steps 3] [--threads 1] [--variants 1,ring]``;
prints a table and writes benchmarks/results/context_parallel.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import traceback
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import cpu_line, format_table, mib, write_json
from mct.config import EngineConfig
from mct.data.packing import pack_window
from mct.dist import DistContext
from mct.engine import Engine
from mct.task.tokens import token_loss

VOCAB = 512
KINDS = {"attention": ("attention", "sdpa", "softmax"), "collectives": ("gloo", "c10d", "all_gather", "all_to_all",
                                                                         "reduce_scatter", "allgather", "alltoall"),
         "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")}


def llama(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging
    logging.set_verbosity_error()
    cfg = LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=2 * args.hidden, vocab_size=VOCAB,
                      max_position_embeddings=args.seq_len, use_cache=False, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def window(step: int, T: int) -> tuple[torch.Tensor, ...]:
    """One packed window: documents of log-normal lengths (median ~400 tokens) crossing every split point."""
    rng = np.random.default_rng(step)
    lengths = np.clip(rng.lognormal(6.0, 1.0, 64).astype(np.int64), 16, T)
    starts = np.zeros(T + 1, np.int64)
    starts[np.cumsum(lengths)[np.cumsum(lengths) < T + 1]] = 1
    return pack_window(rng.integers(0, VOCAB, (1, T + 1)), np.cumsum(starts)[None])


RING_SCOPES = {"mct.ring.attend": "attention", "mct.ring.wait": "ring wait"}
"""The ring attention's profiler scopes (``mct.context.ring``): what runs inside is its kind."""


def _kind(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS.items() if any(key in low for key in keys)), "other")


def _event_kind(ev: Any) -> str:
    """An event's kind: the ring scope it runs in, if any, else by its own name."""
    parent = ev
    while parent is not None:
        if parent.name in RING_SCOPES:
            return RING_SCOPES[parent.name]
        parent = parent.cpu_parent
    return _kind(ev.name)


def _exchange_s(rank: int, world: int, args: argparse.Namespace) -> float:
    """Seconds of one ring exchange of a degree-``world`` key/value block alone (nothing to
    overlap): median of 5, what the ring's waits would cost with no compute to hide them."""
    from mct.context.comm import context_comm
    comm = context_comm(world, rank, world, simulated=False)
    head = args.hidden // 4
    kv = torch.randn(2, 1, 2, args.seq_len // world, head)
    times = []
    for _ in range(6):
        dist.barrier()
        t0 = time.perf_counter()
        comm.exchange(kv, 9).wait()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _run(rank: int, world: int, args: argparse.Namespace, attention: str) -> dict[str, Any]:
    """Train ``args.steps`` steps on this rank; returns times, peaks and rank 0's profile."""
    cfg = EngineConfig.from_dict({"model": {"seq_len": args.seq_len},
                                  "parallel": {"context": world, "context_attention": attention}})
    torch.manual_seed(0)
    engine = Engine(llama(args), lambda groups: torch.optim.AdamW(groups, lr=1e-3), cfg,
                    ctx=None if world > 1 else DistContext())
    times, peaks = [], []
    for step in range(args.steps + 1):  # the first step warms up
        t0 = time.perf_counter()
        out = engine.train_step(window(step, args.seq_len), token_loss)
        times.append(time.perf_counter() - t0)
        peaks.append(max(p.get("activations", 0) for p in out.metrics["peaks"].values()))
    from torch.profiler import ProfilerActivity, profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:  # every rank steps; rank 0 reports
        engine.train_step(window(99, args.seq_len), token_loss)
    profile: dict[str, float] = {}
    for ev in prof.events():
        if ev.name not in RING_SCOPES:  # a scope's own time is its children's
            profile[_event_kind(ev)] = profile.get(_event_kind(ev), 0.0) + ev.self_cpu_time_total / 1e6
    engine.close()
    result = {"step_s": statistics.median(times[1:]), "act_peak": max(peaks[1:]), "profile": profile}
    if attention == "ring":
        result["exchange_s"] = _exchange_s(rank, world, args)
    return result


def _torch_cp(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """torch's own context_parallel around one forward and backward of the same model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = llama(args)
    x, y, _ = window(0, args.seq_len)
    pos = torch.arange(args.seq_len)[None]
    t0 = time.perf_counter()
    with context_parallel(mesh, buffers=[x, y, pos], buffer_seq_dims=[1, 1, 1]):
        logits = model(input_ids=x, position_ids=pos, use_cache=False).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    return {"step_s": time.perf_counter() - t0, "act_peak": None, "profile": {}}


def _worker(rank: int, world: int, init: str, args: argparse.Namespace, what: str, queue) -> None:
    torch.set_num_threads(args.threads)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
        result = _torch_cp(rank, world, args) if what == "torch" else _run(rank, world, args, what)
        queue.put((rank, result))
    except Exception:  # noqa: BLE001 - reported in the table
        queue.put((rank, {"error": traceback.format_exc().strip().splitlines()[-1][:160]}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(world: int, args: argparse.Namespace, what: str) -> list[dict[str, Any]]:
    """Run ``what`` on ``world`` fresh gloo ranks; results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, world, os.path.join(tmp, "rdv"), args, what, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        got = dict(queue.get() for _ in procs)
        for p in procs:
            p.join()
    return [got[r] for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="context_parallel")
    ap.add_argument("--variants", default="1,all_to_all,all_gather,ring,torch",
                    help="comma-separated: 1 (degree 1), all_to_all, all_gather, ring, torch")
    args = ap.parse_args()
    every = {"1": ("degree 1, 1 rank", 1, "auto"), "all_to_all": ("degree 2, all_to_all", 2, "all_to_all"),
             "all_gather": ("degree 2, all_gather", 2, "all_gather"), "ring": ("degree 2, ring", 2, "ring"),
             "torch": ("torch context_parallel", 2, "torch")}
    variants = [every[v] for v in args.variants.split(",")]
    rows = []
    for label, world, what in variants:
        ranks = spawn(world, args, what)
        errors = sorted((r["error"] for r in ranks if "error" in r), key=lambda e: "Connection closed" in e)
        err = errors[0] if errors else None  # the rank that failed first, not a peer it left
        row: dict[str, Any] = {"variant": label, "ranks": world}
        if err:
            row["note"] = f"did not run: {err}"
        else:
            row.update(step_s=max(r["step_s"] for r in ranks), act_peak=max(r["act_peak"] or 0 for r in ranks),
                       **{f"{k.replace(' ', '_')}_s": v for k, v in ranks[0]["profile"].items()})
            if "exchange_s" in ranks[0]:
                row["exchange_s"] = ranks[0]["exchange_s"]
        rows.append(row)
    base = rows[0].get("act_peak")
    for row in rows:
        if row.get("act_peak") and base:
            row["act_ratio"], row["act_mib"] = row["act_peak"] / base, mib(row["act_peak"])
    print(cpu_line())
    print(f"transformers Llama {args.layers} layers, hidden {args.hidden}, 4 heads / 2 key-value heads, one packed "
          f"window of {args.seq_len} tokens a step, fp32, AdamW, {args.threads} thread(s) a rank; median of "
          f"{args.steps} steps after one warm-up; profile: rank 0, one step, self CPU seconds")
    print(format_table(rows, [("variant", "variant"), ("ranks", "ranks"), ("step_s", "s/step"),
                              ("act_mib", "act peak"), ("act_ratio", "vs degree 1"), ("attention_s", "attn s"),
                              ("collectives_s", "comm s"), ("ring_wait_s", "ring wait s"), ("matmul_s", "matmul s"),
                              ("other_s", "other s")]))
    for row in rows:
        if "note" in row:
            print(f"{row['variant']}: {row['note']}")
        if "exchange_s" in row:
            print(f"{row['variant']}: one exchange of a key/value block alone {row['exchange_s'] * 1e3:.2f} ms; "
                  f"{args.layers} layers x 4 exchanges a step (1 forward, 3 backward) would wait "
                  f"{row['exchange_s'] * args.layers * 4:.3f} s unhidden")
    print(f"wrote {write_json(args.out, {'rows': rows, 'args': vars(args)})}")


if __name__ == "__main__":
    main()
