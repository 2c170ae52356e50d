"""Activation offload (``checkpointing.offload``): step time and memory of 'disk' against
'none', per checkpointing policy, through the Engine on this machine's CPU.

For a GPT of ``--layers`` blocks (``--d-model``, ``--seq-len``, micro-batch ``--batch``,
dropout 0.1) and each policy of ``--policies``:

- memory, from the engine's memory tracker (one tracked engine per setting, last of two
  steps): the backward phase's activation bytes and the step's peak, and the bytes the
  step parked on disk at most (``act_offload_peak_bytes``);
- step time: ``--steps`` steps of untracked engines, 'none' and 'disk' interleaved
  round-robin (so machine load hits both alike); the ratio of medians, and the median of
  the per-round ratios (the target: <= 1.3x with 'disk');
- the final weights of both after the timed steps, compared bit for bit.

Prints the CPU model and flags; writes ``benchmarks/results/act_offload.json`` (or
``--json PATH``). Run:

    PYTHONPATH=src python benchmarks/act_offload.py --layers 16 --steps 6
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (add_mfu, cpu_line, format_table, interleave, mfu_line, mib, step_utilization,  # noqa: E402
                    summarize, write_json)

from mct.config import EngineConfig  # noqa: E402
from mct.engine import Engine  # noqa: E402
from mct.models.gpt import GPT, gpt_loss  # noqa: E402
from mct.run.trainer import make_optimizer, seeded_gpt_loss  # noqa: E402

TARGET_TIME = 1.3


def engine_config(args: argparse.Namespace, policy: str, offload: str, track: bool, root: str) -> EngineConfig:
    return EngineConfig.from_dict({
        "model": {"n_layer": args.layers, "d_model": args.d_model, "n_head": max(1, args.d_model // 64),
                  "seq_len": args.seq_len, "dropout": 0.1},
        "data": {"micro_batch_size": args.batch},
        "checkpointing": {"policy": policy, "offload": offload},
        "memory": {"track": track}, "offload": {"dir": root}})


def build(cfg: EngineConfig) -> Engine:
    torch.manual_seed(cfg.seed)
    return Engine(GPT(cfg.model), make_optimizer(cfg), cfg)


def micro_batch(cfg: EngineConfig, step: int) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    g = torch.Generator().manual_seed(cfg.seed + step)
    shape = (cfg.data.micro_batch_size, cfg.model.seq_len)
    x = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
    return [(x, torch.randint(0, cfg.model.vocab_size, shape, generator=g), 1000 + step)]


def memory(args: argparse.Namespace, policy: str, offload: str, root: str) -> dict:
    cfg = engine_config(args, policy, offload, True, root)
    engine = build(cfg)
    for step in range(2):
        m = engine.train_step(micro_batch(cfg, step), seeded_gpt_loss).metrics
    engine.close()
    return {"backward_activations": m["peaks"]["backward"]["activations"], "peak": m["peak_bytes"],
            "parked_peak": m.get("act_offload_peak_bytes", 0)}


def timing(args: argparse.Namespace, policy: str, root: str) -> dict:
    cfgs = {off: engine_config(args, policy, off, False, root) for off in ("none", "disk")}
    engines = {off: build(cfg) for off, cfg in cfgs.items()}
    waits: list[float] = []

    def stepper(off: str):
        def step(i: int) -> None:
            out = engines[off].train_step(micro_batch(cfgs[off], i), seeded_gpt_loss)
            if off == "disk":
                waits.append(out.metrics["time_act_offload_wait_s"])
        return step
    times = interleave({off: stepper(off) for off in engines}, args.steps, warmup=1)
    states = {off: e.full_state_dict() for off, e in engines.items()}
    identical = all(torch.equal(states["none"][k], states["disk"][k]) for k in states["none"])
    for e in engines.values():
        e.close()
    per_round = [d / n for d, n in zip(times["disk"], times["none"])]
    return {"none_s": summarize(times["none"]), "disk_s": summarize(times["disk"]),
            "ratio_of_medians": statistics.median(times["disk"]) / statistics.median(times["none"]),
            "median_round_ratio": statistics.median(per_round), "io_wait_s_median": statistics.median(waits[1:] or [0]),
            "bit_identical": identical}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--policies", nargs="+", default=["all", "sqrt"])
    ap.add_argument("--dir", default="", help="offload.dir (default: the system temporary directory)")
    ap.add_argument("--json", default="act_offload")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"CPU: {cpu_line()}; torch threads {torch.get_num_threads()}")
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir or None) as root:
        base = engine_config(args, "none", "none", False, root)
        util = step_utilization(lambda: GPT(base.model), gpt_loss, micro_batch(base, 0)[0][:2], base)
        for policy in args.policies:
            mem = {off: memory(args, policy, off, root) for off in ("none", "disk")}
            t = timing(args, policy, root)
            rows.append({"policy": policy, "act_none_mib": mib(mem["none"]["backward_activations"]),
                         "act_disk_mib": mib(mem["disk"]["backward_activations"]),
                         "peak_none_mib": mib(mem["none"]["peak"]), "peak_disk_mib": mib(mem["disk"]["peak"]),
                         "parked_mib": mib(mem["disk"]["parked_peak"]),
                         "t_none_s": t["none_s"]["median"], "t_disk_s": t["disk_s"]["median"],
                         "ratio": t["median_round_ratio"], "io_wait_s": t["io_wait_s_median"],
                         "identical": t["bit_identical"], "memory": mem, "timing": t,
                         "meets_time_target": t["median_round_ratio"] <= TARGET_TIME,
                         "mfu_none_pct": add_mfu({}, util, t["none_s"]["median"])["mfu_pct"],
                         "mfu_disk_pct": add_mfu({}, util, t["disk_s"]["median"])["mfu_pct"]})
    print(format_table(rows, [("policy", "policy"), ("act_none_mib", "bwd act none MiB"),
                              ("act_disk_mib", "bwd act disk MiB"), ("peak_none_mib", "peak none MiB"),
                              ("peak_disk_mib", "peak disk MiB"), ("parked_mib", "parked MiB"),
                              ("t_none_s", "step none s"), ("t_disk_s", "step disk s"),
                              ("ratio", "disk/none"), ("io_wait_s", "io wait s"), ("identical", "bit-identical"),
                              ("mfu_none_pct", "MFU % none"), ("mfu_disk_pct", "MFU % disk")]))
    print(mfu_line(util))
    path = write_json(args.json, {"args": vars(args), "target_time_ratio": TARGET_TIME, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
