"""Where a training step's time goes: a torch.profiler trace of one step of mct's Engine
(and of FSDP2, and of DeepSpeed ZeRO-3 when ``deepspeed`` imports) on the transformers
Llama of ``benchmarks/peers.py``, 2 gloo ranks x 1 thread, rank 0's events grouped.

Each variant is built as ``peers.py`` builds it, steps once to warm up, then ``--steps``
steps are recorded (per-step means printed: one step under load is one burst), one variant
after another; with ``--interleave`` all variants are built at once and each round profiles
one step of each in turn, so load from elsewhere hits them alike (the way to compare them on a
shared machine), and rank 0's minor page faults per step are printed too. Rank 0's CPU events
are put in one group each, by the first rule that holds:

  communication  a collective (``c10d::``, ``gloo:``, DeepSpeed's ``comm``/shm ops) and all
                 under it: time the calling thread spends in or blocked on one
  optimizer      under ``Optimizer.step`` (torch's label of every optimizer's step)
  backward       under an autograd engine node (``autograd::engine::evaluate_function``)
  forward        under the loss function (labelled ``phase:forward`` here)
  other          the rest: gradient clipping, norms, bookkeeping between phases

Groups count the main thread's events (the one that runs the forward); what other threads
did (gloo's workers, I/O) is listed apart: it may overlap the main thread's compute.

and, across the groups, ``casts/copies`` is the self time of ``aten::copy_``,
``aten::_to_copy`` and ``aten::clone`` (mixed precision's casts, gathers' and
reduce-scatters' copies). Prints per variant: the step's wall time, each group's self
CPU ms and share, the backward/forward ratio, then the top ops by self CPU time;
writes JSON (and Chrome traces with ``--trace-dir``).

    PYTHONPATH=src:. python benchmarks/profile_step.py [--sizes small] [--precisions bf16,fp32]
        [--recompute] [--top 12] [--trace-dir DIR | --interleave]
    PYTHONPATH=src:. /tmp/ds-venv/bin/python benchmarks/profile_step.py ...   # with DeepSpeed
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks` and `tests` importable
from benchmarks.common import cpu_line, format_table, write_json  # noqa: E402
from benchmarks.peers import SIZES, VARIANTS, native_bf16  # noqa: E402
from mct.task.tokens import causal_lm_loss  # noqa: E402

GROUPS = ("forward", "backward", "communication", "optimizer", "other")
COMM = ("c10d::", "gloo:", "record_param_comms", "deepspeed", "shm")
CASTS = ("aten::copy_", "aten::_to_copy", "aten::clone")
FORWARD = "phase:forward"


def labelled_loss(model, batch):
    """The cross-entropy under a profiler label, so the forward can be told apart."""
    with torch.profiler.record_function(FORWARD):
        return causal_lm_loss(model, batch)


def group_of(event) -> str:
    """The group of a profiler event, from its own name and its ancestors' (module doc)."""
    chain = []
    e = event
    while e is not None:
        chain.append(e.name)
        e = e.cpu_parent
    if any(n.startswith(COMM) or "all_gather" in n or "reduce_scatter" in n or "all_reduce" in n for n in chain):
        return "communication"
    if any(n.startswith("Optimizer.step") for n in chain):
        return "optimizer"
    if any(n.startswith("autograd::engine::evaluate_function") for n in chain):
        return "backward"
    if any(n == FORWARD for n in chain):
        return "forward"
    return "other"


def summarize(prof, wall_s: float, top: int, steps: int) -> dict[str, Any]:
    """Self CPU ms per step by group (casts/copies apart), the top ops, of rank 0's profile
    of ``steps`` steps that took ``wall_s`` seconds."""
    groups = dict.fromkeys(GROUPS, 0.0)
    casts = dict.fromkeys(GROUPS, 0.0)
    off_main = dict.fromkeys(GROUPS, 0.0)  # on other threads (gloo's, I/O): may overlap the main thread
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    main = next((e.thread for e in events if e.name == FORWARD), None)
    for e in events:
        g = group_of(e)
        ms = e.self_cpu_time_total / 1e3 / steps
        if e.thread != main:
            off_main[g] += ms
            continue
        groups[g] += ms
        if e.name in CASTS:
            casts[g] += ms
    ops = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:top]
    return {"wall_ms": 1e3 * wall_s / steps, "groups_ms": groups, "casts_ms": casts, "other_threads_ms": off_main,
            "top_ops": [{"op": a.key, "self_ms": a.self_cpu_time_total / 1e3 / steps, "calls": a.count // steps}
                        for a in ops]}


def _interleaved(rank: int, row: dict[str, Any], variants: list[str], top: int, steps: int) -> list[dict[str, Any]]:
    """Every variant built at once, warmed up, then ``steps`` rounds of one profiled step of
    each in turn: a burst of load from elsewhere lands on all of them alike. Rank 0's
    per-step summaries are averaged; ``minor_faults`` per step (fresh pages) is rank 0's."""
    import resource

    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile
    fns = {v: VARIANTS[v](row["size"], row["precision"], row["recompute"], rank, loss_fn=labelled_loss)
           for v in variants}
    for fn in fns.values():
        fn(0)
    per: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for i in range(steps):
        for v, fn in fns.items():
            dist.barrier()
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                fn(1 + i)
                wall = time.perf_counter() - t0
            if rank == 0:
                per[v].append({**summarize(prof, wall, top, 1),
                               "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults})
    return [{**row, "variant": v, **_mean_summary(s)} for v, s in per.items()] if rank == 0 else []


def _mean_summary(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """The mean of per-step ``summarize`` results (top ops: by mean self time over the steps)."""
    n = len(summaries)
    mean = lambda key: {g: sum(s[key][g] for s in summaries) / n for g in GROUPS}  # noqa: E731
    ops: dict[str, list[float]] = {}
    for s in summaries:
        for op in s["top_ops"]:
            ops.setdefault(op["op"], [0.0, op["calls"]])[0] += op["self_ms"] / n
    top = sorted(ops.items(), key=lambda kv: -kv[1][0])[:len(summaries[0]["top_ops"])]
    return {"wall_ms": sum(s["wall_ms"] for s in summaries) / n, "groups_ms": mean("groups_ms"),
            "casts_ms": mean("casts_ms"), "other_threads_ms": mean("other_threads_ms"),
            "minor_faults": sum(s["minor_faults"] for s in summaries) / n,
            "top_ops": [{"op": k, "self_ms": ms, "calls": calls} for k, (ms, calls) in top]}


def _worker(rank: int, world: int, rows: list[dict[str, Any]], variants: list[str], top: int,
            trace_dir: str | None, steps: int, interleave: bool = False) -> list[dict[str, Any]]:
    import gc
    import warnings

    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile
    warnings.filterwarnings("ignore", category=FutureWarning)
    if "deepspeed" in variants:
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    out = []
    for row in rows:
        if interleave:
            out += _interleaved(rank, row, variants, top, steps)
            gc.collect()
            continue
        for v in variants:
            step = VARIANTS[v](row["size"], row["precision"], row["recompute"], rank, loss_fn=labelled_loss)
            step(0)  # warm-up: the optimizer state exists, caches are filled
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                for i in range(steps):
                    step(1 + i)
                wall = time.perf_counter() - t0
            if rank == 0:
                out.append({**row, "variant": v, **summarize(prof, wall, top, steps)})
                if trace_dir:
                    name = f"{row['size']}_{row['precision']}{'_ckpt' if row['recompute'] else ''}_{v}.json"
                    prof.export_chrome_trace(str(Path(trace_dir) / name))
            del step, prof
            gc.collect()
            dist.barrier()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="small")
    ap.add_argument("--precisions", default="bf16,fp32")
    ap.add_argument("--recompute", action="store_true", help="checkpointing: every decoder layer recomputed")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--steps", type=int, default=3, help="profiled steps per variant (per-step means printed)")
    ap.add_argument("--trace-dir", default=None, help="also write Chrome traces here (not with --interleave)")
    ap.add_argument("--interleave", action="store_true",
                    help="all variants alive at once, one profiled step of each per round (a shared machine's "
                         "load hits them alike; memory: every variant's at once)")
    ap.add_argument("--json", default="profile_step", help="result name or path (.json)")
    args = ap.parse_args()
    sizes, precisions = args.sizes.split(","), args.precisions.split(",")
    if any(s not in SIZES for s in sizes) or any(p not in ("bf16", "fp32") for p in precisions):
        ap.error(f"--sizes {args.sizes!r} / --precisions {args.precisions!r}: choose from "
                 f"{','.join(SIZES)} / bf16,fp32")
    if "bf16" in precisions and not native_bf16():
        print("note: bf16 left out: this CPU has no native bf16 (avx512_bf16 or amx_bf16)")
        precisions = [p for p in precisions if p != "bf16"]
    variants = ["mct", "fsdp2"] + (["deepspeed"] if importlib.util.find_spec("deepspeed") else [])
    if "deepspeed" not in variants:
        print("note: DeepSpeed skipped (not importable here; see benchmarks/peers.py for a scratch venv)")
    if args.trace_dir:
        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
    from tests.distributed import run_distributed
    rows = [{"size": s, "precision": p, "recompute": args.recompute} for s in sizes for p in precisions]
    if args.interleave and args.trace_dir:
        ap.error("--trace-dir writes one trace per variant of consecutive steps: leave out --interleave")
    results = run_distributed(_worker, 2, rows, variants, args.top, args.trace_dir, args.steps, args.interleave,
                              timeout=4 * 3600)[0]
    print(f"rank 0 of 2 gloo ranks x 1 thread, {args.steps} profiled steps after one warm-up, per-step means"
          f"{', variants interleaved step by step' if args.interleave else ''}; "
          f"{cpu_line()}")
    for r in results:
        g, c, o = r["groups_ms"], r["casts_ms"], r["other_threads_ms"]
        total = sum(g.values())
        print(f"\n{r['size']} {r['precision']}{' checkpointing all' if r['recompute'] else ''} {r['variant']}: "
              f"step {r['wall_ms']:,.0f} ms wall, {total:,.0f} ms self CPU on rank 0's events; "
              f"backward / forward = {g['backward'] / max(g['forward'], 1e-9):.2f}"
              + (f"; {r['minor_faults']:,.0f} minor page faults per step" if "minor_faults" in r else ""))
        print(format_table([{"group": k, "ms": g[k], "pct": 100 * g[k] / total, "casts": c[k], "off": o[k]}
                            for k in GROUPS],
                           [("group", "group"), ("ms", "self CPU ms"), ("pct", "%"), ("casts", "of which casts/copies"),
                            ("off", "other threads ms")]))
        print(format_table(r["top_ops"], [("op", "top op"), ("self_ms", "self CPU ms"), ("calls", "calls")]))
    path = write_json(args.json, {"rows": results, "variants": variants})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
