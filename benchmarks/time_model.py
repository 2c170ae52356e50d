"""Time model accuracy: the planner's predicted seconds per step (``mct.planner.steptime``)
against real steps of the same configurations, on models it was not tuned for: a
Hugging Face Llama, a Hugging Face GPT-2 with dropout, the built-in GPT at odd sizes;
ZeRO stages 0-3, checkpointing none/selective/all and a per_block mix, 1 and 2 gloo
ranks, fp32 and bf16 (on a CPU without native bf16 its matmuls run on fp32 kernels, as
``precision.cpu_matmul = "auto"`` runs them). Beside each time, the dry run's
predicted peak against the engine tracker's measured one.

    PYTHONPATH=src:. python benchmarks/time_model.py [--worlds 1 2] [--models ...] [--steps 8]
                                                    [--threads N] [--grad-accum 1] [--calibrate]

Real: ``--warmup`` (2, at least 2) steps that track memory (the measured peak: the
steady one, of the warm-up steps after the first), then ``--steps`` (8) timed
``Engine.train_step`` calls without the tracker, as `mct train` runs all but its logged steps
(median; the fastest beside it: a busy machine only slows steps down), a model's
configurations stepping round-robin so that load from elsewhere hits them alike (as the
calibration's engines do); 2 ranks are spawned gloo processes (tests/distributed.py),
every configuration in one pair. Each rank runs ``--threads`` torch threads (default: the usable cores shared
out, as ``mct train --nproc`` does). Prints the table with the CPU, its flags and the load,
the median and worst |error|; writes benchmarks/results/time_model.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "src")]

import torch  # noqa: E402

from benchmarks.common import cpu_line, format_table, write_json  # noqa: E402
from mct.config import EngineConfig  # noqa: E402
from mct.machine import calibrate, usable_cores  # noqa: E402
from mct.planner import token_loss  # noqa: E402
from mct.planner.grid import prepare_work  # noqa: E402
from mct.planner.plan import predict  # noqa: E402
from mct.planner.overhead import machine_rates  # noqa: E402
from mct.planner.steptime import step_time  # noqa: E402
from mct.task.spec import Task  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

B = 4
VOCAB = 1000
PER_BLOCK = {"all": 2, "selective": 1}
"""The mixed stack: the first two blocks recomputed whole, the next selectively, the rest none."""
CHOICES = ((0, "none"), (1, "selective"), (2, "all"), (3, "per_block"), (3, "none"), (0, "all"))
"""(stage, policy) per model, precision and world: every stage and policy, not every pair."""


def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging
    logging.set_verbosity_error()
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, hidden_size=96, num_attention_heads=6,
                                        num_key_value_heads=2, intermediate_size=260, vocab_size=VOCAB,
                                        max_position_embeddings=128, use_cache=False, attn_implementation="sdpa",
                                        tie_word_embeddings=False))


def hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging
    logging.set_verbosity_error()
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=96, n_embd=84, n_layer=4, n_head=3,
                                      resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0,
                                      eos_token_id=0, use_cache=False, attn_implementation="sdpa"))


GPT_ODD = {"n_layer": 5, "n_head": 3, "d_model": 78, "seq_len": 80, "vocab_size": 997, "dropout": 0.1}


def gpt_odd():
    from mct.models.gpt import GPT
    return GPT(EngineConfig.from_dict({"model": dict(GPT_ODD)}).model)


MODELS = {"hf_llama": (hf_llama, 128, VOCAB), "hf_gpt2": (hf_gpt2, 96, VOCAB),
          "gpt_odd": (gpt_odd, GPT_ODD["seq_len"], GPT_ODD["vocab_size"])}


def loss_of(name: str):
    if name == "gpt_odd":
        from mct.models.gpt import gpt_loss
        return gpt_loss
    return token_loss


def batch(name: str, step: int, rank: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    _, T, V = MODELS[name]
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def step_batch(name: str, step: int, rank: int, accum: int) -> Any:
    """One step's batch: a micro-batch, or a list of ``accum`` (gradient accumulation)."""
    return batch(name, step, rank) if accum == 1 else [batch(name, step, rank, m) for m in range(accum)]


def config(model: str, stage: int, policy: str, precision: str, accum: int = 1) -> EngineConfig:
    ck = {"policy": policy, "per_block": PER_BLOCK if policy == "per_block" else []}
    return EngineConfig.from_dict({"model": dict(GPT_ODD) if model == "gpt_odd" else {},
                                   "zero": {"stage": stage}, "checkpointing": ck, "data": {"grad_accum": accum},
                                   "precision": {"mode": precision}, "train": {"grad_clip": 1.0}})


def grid(models: list[str], precisions: list[str]) -> list[tuple[str, int, str, str]]:
    return [(m, s, p, q) for m in models for q in precisions for s, p in CHOICES]


def measure_all(rank: int, world: int, configs: list, warmup: int, steps: int, threads: int,
                accum: int = 1) -> list[dict]:
    """Real steps of every configuration on this rank: median seconds (memory not tracked)
    and the tracker's peak (of the warm-up steps after the first).
    A model's configurations step round-robin (one step of each in turn, ``warmup`` rounds
    untimed, then ``steps`` timed), so a burst of load from elsewhere slows all of them a
    little rather than one of them a lot."""
    from mct.engine import Engine
    torch.set_num_threads(threads)
    out: dict[int, dict] = {}
    for model in dict.fromkeys(m for m, _, _, _ in configs):
        mine = [(i, c) for i, c in enumerate(configs) if c[0] == model]
        engines = []
        for _, (m, s, p, q) in mine:
            torch.manual_seed(0)
            engines.append(Engine(MODELS[m][0](), None, config(m, s, p, q, accum)))
        times: list[list[float]] = [[] for _ in mine]
        comms: list[list[float]] = [[] for _ in mine]
        peaks = [0] * len(mine)
        for step in range(warmup + steps):
            for k, engine in enumerate(engines):
                t0 = time.perf_counter()
                # the warm-up steps track memory (the peak: every step after the first is the
                # steady one), the timed ones do not, as most of mct train's steps
                res = engine.train_step(step_batch(model, step, rank, accum), loss_of(model),
                                        track_memory=step < warmup)
                if step >= warmup:
                    times[k].append(time.perf_counter() - t0)
                    comms[k].append(float(res.metrics.get("time_comm_s", 0.0)))
                elif step > 0:
                    peaks[k] = max(peaks[k], res.metrics["peak_bytes"])
        for engine in engines:
            engine.close()
        for k, (i, _) in enumerate(mine):
            out[i] = {"step_s": statistics.median(times[k]), "best_s": min(times[k]), "times": times[k],
                      "comm_s": statistics.median(comms[k]), "peak": peaks[k]}
    return [out[i] for i in range(len(configs))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"],
                    help="bf16 on a CPU without native bf16 runs its matmuls on fp32 kernels (precision.cpu_matmul)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores / ranks)")
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (data.grad_accum)")
    ap.add_argument("--calibrate", action="store_true", help="measure the machine profile again first")
    ap.add_argument("--json", default="time_model")
    args = ap.parse_args()
    if args.grad_accum < 1:
        ap.error(f"--grad-accum {args.grad_accum}: at least 1")
    if args.warmup < 2:
        ap.error(f"--warmup {args.warmup}: at least 2 (the peak is measured on the warm-up steps after the first)")
    precisions = args.precisions
    if args.calibrate:
        calibrate(force=True)
    configs = grid(args.models, precisions)
    started, rows = time.perf_counter(), []
    for world in args.worlds:
        threads = args.threads or max(1, usable_cores() // world)
        rates, notes = machine_rates(world, threads=threads)
        for note in notes + list(rates.notes if rates else []):
            print(f"note: {note}", file=sys.stderr)
        t0 = time.perf_counter()
        real = (measure_all(0, 1, configs, args.warmup, args.steps, threads, args.grad_accum) if world == 1 else
                run_distributed(measure_all, world, configs, args.warmup, args.steps, threads, args.grad_accum,
                                timeout=3600)[0])
        real_s = time.perf_counter() - t0
        for (m, s, p, q), got in zip(configs, real):
            cfg = config(m, s, p, q, args.grad_accum)
            task = Task(MODELS[m][0], loss_of(m), batch(m, 0, 0))
            t1 = time.process_time()
            run = predict(prepare_work(task, cfg), cfg, world)
            assert run.work is not None and rates is not None
            pred = step_time(run.work, rates)
            rows.append({"model": m, "stage": s, "policy": p, "precision": q, "ranks": world, "threads": threads,
                         "grad_accum": args.grad_accum,
                         "predicted_s": pred.total, **pred.to_dict(), "measured_s": got["step_s"],
                         "best_s": got["best_s"], "times": got["times"], "measured_comm_s": got["comm_s"],
                         "error_pct": 100 * (pred.total / got["step_s"] - 1),
                         "best_error_pct": 100 * (pred.total / got["best_s"] - 1),
                         "predicted_peak": run.peak, "measured_peak": got["peak"],
                         "peak_error_pct": 100 * (run.peak / got["peak"] - 1) if got["peak"] else None,
                         "ops": run.work.n_ops, "dry_run_cpu_s": time.process_time() - t1})
        print(f"{world} rank(s): {len(configs)} configurations measured in {real_s:.0f} s", file=sys.stderr)
    table = [{**r, "pred": f"{r['predicted_s']:.4f}", "meas": f"{r['measured_s']:.4f}",
              "err": f"{r['error_pct']:+.1f}", "best": f"{r['best_s']:.4f}", "best_err": f"{r['best_error_pct']:+.1f}",
              "comp": f"{r['compute_s']:.4f}", "over": f"{r['overhead_s']:.4f}",
              "comm": f"{r['comm_s']:.4f}", "mcomm": f"{r['measured_comm_s']:.4f}",
              "peak_err": "-" if r["peak_error_pct"] is None else f"{r['peak_error_pct']:+.2f}"} for r in rows]
    print(f"CPU: {cpu_line()}; load average {tuple(round(x, 2) for x in __import__('os').getloadavg())}")
    print(f"profile: {calibrate().profile.measured_at}")
    print(format_table(table, [("model", "model"), ("stage", "stage"), ("policy", "policy"),
                               ("precision", "prec"), ("ranks", "ranks"), ("threads", "thr"),
                               ("pred", "predicted s"), ("meas", "measured s"), ("err", "error %"),
                               ("best", "fastest s"), ("best_err", "vs fastest %"),
                               ("comp", "compute s"), ("over", "overhead s"), ("comm", "comm s"),
                               ("mcomm", "comm waited s"), ("peak_err", "peak error %")]))
    errors = [abs(r["error_pct"]) for r in rows]
    best = [abs(r["best_error_pct"]) for r in rows]
    peaks = [abs(r["peak_error_pct"]) for r in rows if r["peak_error_pct"] is not None]
    summary = {"configurations": len(rows), "median_abs_error_pct": statistics.median(errors),
               "worst_abs_error_pct": max(errors), "median_abs_error_vs_fastest_pct": statistics.median(best),
               "worst_abs_error_vs_fastest_pct": max(best), "median_abs_peak_error_pct": statistics.median(peaks),
               "worst_abs_peak_error_pct": max(peaks), "seconds": time.perf_counter() - started}
    for world in args.worlds:
        e = [abs(r["error_pct"]) for r in rows if r["ranks"] == world]
        f = [abs(r["best_error_pct"]) for r in rows if r["ranks"] == world]
        print(f"{world} rank(s): median |error| {statistics.median(e):.1f}%, worst {max(e):.1f}% "
              f"(against the fastest step: {statistics.median(f):.1f}%, {max(f):.1f}%; {len(e)} configurations)")
    print(f"all: median |error| {summary['median_abs_error_pct']:.1f}%, worst {summary['worst_abs_error_pct']:.1f}% "
          f"(against the fastest step: {summary['median_abs_error_vs_fastest_pct']:.1f}%, "
          f"{summary['worst_abs_error_vs_fastest_pct']:.1f}%); peak: median |error| "
          f"{summary['median_abs_peak_error_pct']:.2f}%, worst {summary['worst_abs_peak_error_pct']:.2f}% "
          f"({len(rows)} configurations, {summary['seconds']:.0f} s)")
    print(f"wrote {write_json(args.json, {'rows': rows, 'summary': summary})}")


if __name__ == "__main__":
    main()
