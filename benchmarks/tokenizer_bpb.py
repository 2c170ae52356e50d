"""The point of a tokenizer: validation bits per byte of the default GPT trained on the
default corpus (the Python standard library's sources) as bytes vs as a trained 8k BPE.

    PYTHONPATH=src:. python benchmarks/tokenizer_bpb.py [--steps 300] [--vocab 8192]
        [--eval-batches 16] [--skip-default] [--json PATH]

Both runs read the same documents: the default corpus's files are prepared twice with
`mct prepare` (``bytes``, vocab 257 with EOS, and ``train:VOCAB``), in the same order,
so the split by document (a function of seed, index and count) holds out the same files.
Everything else is the default job's (``mct train`` recipe, seed 0): same model, steps,
batch of 16 x 128 tokens; a BPE window covers more text, which is the point. The third
row is the default job itself (bytes without EOS, split by file name: other held-out files).

bits per byte = validation loss (nats per token, the mean over ``--eval-batches`` fixed
batches) x validation tokens / validation text bytes / ln 2, where the validation
tokens include each document's EOS and the bytes are the documents' UTF-8 text.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS_DIR, environment, format_table


def _train(data_path: str, vocab: int, run_dir: Path, steps: int, eval_batches: int) -> dict:
    from mct.config import CLI_RECIPE, EngineConfig
    from mct.run.trainer import train
    cfg = EngineConfig.from_dict({**CLI_RECIPE, "model": {"vocab_size": vocab}, "data": {"path": data_path},
                                  "train": {**CLI_RECIPE["train"], "steps": steps, "eval_every": steps,
                                            "eval_batches": eval_batches, "log_every": steps}})
    t0 = time.perf_counter()
    summary = train(cfg, run_dir, progress=False)
    return {"val_loss": summary.final_val_loss, "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--skip-default", action="store_true", help="leave out the default job's row")
    ap.add_argument("--json", default=str(RESULTS_DIR / "tokenizer_bpb.json"))
    args = ap.parse_args()
    from mct.data import load_corpus
    from mct.data.corpus import stdlib_sources
    from mct.data.pipeline import prepare
    files = [str(f) for f in stdlib_sources()]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp_p = Path(tmp)
        splits = {}
        for name, spec in (("bytes", "bytes"), (f"bpe{args.vocab}", f"train:{args.vocab}")):
            meta = prepare(files, str(tmp_p / name), tokenizer=spec, workers=args.workers, progress=False)
            c = load_corpus(str(tmp_p / name), seed=0, val_fraction=0.1, seq_len=128)
            splits[name] = (meta, c)
        (bmeta, bc), (pmeta, pc) = splits["bytes"], splits[f"bpe{args.vocab}"]
        assert list(bc.val_files) == list(pc.val_files), "the two datasets must hold out the same documents"
        val_text_bytes = bc.val.size - len(bc.val_files)  # bytes tokens minus one EOS per document
        for name, (meta, c) in splits.items():
            r = _train(str(tmp_p / name), meta["vocab_size"], tmp_p / f"run_{name}", args.steps, args.eval_batches)
            tokens_per_byte = c.val.size / val_text_bytes
            rows.append({"data": f"prepared {name}", "vocab": meta["vocab_size"], "val_loss": r["val_loss"],
                         "tokens_per_byte": tokens_per_byte, "text_bytes_per_window": 128 / tokens_per_byte,
                         "bpb": r["val_loss"] * tokens_per_byte / math.log(2), "train_s": r["seconds"],
                         "prepare_s": meta["seconds"]})
        if not args.skip_default:
            r = _train("", 256, tmp_p / "run_default", args.steps, args.eval_batches)
            rows.append({"data": "default job (bytes, no EOS)", "vocab": 256, "val_loss": r["val_loss"],
                         "tokens_per_byte": 1.0, "text_bytes_per_window": 128.0, "bpb": r["val_loss"] / math.log(2),
                         "train_s": r["seconds"]})
    cols = [("data", "data"), ("vocab", "vocab"), ("val_loss", "val loss (nats/token)"),
            ("tokens_per_byte", "tokens/byte"), ("text_bytes_per_window", "bytes/window"), ("bpb", "val bits/byte"),
            ("prepare_s", "prepare s"), ("train_s", "train s")]
    print(f"default GPT, {args.steps} steps, seed 0, validation over {args.eval_batches} batches of 16 x 128 tokens")
    print(format_table(rows, cols))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"rows": rows, "steps": args.steps, "env": environment()}, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
