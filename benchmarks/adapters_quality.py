"""Adapter quality: a GPT pretrained from scratch, then LoRA (and QLoRA, when the build has it)
fine-tuned on held-out files; the fine-tune corpus's validation loss before and after.

Runs ``python -m mct train`` (the real recipe: schedule, clipping, evaluation) into temporary
run dirs and reads ``metrics.jsonl``: (1) pretraining on the default corpus (the Python
standard library's sources); (2) the pretrained model's validation loss on the held-out
corpus (this project's docs/*.md, never seen in pretraining: one step at lr 1e-12, the
smallest mct accepts being > 0, so B moves by ~1e-12 and the model is the base); (3) per adapter kind, ``--init-from``
the pretrained run with ``adapter.kind = K`` on the held-out corpus. Targets: the LoRA
fine-tune lowers the held-out validation loss; QLoRA's within 2% of LoRA's after the same
steps. The model is the default GPT's architecture at a smaller width (``--set`` any key to
change it: ``--set model.n_layer=4 --set model.d_model=128 --set model.seq_len=128`` is the
default GPT, about 10x slower per step).

    PYTHONPATH=src:. python benchmarks/adapters_quality.py [--pretrain-steps 300] [--steps 100]
        [--kinds lora,qlora] [--set section.key=value ...] [--work DIR]

``--work DIR`` keeps the runs there, and a pretraining run already in ``DIR/pre`` (of the
same ``--set`` shape) is reused rather than trained again.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import cpu_line, format_table, write_json

REPO = Path(__file__).resolve().parents[1]
SMALL = ["model.n_layer=2", "model.n_head=2", "model.d_model=64", "model.seq_len=64", "data.micro_batch_size=8",
         "train.eval_every=50", "train.eval_batches=8", "train.log_every=10"]
"""The default GPT's architecture, narrower and shorter: 300 pretraining steps in a few minutes."""


def train(run_dir: Path, sets: list[str]) -> dict:
    """``mct train`` into ``run_dir`` with ``sets``; its validation rows and wall time.
    Raises CalledProcessError (its stderr printed) when the run fails."""
    cmd = [sys.executable, "-m", "mct", "train", "--run-dir", str(run_dir), "--no-progress",
           *[a for s in sets for a in ("--set", s)]]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    if proc.returncode != 0:
        print(proc.stderr[-2000:], file=sys.stderr)
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return {"val": read_val(run_dir), "wall_s": time.perf_counter() - t0}


def read_val(run_dir: Path) -> list[tuple[int, float]]:
    """(step, validation loss) of each evaluation a run logged."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pretrain-steps", type=int, default=300)
    ap.add_argument("--steps", type=int, default=100, help="fine-tune steps per adapter kind")
    ap.add_argument("--kinds", default="lora,qlora", help="adapter kinds to fine-tune (a kind the build refuses is "
                                                            "reported as such)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3, help="the adapters' learning rate")
    ap.add_argument("--set", action="append", default=[], dest="extra")
    ap.add_argument("--out", default="adapters_quality")
    ap.add_argument("--work", help="keep the runs here; reuse DIR/pre when it is a finished run")
    args = ap.parse_args()
    shape = SMALL + args.extra
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.work or tmp)
        for kind in ("base", *args.kinds.split(",")):
            shutil.rmtree(root / kind, ignore_errors=True)
        held_out = root / "held_out"  # the docs' text files only (docs/img holds images)
        held_out.mkdir(parents=True, exist_ok=True)
        for f in sorted((REPO / "docs").glob("*.md")):
            (held_out / f.name).write_bytes(f.read_bytes())
        if (root / "pre" / "model.safetensors").is_file():
            pre = {"val": read_val(root / "pre"), "wall_s": None}
        else:
            shutil.rmtree(root / "pre", ignore_errors=True)
            pre = train(root / "pre", [*shape, f"train.steps={args.pretrain_steps}"])
        rows.append({"run": "pretrain (stdlib)", "steps": args.pretrain_steps, "val_loss": pre["val"][-1][1],
                     "wall_s": pre["wall_s"]})
        tune = [*shape, f"data.path={held_out}", f"train.init_from={root / 'pre'}", f"adapter.rank={args.rank}",
                "train.warmup_steps=10", "train.eval_every=25"]
        base = train(root / "base", [*tune, "adapter.kind=lora", "train.steps=1", "train.lr=1e-12"])
        before = base["val"][0][1]
        rows.append({"run": "pretrained on held-out docs", "steps": 0, "val_loss": before, "wall_s": base["wall_s"]})
        for kind in args.kinds.split(","):
            try:
                r = train(root / kind, [*tune, f"adapter.kind={kind}", f"train.steps={args.steps}",
                                        f"train.lr={args.lr}"])
            except subprocess.CalledProcessError:
                rows.append({"run": f"{kind} fine-tune", "steps": args.steps, "note": "refused by this build"})
                continue
            rows.append({"run": f"{kind} fine-tune", "steps": args.steps, "val_loss": r["val"][-1][1],
                         "vs_before_pct": 100.0 * (r["val"][-1][1] / before - 1.0), "curve": r["val"],
                         "wall_s": r["wall_s"]})
    lora = next((r for r in rows if r["run"] == "lora fine-tune" and "val_loss" in r), None)
    for r in rows:
        if lora is not None and r["run"].endswith("fine-tune") and "val_loss" in r:
            r["vs_lora_pct"] = 100.0 * (r["val_loss"] / lora["val_loss"] - 1.0)
    print(f"GPT {' '.join(shape)}; LoRA rank {args.rank}, lr {args.lr}; CPU: {cpu_line()}")
    print(format_table(rows, [("run", "run"), ("steps", "steps"), ("val_loss", "val loss"),
                              ("vs_before_pct", "% vs before"), ("vs_lora_pct", "% vs LoRA"), ("wall_s", "wall s"),
                              ("note", "note")]))
    print(f"wrote {write_json(args.out, {'shape': shape, 'rank': args.rank, 'lr': args.lr, 'rows': rows})}")


if __name__ == "__main__":
    main()
