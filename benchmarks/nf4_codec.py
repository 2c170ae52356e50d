"""NF4 codec benchmark: mct's own codec beside torchao's and bitsandbytes' NF4, on the CPU.

For one 4096 x 4096 weight (bf16 values, the shape of a Llama 8B attention projection):
  decode_ms     dequantize to bf16 (what a frozen unit pays per gather, forward and backward)
  decode32_ms   dequantize to fp32 (an fp32 run)
  encode_ms     quantize (once per run, at load)
  bytes/param   stored bytes per parameter, scales included
  rel_err       ||decode(encode(w)) - w|| / ||w||
  sliceable     encode(w) == concat(encode(w[:k]), encode(w[k:])) for an aligned k: the same
                bytes at any world size (what ZeRO shards of a frozen unit need)
  import_mib    resident memory the import adds after ``import torch`` (a fresh interpreter)
beside ``memcpy_ms``, a copy of the same bf16 tensor (the floor: a decode writes it once).
Variants are timed round-robin (``common.interleave``) in one process. A library that does
not import is skipped with its reason; ``--bnb-path DIR`` adds a private bitsandbytes install
to ``sys.path`` (it is not a dependency of mct). Writes ``benchmarks/results/nf4_codec.json``.

    PYTHONPATH=src:. python benchmarks/nf4_codec.py [--rows 4096] [--cols 4096] [--steps 10]
        [--threads N] [--bnb-path DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Any, Callable

import torch

from benchmarks.common import cpu_info, cpu_line, format_table, interleave, summarize, write_json
from mct.quant.nf4 import NF4_ALIGN, NF4Codec

Variant = dict[str, Any]


def import_mib(module: str, extra_path: str | None) -> float | None:
    """MiB of peak resident memory ``import module`` adds after ``import torch``, in a fresh
    interpreter (None when it fails to import)."""
    # VmHWM, not ru_maxrss: the latter carries over a fork from this (large) process through exec
    hwm = "int([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])"
    code = f"import torch\nr = {hwm}\nimport {module}\nprint(({hwm} - r) / 1024)"
    env = dict(os.environ)
    if extra_path:
        env["PYTHONPATH"] = extra_path + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    return float(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else None


def _two_halves(w: torch.Tensor) -> torch.Tensor:
    """``w`` with its second half of rows doubled: the slice check on halves that differ (on
    i.i.d. halves a per-tensor mean rounds to the same bf16 value by luck)."""
    half = w.shape[0] // 2
    return torch.cat([w[:half], w[half:] * 2])


def _mct(w: torch.Tensor) -> Variant:
    codec, flat = NF4Codec(), w.reshape(-1)
    parts = codec.encode(flat)
    out16, out32 = torch.empty_like(flat), torch.empty(flat.numel())
    k, w2 = flat.numel() // 2 // NF4_ALIGN * NF4_ALIGN, _two_halves(w).reshape(-1)
    whole, a, b = codec.encode(w2), codec.encode(w2[:k]), codec.encode(w2[k:])
    return {"name": "mct", "encode": lambda: codec.encode(flat),
            "decode": lambda: codec.decode_into(parts, out16), "decode32": lambda: codec.decode_into(parts, out32),
            "bytes": sum(t.numel() * t.element_size() for t in parts.values()),
            "back": codec.decode(parts, flat.numel(), torch.float32),
            "sliceable": all(torch.equal(whole[n], torch.cat([a[n], b[n]])) for n in parts),
            "module": "mct.quant.nf4"}


def _torchao(w: torch.Tensor) -> Variant:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    t = to_nf4(w)
    t32 = to_nf4(w.float())
    half = w.shape[0] // 2
    t2 = to_nf4(_two_halves(w))
    a, b = to_nf4(_two_halves(w)[:half]), to_nf4(_two_halves(w)[half:])
    inner = ("quantized_data", "quantized_scalers", "quantization_factor")
    same = all(torch.equal(getattr(t2, n), torch.cat([getattr(a, n), getattr(b, n)])) for n in inner)
    same = same and torch.equal(t2.scaler_mean, a.scaler_mean) and torch.equal(t2.scaler_mean, b.scaler_mean)
    stored = sum(getattr(t, n).numel() * getattr(t, n).element_size() for n in (*inner, "scaler_mean"))
    return {"name": "torchao", "encode": lambda: to_nf4(w), "decode": t.get_original_weight,
            "decode32": t32.get_original_weight, "bytes": stored, "back": t.get_original_weight().float(),
            "sliceable": same, "module": "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"}


def _bnb(w: torch.Tensor) -> Variant:
    import bitsandbytes.functional as F

    def enc(x: torch.Tensor):
        return F.quantize_4bit(x, blocksize=64, compress_statistics=True, quant_type="nf4")
    q, st = enc(w)
    q32, st32 = enc(w.float())
    half, w2 = w.shape[0] // 2, _two_halves(w)
    (q2, s2), (qa, sa), (qb, sb) = enc(w2), enc(w2[:half]), enc(w2[half:])
    same = torch.equal(q2.view(-1), torch.cat([qa.view(-1), qb.view(-1)])) and \
        torch.equal(s2.absmax, torch.cat([sa.absmax, sb.absmax])) and torch.equal(s2.offset, sa.offset)
    stored = (q.numel() * q.element_size() + st.absmax.numel() * st.absmax.element_size()
              + st.state2.absmax.numel() * 4 + st.state2.code.numel() * 4 + 4)
    return {"name": "bitsandbytes", "encode": lambda: enc(w), "decode": lambda: F.dequantize_4bit(q, st),
            "decode32": lambda: F.dequantize_4bit(q32, st32), "bytes": stored,
            "back": F.dequantize_4bit(q, st).float(), "sliceable": same, "module": "bitsandbytes"}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--bnb-path", default=None, help="a private bitsandbytes install to add to sys.path")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.bnb_path:
        sys.path.insert(0, args.bnb_path)
    torch.manual_seed(0)
    w = (torch.randn(args.rows, args.cols) * 0.02).bfloat16()
    n = w.numel()
    variants, skipped = [], {}
    makers: dict[str, Callable[[torch.Tensor], Variant]] = {"mct": _mct, "torchao": _torchao, "bitsandbytes": _bnb}
    for name, make in makers.items():
        try:
            variants.append(make(w))
        except Exception as e:  # a library missing or failing: reported, not fatal
            skipped[name] = f"{type(e).__name__}: {e}"[:200]
    floor = torch.empty_like(w)
    steps: dict[str, Callable[[int], None]] = {"memcpy": lambda i: floor.copy_(w)}
    for v in variants:
        for op in ("decode", "decode32", "encode"):
            steps[f"{v['name']}/{op}"] = (lambda f: lambda i: f())(v[op])
    times = interleave(steps, args.steps)
    med = {k: summarize(t)["median"] * 1e3 for k, t in times.items()}
    rows = []
    for v in variants:
        back = v["back"]
        rows.append({"codec": v["name"], "decode_ms": med[f"{v['name']}/decode"],
                     "decode32_ms": med[f"{v['name']}/decode32"], "encode_ms": med[f"{v['name']}/encode"],
                     "bytes_per_param": v["bytes"] / n,
                     "rel_err": ((back.reshape(-1) - w.float().reshape(-1)).norm() / w.float().norm()).item(),
                     "sliceable": v["sliceable"], "import_mib": import_mib(v["module"], args.bnb_path)})
    cpu = cpu_info()
    print(cpu_line(cpu), f"| {torch.get_num_threads()} threads | {args.rows}x{args.cols} bf16 |",
          f"memcpy {med['memcpy']:.2f} ms")
    print(format_table(rows, [("codec", "codec"), ("decode_ms", "decode ms"), ("decode32_ms", "fp32 ms"),
                              ("encode_ms", "encode ms"), ("bytes_per_param", "B/param"), ("rel_err", "rel err"),
                              ("sliceable", "sliceable"), ("import_mib", "import MiB")]))
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    path = write_json("nf4_codec", {"cpu": cpu, "shape": [args.rows, args.cols], "threads": torch.get_num_threads(),
                                    "memcpy_ms": med["memcpy"], "rows": rows, "skipped": skipped})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
