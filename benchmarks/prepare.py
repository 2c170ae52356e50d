"""`mct prepare` throughput (MB/s of document text) and peak resident memory with a
trained byte-level BPE, for each --workers value, beside plain ``tokenizers``
``encode_batch`` over the same texts in one process (the library's own thread pool: the
limit), and the memory of the same prepare at a smaller corpus (flat in corpus size?).

    PYTHONPATH=src:. python benchmarks/prepare.py [--mb 200] [--small-mb 10] [--vocab 8192]
        [--workers 1,2] [--text-mb 60,600] [--json PATH]

``--text-mb`` adds, per size, one plain-text file holding a single document of that many
MB (the same sources concatenated), prepared with the largest --workers: the document
streams in pieces, so every process's peak RSS should not grow with it.

The corpus is a .jsonl of the Python standard library's sources (the default corpus's
files, repeated until --mb MB of text), one file per record. The BPE is trained once on
the first 8 MB with ``mct.data.tokenizer.train_bpe`` and given to `mct prepare` as a
tokenizer.json, so the timed part is the streaming encode (read, parse, encode, write).
Every measurement runs in a fresh process: peak RSS is its VmHWM (``ru_maxrss``), the
workers' is the largest worker's. The baseline's time counts only ``encode_batch`` (its
texts are already in memory); its memory holds the whole corpus, by design.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS_DIR, cpu_info, cpu_line, environment, format_table

_PREPARE_CHILD = r"""
import json, resource, sys, time
from mct.data.pipeline import prepare
t0 = time.perf_counter()
meta = prepare([sys.argv[1]], sys.argv[2], tokenizer=sys.argv[3], workers=int(sys.argv[4]), progress=False)
assert meta["documents"] == 1 or not sys.argv[1].endswith(".txt")
s = time.perf_counter() - t0
print(json.dumps({"seconds": s, "tokens": meta["tokens"], "documents": meta["documents"],
                  "rss_main": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "rss_worker": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""

_BASELINE_CHILD = r"""
import json, resource, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[2])
texts = [json.loads(line)["text"] for line in open(sys.argv[1], encoding="utf-8")]
t0 = time.perf_counter()
n = 0
for i in range(0, len(texts), 256):
    n += sum(len(e.ids) for e in tok.encode_batch(texts[i:i + 256], add_special_tokens=False))
s = time.perf_counter() - t0
print(json.dumps({"seconds": s, "tokens": n, "rss_main": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def write_corpus(path: Path, mb: float) -> int:
    """A .jsonl of stdlib sources (cycled) holding ``mb`` MB of text; returns its text bytes."""
    from mct.data.corpus import stdlib_sources
    files = [f.read_text(encoding="utf-8") for f in stdlib_sources()]
    target, total, i = int(mb * 1e6), 0, 0
    with open(path, "w", encoding="utf-8") as out:
        while total < target:
            text = files[i % len(files)]
            out.write(json.dumps({"text": text}) + "\n")
            total += len(text.encode("utf-8"))
            i += 1
    return total


def write_text(path: Path, mb: float) -> int:
    """One plain-text document of stdlib sources (cycled), ``mb`` MB; returns its bytes."""
    from mct.data.corpus import stdlib_sources
    files = [f.read_bytes() for f in stdlib_sources()]
    target, total, i = int(mb * 1e6), 0, 0
    with open(path, "wb") as out:
        while total < target:
            out.write(files[i % len(files)])
            total += len(files[i % len(files)])
            i += 1
    return total


def _child(code: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(["src", os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        raise SystemExit(f"benchmark child failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=200.0, help="MB of text in the corpus")
    ap.add_argument("--small-mb", type=float, default=10.0, help="a smaller corpus, for memory flatness")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--text-mb", default="", help="single-document .txt sizes in MB, e.g. 60,600")
    ap.add_argument("--json", default=str(RESULTS_DIR / "prepare.json"))
    args = ap.parse_args()
    from mct.data.tokenizer import train_bpe
    cpu = cpu_info()
    print(f"CPU: {cpu_line(cpu)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp_p = Path(tmp)
        big, small = tmp_p / "big.jsonl", tmp_p / "small.jsonl"
        text_bytes = {"big": write_corpus(big, args.mb), "small": write_corpus(small, args.small_mb)}
        t0 = time.perf_counter()
        sample, n = [], 0
        with open(small, encoding="utf-8") as f:
            for line in f:  # the first 8 MB train the tokenizer
                if n > 8e6:
                    break
                sample.append(json.loads(line)["text"])
                n += len(sample[-1])
        tok = train_bpe(sample, args.vocab)
        (tmp_p / "tokenizer.json").write_text(tok.json)
        print(f"trained a {tok.vocab_size}-id BPE on {n / 1e6:.1f} MB in {time.perf_counter() - t0:.1f} s")
        base = _child(_BASELINE_CHILD, str(big), str(tmp_p / "tokenizer.json"))
        rows.append({"what": "tokenizers encode_batch (1 process, its threads)", "mb": text_bytes["big"] / 1e6,
                     "seconds": base["seconds"], "mb_s": text_bytes["big"] / 1e6 / base["seconds"],
                     "rss_main_mib": base["rss_main"] / 2**20, "tokens": base["tokens"]})
        for corpus in ("big", "small"):
            for w in [int(x) for x in args.workers.split(",")]:
                if corpus == "small" and w != max(int(x) for x in args.workers.split(",")):
                    continue
                out = tmp_p / f"ds_{corpus}_{w}"
                r = _child(_PREPARE_CHILD, str(big if corpus == "big" else small), str(out),
                           str(tmp_p / "tokenizer.json"), str(w))
                mb = text_bytes[corpus] / 1e6
                rows.append({"what": f"mct prepare --workers {w}", "mb": mb, "seconds": r["seconds"],
                             "mb_s": mb / r["seconds"], "rss_main_mib": r["rss_main"] / 2**20,
                             "rss_worker_mib": r["rss_worker"] / 2**20 if w > 1 else None, "tokens": r["tokens"],
                             "vs_encode_batch": (mb / r["seconds"]) / rows[0]["mb_s"] if corpus == "big" else None})
                assert corpus == "small" or r["tokens"] == base["tokens"] + r["documents"], \
                    "prepare and encode_batch disagree on the token count (EOS aside)"
        w = max(int(x) for x in args.workers.split(","))
        jsonl_mb_s = next((r["mb_s"] for r in rows if r["what"] == f"mct prepare --workers {w}"), None)
        for mb_text in [float(x) for x in args.text_mb.split(",") if x]:
            txt = tmp_p / f"one_{mb_text:g}.txt"
            n = write_text(txt, mb_text)
            r = _child(_PREPARE_CHILD, str(txt), str(tmp_p / f"ds_txt_{mb_text:g}"), str(tmp_p / "tokenizer.json"),
                       str(w))
            rows.append({"what": f"mct prepare 1-document .txt --workers {w}", "mb": n / 1e6, "seconds": r["seconds"],
                         "mb_s": n / 1e6 / r["seconds"], "rss_main_mib": r["rss_main"] / 2**20,
                         "rss_worker_mib": r["rss_worker"] / 2**20 if w > 1 else None, "tokens": r["tokens"],
                         "vs_jsonl": n / 1e6 / r["seconds"] / jsonl_mb_s if jsonl_mb_s else None})
            txt.unlink()
    cols = [("what", "run"), ("mb", "text MB"), ("seconds", "s"), ("mb_s", "MB/s"), ("vs_encode_batch", "x limit"), ("vs_jsonl", "x jsonl"),
            ("rss_main_mib", "peak RSS MiB"), ("rss_worker_mib", "worker RSS MiB"), ("tokens", "tokens")]
    print(format_table(rows, cols))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"rows": rows, "cpu": cpu, "vocab": args.vocab,
                                           "env": environment()}, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
