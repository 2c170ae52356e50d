"""Adapter speed: mct LoRA at ZeRO stage 3 against peft + FSDP2 (``fully_shard`` per decoder
layer and the root, over the peft model), side by side in one run on 2 gloo ranks.

Both train the same transformers Llama (the same seeded weights), the same LoRA adapters
(rank, alpha, the attention and MLP projections; peft's A copied from mct's, B = 0), the same
batches, AdamW with the same hyperparameters, fp32, no clipping. Steps are interleaved round
robin (``benchmarks.common.interleave``), a barrier before each, so load on the shared machine
hits both alike; the step time is the slower rank's. The losses of the two are printed side
by side: the same training, so they agree to float rounding. Target: mct no slower than 0.9x
of peft + FSDP2 (its step time at most 1/0.9 of theirs). ``mct`` runs as ``mct train`` does
(``memory.track = true``: the tracker counts every tensor); ``mct_untracked`` sets
``memory.track = false``, the engine's own cost without the accounting.

    PYTHONPATH=src:. python benchmarks/adapters_speed.py [--steps 20] [--layers 4] [--hidden 256]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import cpu_line, format_table, interleave, summarize, write_json  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

VARIANTS = ("mct", "mct_untracked", "peft_fsdp2")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA, LR, SEED = 8, 16.0, 1e-3, 0


def llama(shape: dict):
    """The seeded base model (identical on every rank)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging
    logging.set_verbosity_error()
    config = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=2 * shape["hidden"],
                         num_hidden_layers=shape["layers"], num_attention_heads=shape["hidden"] // 32,
                         num_key_value_heads=shape["hidden"] // 64, max_position_embeddings=shape["seq"],
                         tie_word_embeddings=False)
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config).float()


def batch(step: int, rank: int, shape: dict) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"] + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def loss_fn(model, b) -> torch.Tensor:
    x, y = b
    return F.cross_entropy(model(input_ids=x).logits.flatten(0, 1).float(), y.flatten())


def adamw(groups) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=LR, weight_decay=0.0)


def build_mct(shape: dict, track: bool = True):
    from mct.adapters import apply_adapters
    from mct.config import AdapterConfig, EngineConfig
    from mct.engine import Engine
    model = llama(shape)
    apply_adapters(model, AdapterConfig(kind="lora", rank=RANK, alpha=ALPHA, targets=[f"*{t}" for t in TARGETS]))
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    engine = Engine(model, adamw, EngineConfig.from_dict({"zero": {"stage": 3}, "memory": {"track": track}}))
    return engine, adapters


def build_peft(shape: dict, adapters: dict):
    import peft
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = peft.get_peft_model(llama(shape), peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                              target_modules=TARGETS, bias="none"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(adapters[n.replace("base_model.model.", "", 1).replace(".default", "")])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = adamw([p for p in model.parameters() if p.requires_grad])
    return model, opt


def _rank(rank: int, world: int, shape: dict, steps: int) -> dict:
    engine, adapters = build_mct(shape)
    untracked, _ = build_mct(shape, track=False)
    model, opt = build_peft(shape, adapters)
    losses: dict[str, list[float]] = {k: [] for k in VARIANTS}
    phases: dict[str, list[float]] = {}

    def mct_step(i: int) -> None:
        out = engine.train_step(batch(i, rank, shape), loss_fn)
        losses["mct"].append(out.loss)
        for k, v in out.metrics.items():
            if k.startswith("time_") and isinstance(v, float):
                phases.setdefault(k, []).append(v)

    def untracked_step(i: int) -> None:
        losses["mct_untracked"].append(untracked.train_step(batch(i, rank, shape), loss_fn).loss)

    def peft_step(i: int) -> None:
        loss = loss_fn(model, batch(i, rank, shape))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = loss.detach().clone()
        dist.all_reduce(t)  # the mean over ranks, as the engine reports it
        losses["peft_fsdp2"].append(t.item() / world)
    times = interleave({"mct": mct_step, "mct_untracked": untracked_step, "peft_fsdp2": peft_step}, steps,
                       warmup=2, before_each=dist.barrier)
    engine.close()
    untracked.close()
    return {"times": times, "losses": losses, "phases_ms": {k: 1e3 * statistics.median(v[2:]) for k, v in
                                                             phases.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--out", default="adapters_speed")
    args = ap.parse_args()
    shape = {"layers": args.layers, "hidden": args.hidden, "seq": args.seq, "batch": args.batch, "vocab": 1024}
    results = run_distributed(_rank, 2, shape, args.steps, timeout=1800.0)
    rows = []
    for kind in VARIANTS:
        per_step = [max(ts) for ts in zip(*(r["times"][kind] for r in results))]  # the slower rank
        t = summarize(per_step)
        rows.append({"variant": kind, "step_ms": 1e3 * t["median"], "iqr_ms": 1e3 * t["iqr"],
                     "tokens_per_s": 2 * args.batch * args.seq / t["median"],
                     "final_loss": results[0]["losses"][kind][-1]})
    mct, untracked, ref = rows
    ratio = ref["step_ms"] / mct["step_ms"]  # > 1: mct faster
    ratio_untracked = ref["step_ms"] / untracked["step_ms"]
    gap = max(abs(a - b) for a, b in zip(results[0]["losses"]["mct"], results[0]["losses"]["peft_fsdp2"]))
    print(f"Llama {args.layers} x {args.hidden}, seq {args.seq}, batch {args.batch} per rank, 2 gloo ranks x 1 "
          f"thread, LoRA rank {RANK} on {', '.join(TARGETS)}, fp32, {args.steps} steps; CPU: {cpu_line()}")
    print(format_table(rows, [("variant", "variant"), ("step_ms", "step ms (median)"), ("iqr_ms", "IQR ms"),
                              ("tokens_per_s", "tokens/s"), ("final_loss", "final loss")]))
    print(f"mct speed / peft+FSDP2 speed = {ratio:.3f} (target >= 0.9; untracked {ratio_untracked:.3f}); largest "
          f"loss gap over the run {gap:.2e}")
    print("mct phases (rank 0, median ms): " + ", ".join(f"{k[5:-2]} {v:.0f}" for k, v in
                                                         results[0]["phases_ms"].items()))
    payload = {"shape": shape, "steps": args.steps, "rows": rows, "speed_ratio": ratio,
               "speed_ratio_untracked": ratio_untracked, "loss_gap": gap, "phases_ms_rank0": results[0]["phases_ms"],
               "losses_rank0": results[0]["losses"], "step_medians_ms": {k: 1e3 * statistics.median(v) for k, v in
                                                                        results[0]["times"].items()}}
    print(f"wrote {write_json(args.out, payload)}")


if __name__ == "__main__":
    main()
