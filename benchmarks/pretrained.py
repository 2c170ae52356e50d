"""Pretrained weights in and out: resident peaks of ``--init-from`` and ``mct export
--format hf`` for a Hugging Face Llama trained at stage 3 with offload on 2 ranks.

    PYTHONPATH=src:. python benchmarks/pretrained.py [--layers 16] [--d-model 1024]
        [--vocab 32000] [--precision bf16] [--json PATH]

The model is a transformers ``LlamaForCausalLM`` (GQA with d_model/256 key-value heads,
SwiGLU MLP of 2.75 x d_model, untied head) written with ``save_pretrained`` into a
temporary directory, then, in a fresh process that spawns 2 gloo ranks (one thread
each): built on the meta device from config.json, ZeRO stage 3 with
offload.optimizer = offload.params = 'cpu', activation checkpointing 'all', micro-batch
1 x 128 tokens. Each rank's peak resident memory (VmHWM, reset through
/proc/self/clear_refs before each phase) is measured for: building the engine, loading
the weights (``load_pretrained``: each rank reads its shards' slices), the first
training step (which allocates the optimizer state) and the second. Targets of the issue:

- the init peak is no higher than a training step's;
- ``mct export --format hf`` (in a fresh process, after the ranks saved a checkpoint)
  stays below the largest tensor + 64 MiB over the idle process (VmRSS after imports).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks` and `tests` importable
from benchmarks.common import format_table, write_json  # noqa: E402

MIB = 2**20


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmHWM, VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    """VmHWM back to the current VmRSS (Linux: '5' into clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def save_llama(directory: Path, layers: int, d_model: int, vocab: int) -> dict[str, int]:
    """Write the HF Llama directory; returns its parameter count and largest tensor bytes (fp32)."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(vocab_size=vocab, hidden_size=d_model, intermediate_size=int(2.75 * d_model) // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=d_model // 64,
                         num_key_value_heads=max(1, d_model // 256), max_position_embeddings=512,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    return {"n_params": sum(p.numel() for p in model.parameters()),
            "largest_tensor_bytes": max(p.numel() for p in model.parameters()) * 4}


def rank_main(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    from mct.config import EngineConfig
    from mct.engine import Engine
    from mct.memory import host
    from mct.persistence.checkpoint import save_checkpoint
    from mct.persistence.hf_export import copy_hf_assets
    from mct.persistence.init_from import load_pretrained
    from mct.task import build_model, task_for
    from mct.task.gpt import make_optimizer
    cfg = EngineConfig.from_dict({
        "model": {"source": f"hf:{spec['hf']}", "seq_len": 128}, "data": {"micro_batch_size": 1},
        "precision": {"mode": spec["precision"]}, "zero": {"stage": 3}, "checkpointing": {"policy": "all"},
        "memory": {"track": False}, "offload": {"optimizer": "cpu", "params": "cpu"}})
    task = task_for(cfg)
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    host.for_building(host.mode_of(cfg, "cpu"))  # as `mct train` does
    model, program = build_model(task, cfg, on_meta=True)
    engine = Engine(model, make_optimizer(cfg), cfg, init_program=program, param_groups=task.param_groups(model))
    out["build"] = {"hwm": _status("VmHWM"), "s": time.perf_counter() - t0}
    _reset_peak()
    t0 = time.perf_counter()
    load_pretrained(engine, spec["hf"])
    out["init_from"] = {"hwm": _status("VmHWM"), "s": time.perf_counter() - t0}
    g = torch.Generator().manual_seed(rank)
    for i in (1, 2):
        x = torch.randint(0, spec["vocab"], (1, 129), generator=g)
        _reset_peak()
        t0 = time.perf_counter()
        engine.train_step((x[:, :-1], x[:, 1:]), task.loss_fn)
        out[f"step{i}"] = {"hwm": _status("VmHWM"), "s": time.perf_counter() - t0}
    run = Path(spec["run"])
    save_checkpoint(run / "checkpoints" / "step_00000002", engine, step=2, trainer={"config": cfg.to_dict()})
    if rank == 0:
        copy_hf_assets(spec["hf"], run / "hf")
    engine.close()
    return out


def _ranks(spec: dict[str, Any]) -> None:
    from tests.distributed import run_distributed
    print(json.dumps(run_distributed(rank_main, 2, spec, timeout=3000)))


def _export(spec: dict[str, Any]) -> None:
    import mct.persistence.hf_export as hf_export  # imported before the idle measurement
    import safetensors.torch  # noqa: F401
    idle = _status("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    hf_export.export_hf(spec["run"], spec["out"], dtype=spec["dtype"])
    print(json.dumps({"idle": idle, "hwm": _status("VmHWM"), "s": time.perf_counter() - t0}))


def _fresh(flag: str, spec: dict[str, Any]) -> Any:
    proc = subprocess.run([sys.executable, __file__, flag, json.dumps(spec)], capture_output=True, text=True,
                          timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{flag} failed:\n{(proc.stderr or proc.stdout)[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--json", default="pretrained")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mct-pretrained-bench-") as d:
        root = Path(d)
        sizes = save_llama(root / "llama", args.layers, args.d_model, args.vocab)
        spec = {"hf": str(root / "llama"), "run": str(root / "run"), "precision": args.precision, "vocab": args.vocab}
        ranks = _fresh("--ranks", spec)
        exports = {dt: _fresh("--export", {"run": spec["run"], "out": str(root / f"out-{dt}"), "dtype": dt})
                   for dt in ("fp32", "bf16")}
    rows = [{"rank": r, **{f"{k}_mib": v["hwm"] / MIB for k, v in res.items()},
             "init_s": res["init_from"]["s"], "step2_s": res["step2"]["s"]} for r, res in enumerate(ranks)]
    print(f"Llama {args.layers} layers, d_model {args.d_model}, vocab {args.vocab}: {sizes['n_params']:,} parameters; "
          f"2 ranks, stage 3, offload optimizer+params=cpu, {args.precision}")
    print(format_table(rows, [("rank", "rank"), ("build_mib", "build MiB"), ("init_from_mib", "init-from MiB"),
                              ("step1_mib", "step 1 MiB"), ("step2_mib", "step 2 MiB"), ("init_s", "init s"),
                              ("step2_s", "step s")]))
    bound = sizes["largest_tensor_bytes"] + 64 * MIB
    for dt, e in exports.items():
        over = e["hwm"] - e["idle"]
        print(f"export --format hf --dtype {dt}: peak {over / MIB:.1f} MiB over the idle process "
              f"({e['idle'] / MIB:.0f} MiB); bound largest tensor + 64 MiB = {bound / MIB:.1f} MiB: "
              f"{'ok' if over <= bound else 'OVER'}; {e['s']:.1f} s")
    ok = all(r["init_from"]["hwm"] <= min(r["step1"]["hwm"], r["step2"]["hwm"]) for r in ranks)
    print(f"init-from peak <= training step peak on every rank: {'yes' if ok else 'NO'}")
    print("wrote", write_json(args.json, {"sizes": sizes, "ranks": ranks, "exports": exports,
                                          "args": vars(args)}))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in ("--ranks", "--export"):
        (_ranks if sys.argv[1] == "--ranks" else _export)(json.loads(sys.argv[2]))
    else:
        main()
