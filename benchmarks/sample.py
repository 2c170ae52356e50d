"""``mct sample`` against transformers' ``generate``: CPU time for N tokens, same model,
same settings (greedy, one thread).

    PYTHONPATH=src:. python benchmarks/sample.py [--tokens 200] [--layers 4] [--width 128]
        [--repeats 3] [--json PATH]

A Llama (``--layers``, ``--width``, 512 positions) with a byte-level BPE tokenizer of 320
ids (``tests/task/test_hf_own_tokens.py``) is trained one step by ``mct train`` on JSON
Lines; then, interleaved ``--repeats`` times in this process, CPU time (user + system,
``time.process_time``) of:

- ``mct sample``: ``sample_text`` (loads the run's model and tokenizer, generates);
- ``mct sample, generation``: its generation alone (``generate`` with the KV cache);
- ``transformers``: ``from_pretrained(RUN_DIR/hf)``, its tokenizer, ``generate``, decode;
- ``transformers, generation``: its ``generate`` alone;
- ``no cache``: a forward of the whole context per token (what ``mct sample`` did before).

The table gives the median of each and its ratio to transformers' (the target: ``mct
sample`` <= 1.5x), and the CPU model and flags; the JSON holds every sample.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `benchmarks` and `tests` importable
from benchmarks.common import cpu_info, cpu_line, format_table, summarize, write_json  # noqa: E402

PROMPT = "the quick brown"


def make_run(root: Path, layers: int, width: int) -> Path:
    """A one-step run of the tiny Llama on JSON Lines (its own tokens)."""
    from mct.config import EngineConfig
    from mct.run.trainer import train
    from tests.task.test_hf_own_tokens import _documents, save_tiny_llama_with_tokenizer
    save_tiny_llama_with_tokenizer(root / "llama", layers=layers, width=width, positions=512)
    (root / "data").mkdir()
    (root / "data" / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in _documents(80, 0)))
    cfg = EngineConfig.from_dict({"model": {"source": f"hf:{root / 'llama'}", "seq_len": 32},
                                  "data": {"path": str(root / "data"), "micro_batch_size": 2},
                                  "train": {"steps": 1, "eval_every": 0, "init_from": str(root / "llama")}})
    train(cfg, root / "run", progress=False)
    return root / "run"


def variants(run: Path, tokens: int) -> dict[str, Callable[[], int]]:
    """name -> a call that generates and returns the tokens it generated."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from mct.task import sample as g

    model, cfg, _ = g._load(run)
    text = g._Text(run, cfg, g._dataset_of(run))
    ids = [*text.prefix, *text.encode(PROMPT)]
    hf_model = AutoModelForCausalLM.from_pretrained(str(run / "hf")).eval()
    hf_tok = AutoTokenizer.from_pretrained(str(run / "hf"))
    x = hf_tok(PROMPT, return_tensors="pt")

    def mct_sample() -> int:
        return g.sample_text(run, PROMPT, tokens, temperature=0.0)[1]

    def mct_generation() -> int:
        with torch.no_grad():
            return g._hf_sample(model, text, list(ids), tokens, 0.0, 0, cfg)[1]

    def transformers_all() -> int:
        m = AutoModelForCausalLM.from_pretrained(str(run / "hf")).eval()
        tok = AutoTokenizer.from_pretrained(str(run / "hf"))
        with torch.no_grad():
            out = m.generate(**tok(PROMPT, return_tensors="pt"), max_new_tokens=tokens, do_sample=False)
        tok.decode(out[0])
        return out.shape[1] - x["input_ids"].shape[1]

    def transformers_generation() -> int:
        with torch.no_grad():
            out = hf_model.generate(**x, max_new_tokens=tokens, do_sample=False)
        return out.shape[1] - x["input_ids"].shape[1]

    def no_cache() -> int:
        context = list(ids)
        with torch.no_grad():
            for _ in range(tokens):
                context.append(int(g._logits(model, torch.tensor([context[-512:]])).argmax()))
        return tokens

    return {"mct sample": mct_sample, "mct sample, generation": mct_generation, "transformers": transformers_all,
            "transformers, generation": transformers_generation, "no cache (before)": no_cache}


def measure(calls: dict[str, Callable[[], int]], repeats: int) -> dict[str, dict]:
    """CPU seconds of each call, interleaved round-robin ``repeats`` times after one warm-up."""
    out: dict[str, dict] = {name: {"cpu_s": [], "tokens": None} for name in calls}
    for i in range(repeats + 1):
        for name, call in calls.items():
            t0 = time.process_time()
            made = call()
            if i:
                out[name]["cpu_s"].append(time.process_time() - t0)
                out[name]["tokens"] = made
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="sample")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        run = make_run(Path(tmp), args.layers, args.width)
        results = measure(variants(run, args.tokens), args.repeats)
    base = {k: summarize(results[k]["cpu_s"])["median"] for k in ("transformers", "transformers, generation")}
    rows = []
    for name, r in results.items():
        med = summarize(r["cpu_s"])["median"]
        ref = base["transformers, generation"] if "generation" in name or "cache" in name else base["transformers"]
        rows.append({"variant": name, "tokens": r["tokens"], "cpu_s": med, "ms_per_token": 1e3 * med / r["tokens"],
                     "ratio": med / ref})
    print(f"CPU: {cpu_line()}; torch threads 1; Llama {args.layers} layers x {args.width}, greedy, "
          f"prompt {PROMPT!r}")
    print(format_table(rows, [("variant", "variant"), ("tokens", "tokens"), ("cpu_s", "CPU s (median)"),
                              ("ms_per_token", "ms/token"), ("ratio", "x transformers")]))
    path = write_json(args.json, {"args": vars(args), "rows": rows, "samples": results, "cpu": cpu_info()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
