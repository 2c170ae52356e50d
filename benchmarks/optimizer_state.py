"""Optimizer state benchmark: AdamW step time per parameter for fp32 / bf16 / int8 moments.

One flat fp32 master of N elements (as a ZeRO shard is) with a fresh gradient each step;
variants are stepped round-robin (``common.interleave``) on one thread:
  fp32-fused    torch.optim.AdamW(fused=True): what `mct train` runs for fp32 state
  fp32-foreach  torch.optim.AdamW(foreach=True): torch's default multi-tensor path
  bf16, int8    mct.optim.LowPrecisionAdamW: its fused C kernel (``lowbit/native.py``)
  bf16-torch, int8-torch   the same optimizer with native=False: the torch reference
                (64K-element chunks of eager ops) that gives the same bytes
beside a one-core memcpy of the same fp32 buffer (the floor: the step must read and
write the master at least once). Prints ns/param, the ratio to fp32-fused and to the
memcpy, the first step's seconds, bytes of state per param, the CPU's flags, and the
kernel's warm-up: its compile into an empty cache (what a machine pays once) and its
load from the cache (what every later process pays); writes
``benchmarks/results/optimizer_state.json``.

    PYTHONPATH=src:. python benchmarks/optimizer_state.py [--numel 4000000] [--steps 10] [--threads 1]
        [--torchao]   also time torchao's AdamW8bit where it is installed (its first step compiles)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import cpu_info, cpu_line, format_table, interleave, summarize, write_json
from mct.optim.lowbit import LowPrecisionAdamW, native


def _variant(make, n: int) -> tuple:
    p = torch.zeros(n, requires_grad=True)
    grads = [torch.randn(n) for _ in range(2)]
    opt = make([p])

    def step(i: int) -> None:
        p.grad = grads[i % 2]
        opt.step()
    return step, opt, p


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def _makers(args: argparse.Namespace) -> dict:
    kw = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
    makers = {"fp32-fused": lambda ps: torch.optim.AdamW(ps, fused=True, **kw),
              "fp32-foreach": lambda ps: torch.optim.AdamW(ps, foreach=True, **kw),
              "bf16": lambda ps: LowPrecisionAdamW(ps, state_dtype="bf16", **kw),
              "int8": lambda ps: LowPrecisionAdamW(ps, state_dtype="int8", **kw),
              "bf16-torch": lambda ps: LowPrecisionAdamW(ps, state_dtype="bf16", native=False, **kw),
              "int8-torch": lambda ps: LowPrecisionAdamW(ps, state_dtype="int8", native=False, **kw)}
    if args.torchao:
        try:
            from torchao.optim import AdamW8bit
            makers["torchao-AdamW8bit"] = lambda ps: AdamW8bit(ps, **kw)
        except ImportError:
            print("torchao is not installed: its AdamW8bit is not measured")
    return makers


def _warmup() -> dict:
    """The fused kernel's one-off costs: a compile into an empty cache, a load from it."""
    with tempfile.TemporaryDirectory() as tmp:
        cold = native.load(Path(tmp))
        warm = native.load(Path(tmp))
    return {"compiler": native.compiler(), "native": cold is not None,
            "compile_s": cold.build_s if cold else None, "load_s": warm.build_s if warm else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=4_000_000)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--torchao", action="store_true")
    ap.add_argument("--out", default="optimizer_state")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernel = _warmup()
    n = args.numel // 256 * 256
    src, dst = torch.randn(n), torch.empty(n)
    steps, opts, warm = {"memcpy": lambda i: dst.copy_(src)}, {}, {}
    for name, make in _makers(args).items():
        step, opts[name], _ = _variant(make, n)
        t0 = time.perf_counter()
        step(0)  # first step: state allocation (and torchao's compile)
        warm[name] = time.perf_counter() - t0
        steps[name] = step
    times = {k: summarize(v)["median"] for k, v in interleave(steps, args.steps, warmup=1).items()}
    rows = [{"variant": k, "ns_per_param": t / n * 1e9, "vs_fused": t / times["fp32-fused"],
             "vs_memcpy": t / times["memcpy"], "first_step_s": warm.get(k),
             "state_bytes_per_param": _state_bytes(opts[k]) / n if k in opts else None}
            for k, t in times.items()]
    print(f"AdamW step on {n:,} fp32 elements, {args.threads} thread(s); CPU: {cpu_line()}")
    if kernel["native"]:
        print(f"fused kernel ({kernel['compiler']}): compile {kernel['compile_s']:.2f} s once per machine, "
              f"load {kernel['load_s'] * 1e3:.0f} ms per process")
    else:
        print("fused kernel: no C compiler or the build failed; bf16 / int8 ran the torch reference")
    print(format_table(rows, [("variant", "variant"), ("ns_per_param", "ns/param"), ("vs_fused", "x fp32-fused"),
                              ("vs_memcpy", "x memcpy"), ("first_step_s", "first step s"),
                              ("state_bytes_per_param", "state B/param")]))
    path = write_json(args.out, {"numel": n, "threads": args.threads, "rows": rows, "cpu": cpu_info(),
                                 "kernel": kernel})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
