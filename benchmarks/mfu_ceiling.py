"""How far MFU can go on this CPU for the transformers Llamas of ``benchmarks/peers.py``: the
step's own matmuls and attention kernels, each replayed alone at its shapes, strides and
dtype, against the machine's matmul peak (a hot 2048^2 ``torch.mm``, ``mct.machine``).

One process, one torch thread (a rank of peers.py's runs), the model cast to the row's
dtype (bf16 rows: every matmul in bf16, as mct's bf16 working parameters; the loss in fp32),
one forward and backward of peers.py's micro-batch. Every matmul-like op (``mm``, ``addmm``,
``bmm``, the fused attention forward and backward) is recorded with its inputs' layout and
timed twice: inside the step (a dispatch mode around each call) and alone, replayed on
random tensors of the same shapes, strides and dtype (the fastest of ``--reps``). Printed
per row:

  matmul GFLOP     the FLOPs of those ops (``torch.utils.flop_counter``'s formulas)
  alone ms         their replayed time; ``% of peak`` = their FLOPs over it, over the peak
  in step ms       their time inside the step (caches, page faults, the step's order)
  rest ms          the step's time outside them (elementwise, norms, softmax, loss, copies)
  ceiling MFU      model FLOPs per step (mct's count) / (alone ms) / peak: MFU of a step
                   that ran nothing but its matmuls and attention, each at its replayed rate

A ceiling under a target says the target is out of reach at these shapes on this CPU,
whatever the framework does around the kernels.

    PYTHONPATH=src:. python benchmarks/mfu_ceiling.py [--sizes small,medium] [--precisions bf16,fp32] [--reps 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks` importable
from benchmarks.common import cpu_line, format_table, write_json  # noqa: E402
from benchmarks.peers import SIZES, batch, llama, native_bf16  # noqa: E402
from mct.task.tokens import causal_lm_loss  # noqa: E402

aten = torch.ops.aten
KERNELS = {aten.mm.default, aten.addmm.default, aten.bmm.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default,
           aten._scaled_dot_product_flash_attention_for_cpu_backward.default}
"""The ops that do a step's matmul FLOPs on a CPU (transformers' Llama: linear layers as
mm/addmm, attention through SDPA's fused CPU kernel)."""


class Recorder(TorchDispatchMode):
    """Times every call of ``KERNELS`` inside the step and keeps its arguments' layout."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in KERNELS:
            return func(*args, **kwargs)
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        dt = time.perf_counter() - t0
        layout = [(tuple(a.shape), tuple(a.stride()), a.dtype) if isinstance(a, torch.Tensor) else a for a in args]
        self.calls.append({"func": func, "layout": layout, "kwargs": kwargs, "in_step_s": dt})
        return out


def _replay_args(layout: list[Any]) -> list[Any]:
    out = []
    for a in layout:
        if isinstance(a, tuple) and len(a) == 3 and isinstance(a[2], torch.dtype):
            shape, stride, dtype = a
            t = torch.empty_strided(shape, stride, dtype=dtype)
            t.copy_(torch.randn(shape).to(dtype) * 0.1) if t.is_floating_point() else t.zero_()
            out.append(t)
        else:
            out.append(a)
    return out


def _alone(call: dict[str, Any], reps: int) -> tuple[float, float]:
    """(fastest seconds of ``reps`` calls after one warm-up, FLOPs) of a recorded call."""
    args = _replay_args(call["layout"])
    call["func"](*args, **call["kwargs"])
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        call["func"](*args, **call["kwargs"])
        best = min(best, time.perf_counter() - t0)
    with FlopCounterMode(display=False) as fc:
        call["func"](*args, **call["kwargs"])
    return best, fc.get_total_flops()


def measure(size: str, precision: str, reps: int) -> dict[str, Any]:
    from mct.machine import calibrate
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = llama(size).to(dtype)
    x = batch(size, 0, 0)
    causal_lm_loss(model, x).backward()  # warm-up: the kernels' first-call costs
    model.zero_grad(set_to_none=True)
    rec = Recorder()
    t0 = time.perf_counter()
    with rec:
        causal_lm_loss(model, x).backward()
    step_s = time.perf_counter() - t0
    alone = [_alone(c, reps) for c in rec.calls]
    alone_s, flops = sum(a for a, _ in alone), sum(f for _, f in alone)
    in_step_s = sum(c["in_step_s"] for c in rec.calls)
    peak = calibrate("cpu").profile.matmul_one.get(precision)
    from benchmarks.common import step_utilization
    util = step_utilization(lambda: llama(size), causal_lm_loss, x, {"precision": {"mode": precision}},
                            ranks=1, threads=1)
    model_flops = util.flops.model
    return {"size": size, "precision": precision, "calls": len(rec.calls), "matmul_gflop": flops / 1e9,
            "model_gflop": model_flops / 1e9, "alone_ms": 1e3 * alone_s,
            "alone_pct_peak": 100 * flops / alone_s / peak if peak else None,
            "in_step_ms": 1e3 * in_step_s, "step_ms": 1e3 * step_s, "rest_ms": 1e3 * (step_s - in_step_s),
            "ceiling_mfu_pct": 100 * model_flops / alone_s / peak if peak else None,
            "step_mfu_pct": 100 * model_flops / step_s / peak if peak else None,
            "peak_gflop_s": peak / 1e9 if peak else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="small,medium")
    ap.add_argument("--precisions", default="bf16,fp32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="mfu_ceiling", help="result name or path (.json)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    sizes, precisions = args.sizes.split(","), args.precisions.split(",")
    bad = [s for s in sizes if s not in SIZES] + [p for p in precisions if p not in ("bf16", "fp32")]
    if bad:
        ap.error(f"{bad[0]!r}: sizes are {','.join(SIZES)}, precisions bf16,fp32")
    if "bf16" in precisions and not native_bf16():
        print("note: bf16 rows left out: this CPU has no native bf16 (avx512_bf16 or amx_bf16)")
        precisions = [p for p in precisions if p != "bf16"]
    rows = [measure(s, p, args.reps) for s in sizes for p in precisions]
    print(f"one process x 1 thread, one forward+backward of peers.py's micro-batch; {cpu_line()}")
    print(format_table(rows, [("size", "model"), ("precision", "precision"), ("calls", "kernels"),
                              ("matmul_gflop", "matmul GFLOP"), ("alone_ms", "alone ms"),
                              ("alone_pct_peak", "% of peak"), ("in_step_ms", "in step ms"),
                              ("rest_ms", "rest ms"), ("step_ms", "step ms"), ("step_mfu_pct", "step MFU %"),
                              ("ceiling_mfu_pct", "ceiling MFU %"), ("peak_gflop_s", "peak GFLOP/s")]))
    path = write_json(args.json, {"rows": rows, "reps": args.reps})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
