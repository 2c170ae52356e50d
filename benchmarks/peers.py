"""mct's Engine against torch FSDP2 and DeepSpeed ZeRO-3 on a transformers Llama, side by side.

Every variant trains the same ``LlamaForCausalLM`` (built from a ``LlamaConfig`` with
the same seed, so the same weights) on the same random token batches, with ZeRO-3 /
full sharding over 2 gloo ranks x 1 thread, ``torch.optim.AdamW(lr=1e-3)`` as a user
would pass it, gradient clipping at 1.0 and the same fp32 cross-entropy
(``mct.task.tokens.causal_lm_loss``):

  mct        ``mct.Engine``, ``zero.stage = 3``, ``zero.reshard_root_after_forward = false``
             (the root kept gathered from the forward into the backward, as FSDP2 keeps its
             root), ``precision.mode``, ``checkpointing.policy = "all"`` for the checkpointed
             rows, ``memory.track = false``
  fsdp2      ``torch.distributed.fsdp.fully_shard`` on every decoder layer and the root;
             bf16: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``;
             ``clip_grad_norm_``; checkpointing: transformers' ``gradient_checkpointing_enable``
  deepspeed  ``deepspeed.initialize`` with ZeRO stage 3, ``bf16.enabled`` for bf16,
             ``gradient_clipping = 1.0``, the torch AdamW as a client optimizer; checkpointing
             as fsdp2's

All variants of a row live in the same two processes and step round-robin (a barrier
before each step), so load from elsewhere hits them alike; a step's time is its slowest
rank's; each row prints the median step, each variant's ratio to the best peer's median
and MFU (model FLOPs counted by ``mct.planner.flops`` on fake tensors / step time / this
machine's matmul peak from ``mct.machine`` for the row's dtype x 1 thread x 2 ranks), and
the first step's loss of each variant (the same weights and batch: they agree to the
dtype's rounding). bf16 rows run only where the CPU has native bf16 (avx512_bf16 or
amx_bf16 in /proc/cpuinfo). JSON goes to ``benchmarks/results/peers.json``.

DeepSpeed is never a dependency of mct. To include it, make a scratch virtual environment
that sees this project's packages and install it there::

    python -m venv /tmp/ds-venv
    .venv/bin/python -c "import site; print(*site.getsitepackages(), sep='\\n')" \\
        > /tmp/ds-venv/lib/python3.11/site-packages/base.pth   # torch, transformers, ... (every
                                                               # folder: .venv sees the system's too)
    /tmp/ds-venv/bin/pip install wheel setuptools
    /tmp/ds-venv/bin/pip install --no-build-isolation deepspeed==0.19.8   # CPU accelerator, no ops built

then pass ``--deepspeed-python /tmp/ds-venv/bin/python``: the benchmark runs its ranks with
that interpreter (every variant, so they still interleave). Without it the DeepSpeed
column is skipped with a one-line note.

    PYTHONPATH=src:. python benchmarks/peers.py [--quick] [--sizes small,medium] [--precisions bf16,fp32]
        [--no-checkpointed-rows] [--rounds 2] [--steps 3] [--deepspeed-python PATH] [--host-malloc cache]
        [--mct-alt KEY=VALUE[,KEY=VALUE]]... [--mct-gloo-collectives] [--local]

``--mct-alt memory.huge_pages=false`` adds an mct variant with that setting to every row, stepping
in turn with the others in the same ranks: an A/B of one setting under the same load.

``--mct-gloo-collectives`` adds an mct variant ('mct-gloo') that issues gloo's own all-gather and
all-reduce where mct sends and receives point to point (``mct.zero.comm.TorchCollectives``).

``--local`` adds the floor ('local', ``_local``): each rank steps a whole replica of the model
alone, no sharding and no gradient exchange, and a column 'x local' (each variant's median over
the floor's): what the model's own compute costs on these ranks, which a ZeRO-3 step can beat only
by the half of the optimizer's work it does not do. A target of 0.85x the best peer is out of
any framework's reach on a row where 0.85 x the best peer's step is under the floor's.

``--host-malloc cache`` sets glibc's malloc as mct's ``memory.host_malloc = "cache"`` does, in
each rank before any variant is built: it is process-wide, so the peers run under it too
(the ratios compare the frameworks, the MFU column shows the step without page faults).

Memory: each row runs in two fresh processes; the medium size holds about 2.2 (mct), 1.8
(FSDP2) and 2.5 GiB (DeepSpeed) per rank, all three alive at once: ~13 GiB for the row.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks` and `tests` importable
from benchmarks.common import cpu_info, cpu_line, format_table, interleave, write_json  # noqa: E402
from mct.task.tokens import causal_lm_loss  # noqa: E402

SIZES = {  # hidden, layers, heads, kv heads, vocab, seq, micro-batch (the two sizes)
    "small": (256, 4, 4, 4, 8192, 256, 4),
    "medium": (1024, 8, 16, 4, 32000, 256, 2),
}
LR, CLIP = 1e-3, 1.0
BUCKET = 25 * 2**20 // 4
"""DeepSpeed's reduce and prefetch buckets, in elements: mct's ``zero.bucket_mb = 25`` of fp32
(DeepSpeed's defaults, 5e8 and 5e7 elements, are sized for GPUs: 2 GiB per rank of fp32 buckets
put the medium size out of this machine's memory)."""
PEERS = ("fsdp2", "deepspeed")


def llama_config(size: str):
    """The transformers ``LlamaConfig`` of ``size`` (MLP 2.75 x hidden, untied head)."""
    from transformers import LlamaConfig
    from transformers.utils import logging
    logging.set_verbosity_error()
    hidden, layers, heads, kv, vocab, seq, _ = SIZES[size]
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(2.75 * hidden) // 64 * 64,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                       max_position_embeddings=seq, tie_word_embeddings=False, use_cache=False)


def llama(size: str) -> torch.nn.Module:
    """The size's Llama, seeded: the same weights in every variant and process."""
    from transformers import LlamaForCausalLM
    config = llama_config(size)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def batch(size: str, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s token batch of ``step`` (inputs, next-token targets)."""
    *_, vocab, seq, mbs = SIZES[size]
    x = torch.randint(0, vocab, (mbs, seq + 1), generator=torch.Generator().manual_seed(1000 * step + rank))
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def native_bf16() -> bool:
    """Does this CPU multiply bf16 natively (avx512_bf16 or AMX)?"""
    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_info()["flags"]))


# ---- the variants: each returns step(i) -> the step's mean loss over ranks (``loss_fn``: the
# cross-entropy, or one that labels the forward for a profile) ----

def mct_config(precision: str, recompute: bool, sets: tuple[str, ...] = ()):
    """mct's ``EngineConfig`` for a row; ``sets``: ``section.key=value`` overrides (``--mct-alt``).
    Raises ValueError as ``mct train --set`` does."""
    from mct import EngineConfig
    from mct.config import apply_overrides
    return EngineConfig.from_dict(apply_overrides({"zero": {"stage": 3, "reshard_root_after_forward": False},
                                                   "precision": {"mode": precision},
                                                   "checkpointing": {"policy": "all" if recompute else "none"},
                                                   "train": {"grad_clip": CLIP}, "memory": {"track": False}},
                                                  list(sets)))


def _mct(size: str, precision: str, recompute: bool, rank: int,
         loss_fn: Callable = causal_lm_loss, sets: tuple[str, ...] = (),
         gloo_collectives: bool = False) -> Callable[[int], float]:
    """``gloo_collectives``: this engine issues gloo's own all-gather and all-reduce where
    mct sends and receives (``mct.zero.comm.GLOO_P2P``, read when the engine is built) or
    reads shared memory (``distributed.shared_memory``, off in that variant)."""
    from mct import Engine
    from mct.zero import comm
    cfg = mct_config(precision, recompute, sets + (("distributed.shared_memory=false",) if gloo_collectives else ()))
    was, comm.GLOO_P2P = comm.GLOO_P2P, not gloo_collectives
    try:
        engine = Engine(llama(size), lambda groups: torch.optim.AdamW(groups, lr=LR), cfg)
    finally:
        comm.GLOO_P2P = was
    return lambda i: engine.train_step(batch(size, i, rank), loss_fn).loss


def _mean_over_ranks(loss: torch.Tensor) -> float:
    """The step's loss averaged over ranks (fp32), as every variant reports it: one scalar all-reduce."""
    import torch.distributed as dist
    mean = loss.detach().float().clone()
    dist.all_reduce(mean)
    return float(mean) / dist.get_world_size()


def _fsdp2(size: str, precision: str, recompute: bool, rank: int,
           loss_fn: Callable = causal_lm_loss) -> Callable[[int], float]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model = llama(size)
    if recompute:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if precision == "bf16" else MixedPrecisionPolicy())
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(i: int) -> float:
        loss = loss_fn(model, batch(size, i, rank))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return _mean_over_ranks(loss)
    return step


def _deepspeed(size: str, precision: str, recompute: bool, rank: int,
               loss_fn: Callable = causal_lm_loss) -> Callable[[int], float]:
    import deepspeed
    import torch.nn.functional as F
    plain_linear = F.linear
    model = llama(size)
    if recompute:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    *_, mbs = SIZES[size]
    config = {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, "reduce_bucket_size": BUCKET, "stage3_prefetch_bucket_size": BUCKET},
              "bf16": {"enabled": precision == "bf16"},
              "gradient_clipping": CLIP, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
              "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
                                      config=config, dist_init_required=False)
    # ZeRO-3's initialize replaces torch.nn.functional.linear process-wide ("memory efficient
    # linear", a Python autograd.Function; it persists unless reset): it is DeepSpeed's for its
    # own steps only, not the other variants' in the same processes
    ds_linear, F.linear = F.linear, plain_linear

    def step(i: int) -> float:
        F.linear = ds_linear
        try:
            loss = loss_fn(engine, batch(size, i, rank))
            engine.backward(loss)
        finally:
            F.linear = plain_linear
        engine.step()
        return _mean_over_ranks(loss)
    return step


def _local(size: str, precision: str, recompute: bool, rank: int,
           loss_fn: Callable = causal_lm_loss) -> Callable[[int], float]:
    """The floor (``--local``): each rank steps a whole replica of the model by itself, the same
    loss, AdamW and clipping, no sharding and no gradient exchange, only the loss's mean
    all-reduced as every variant does. It is what the model's own forward, backward and optimizer
    cost on these two ranks sharing this CPU: no ZeRO-3 step can be faster except by doing half
    the optimizer's work (each rank's shard), and a ZeRO-3 variant's time beyond it is its
    communication, waits and bookkeeping. bf16: the model's parameters in bf16, fp32 masters
    stepped by AdamW, the gradients cast to fp32 (what FSDP2's ``MixedPrecisionPolicy`` computes),
    the masters cast back after the step."""
    model = llama(size)
    if recompute:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    masters = params
    if precision == "bf16":
        masters = [torch.nn.Parameter(p.detach().clone()) for p in params]
        model.to(torch.bfloat16)
    opt = torch.optim.AdamW(masters, lr=LR)

    def step(i: int) -> float:
        loss = loss_fn(model, batch(size, i, rank))
        loss.backward()
        if masters is not params:
            for m, p in zip(masters, params):
                m.grad, p.grad = p.grad.float(), None
        torch.nn.utils.clip_grad_norm_(masters, CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if masters is not params:
            with torch.no_grad():
                for m, p in zip(masters, params):
                    p.copy_(m)
        return _mean_over_ranks(loss)
    return step


VARIANTS = {"mct": _mct, "fsdp2": _fsdp2, "deepspeed": _deepspeed, "local": _local}


def _variant(name: str) -> Callable[..., Callable[[int], float]]:
    """A variant's builder; ``mct[a.b=1,c.d=x]``: mct's with those config overrides (``--mct-alt``);
    ``mct-gloo``: mct's with gloo's collectives (``--mct-gloo-collectives``)."""
    if name == "mct-gloo":
        return lambda *a, **kw: _mct(*a, **kw, gloo_collectives=True)
    if name.startswith("mct[") and name.endswith("]"):
        sets = tuple(name[4:-1].split(","))
        return lambda *a, **kw: _mct(*a, **kw, sets=sets)
    return VARIANTS[name]


def _worker(rank: int, world: int, rows: list[dict[str, Any]], variants: list[str], steps: int,
            rounds: int, host_malloc: str = "default") -> list[dict[str, Any]]:
    import gc
    import warnings

    import torch.distributed as dist
    from mct.memory import host
    host.for_building(host_malloc)  # process-wide: every variant of the row runs under it
    host.for_training(host_malloc)
    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecations of the peers' own internals
    if "deepspeed" in variants:
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)  # the group exists: adopt it
    out = []
    for row in rows:
        steps_of = {v: _variant(v)(row["size"], row["precision"], row["recompute"], rank) for v in variants}
        first: dict[str, float] = {}

        def record(v: str, fn: Callable[[int], float]) -> Callable[[int], None]:
            def call(i: int) -> None:
                loss = fn(i)
                first.setdefault(v, loss)
            return call
        times: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(rounds):  # a round: one warm-up step of each variant, then ``steps`` timed
            got = interleave({v: record(v, fn) for v, fn in steps_of.items()}, steps, warmup=1 if r == 0 else 0,
                             before_each=dist.barrier)
            for v in variants:
                times[v] += got[v]
        out.append({**row, "times": times, "first_loss": first})
        del steps_of
        gc.collect()
    return out


def _rows(sizes: list[str], precisions: list[str], checkpointed: bool) -> list[dict[str, Any]]:
    if "bf16" in precisions and not native_bf16():
        print("note: bf16 rows left out: this CPU has no native bf16 (avx512_bf16 or amx_bf16)")
        precisions = [p for p in precisions if p != "bf16"]
    rows = [{"size": s, "precision": p, "recompute": False} for s in sizes for p in precisions]
    if "medium" in sizes and checkpointed:  # the checkpointed rows
        rows += [{"size": "medium", "precision": p, "recompute": True} for p in precisions]
    return rows


def _mfu(row: dict[str, Any], world: int):
    """The row's ``mct.run.utilization.Utilization`` (model FLOPs, this machine's peak)."""
    from benchmarks.common import step_utilization
    return step_utilization(lambda: llama(row["size"]), causal_lm_loss, batch(row["size"], 0, 0),
                            {"precision": {"mode": row["precision"]}, "zero": {"stage": 3}}, ranks=world, threads=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the small size only, 1 round")
    ap.add_argument("--sizes", default="small,medium")
    ap.add_argument("--precisions", default="bf16,fp32")
    ap.add_argument("--checkpointed-rows", action=argparse.BooleanOptionalAction, default=True,
                    help="the medium size with full activation checkpointing too")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    ap.add_argument("--deepspeed-python", default=None, help="an interpreter that imports deepspeed (docstring)")
    ap.add_argument("--host-malloc", default="default", choices=["default", "cache"],
                    help="glibc malloc of the ranks, process-wide, so every variant runs under it "
                         "(mct's memory.host_malloc; 'cache': no page faults, more resident memory)")
    ap.add_argument("--mct-alt", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                    help="one more mct variant with these config overrides (e.g. memory.huge_pages=false), "
                         "interleaved with the others in the same ranks: an A/B of a setting; repeatable")
    ap.add_argument("--mct-gloo-collectives", action="store_true",
                    help="one more mct variant ('mct-gloo') issuing gloo's own all-gather and all-reduce "
                         "where mct sends and receives point to point: what that choice buys, same ranks")
    ap.add_argument("--local", action="store_true",
                    help="one more variant ('local'): each rank steps a whole replica alone, no sharding, no "
                         "gradient exchange: the floor of the model's own compute on these ranks; adds 'x local'")
    ap.add_argument("--json", default="peers", help="result name or path (.json)")
    ap.add_argument("--with-deepspeed", action="store_true", help=argparse.SUPPRESS)  # set by the re-run
    args = ap.parse_args()
    sizes = ["small"] if args.quick else args.sizes.split(",")
    rounds = 1 if args.quick else args.rounds
    precisions = args.precisions.split(",")
    if rounds < 1 or args.steps < 1:
        ap.error(f"--rounds {rounds} --steps {args.steps}: each must be at least 1")
    bad = [s for s in sizes if s not in SIZES]
    if bad:
        ap.error(f"--sizes {args.sizes!r}: {bad[0]!r} is not a size; choose from {','.join(SIZES)}")
    if any(p not in ("bf16", "fp32") for p in precisions):
        ap.error(f"--precisions {args.precisions!r}: choose from bf16,fp32")
    if args.deepspeed_python and not args.with_deepspeed:  # run everything under that interpreter
        argv = [a for a in sys.argv[1:]]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1] / "src"),
                                                                         os.environ.get("PYTHONPATH")]))}
        sys.exit(subprocess.call([args.deepspeed_python, __file__, *argv, "--with-deepspeed"], env=env))
    for alt in args.mct_alt:  # every row's config, checked before any rank starts
        try:
            for p in precisions:
                mct_config(p, False, tuple(alt.split(",")))
        except ValueError as e:
            ap.error(f"--mct-alt {alt!r}: {e}")
    variants = ["mct", *(f"mct[{alt}]" for alt in args.mct_alt), *(["mct-gloo"] if args.mct_gloo_collectives else []),
                "fsdp2"] + (["deepspeed"] if args.with_deepspeed else []) + (["local"] if args.local else [])
    if not args.with_deepspeed:
        print("note: DeepSpeed skipped (pass --deepspeed-python PATH; the docstring shows how to install it "
              "in a scratch venv)")
    from tests.distributed import run_distributed
    world = 2
    table, peaks = [], {}
    for row in _rows(sizes, precisions, args.checkpointed_rows):  # fresh ranks per row: what a row freed never weighs on the next
        print(f"row: {row}", file=sys.stderr, flush=True)
        results = [r[0] for r in run_distributed(_worker, world, [row], variants, args.steps, rounds, args.host_malloc,
                                                       timeout=4 * 3600)]
        row = results[0]
        per_step = {v: [max(r["times"][v][i] for r in results) for i in range(len(row["times"][v]))]
                    for v in variants}
        med = {v: statistics.median(t) for v, t in per_step.items()}
        best_peer = min((med[v], v) for v in variants if v in PEERS)
        util = _mfu(row, world)
        peaks[row["precision"]] = util.peak_note
        name = f"{row['size']}{', checkpointing all' if row['recompute'] else ''}"
        for v in variants:
            r = util.row(med[v])
            table.append({"row": name, "precision": row["precision"], "variant": v, "median_ms": 1e3 * med[v],
                          "x_best_peer": med[v] / best_peer[0], "best_peer": best_peer[1],
                          "x_local": med[v] / med["local"] if "local" in med else None,
                          "mfu_pct": 100 * r["mfu"] if r["mfu"] is not None else None,
                          "first_loss": f"{row['first_loss'][v]:.4f}", "steps_ms": [1e3 * t for t in per_step[v]]})
    print(f"2 gloo ranks x 1 thread, ZeRO-3, AdamW, clip {CLIP}; {rounds} round(s) x {args.steps} steps "
          f"(+1 warm-up), median of the slowest rank's step; host malloc {args.host_malloc} (all variants); "
          f"{cpu_line()}; load average {os.getloadavg()[0]:.1f}")
    print(format_table(table, [("row", "model"), ("precision", "precision"), ("variant", "variant"),
                               ("median_ms", "median ms"), ("x_best_peer", "x best peer"),
                               ("mfu_pct", "MFU %"), ("first_loss", "first loss")]
                       + ([("x_local", "x local")] if args.local else [])))
    for precision, note in peaks.items():
        print(f"MFU ({precision}) = model FLOPs per step / median step / {note}")
    path = write_json(args.json, {"rows": table, "variants": variants, "rounds": rounds, "steps": args.steps,
                                  "deepspeed": args.with_deepspeed, "mfu_peaks": peaks, "host_malloc": args.host_malloc})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
