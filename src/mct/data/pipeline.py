"""``mct prepare INPUT... --out DIR``: inputs -> tokenized dataset (format: dataset.py).

The pipeline streams: the main process reads inputs in chunks of about 1 MiB of raw
records (``sources.read_source``), ``workers`` processes parse and encode them
(``encode_chunk``), and the main process appends the results in input order. At most
``2 x workers`` chunks are in flight, so memory does not grow with the corpus. With
``workers = 1`` the chunks are encoded in the main process (no IPC). Each encoder runs
single-threaded (TOKENIZERS_PARALLELISM=false for the encode phase): the parallelism is
the workers. ``train:VOCAB`` first streams the inputs once through the BPE trainer.

Atomic: everything goes to a hidden sibling of DIR that becomes DIR only when whole
(``DatasetWriter``); any error, Ctrl-C or kill leaves no DIR.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from mct.data.dataset import DatasetWriter, check_out_dir
from mct.data.sources import CHUNK_BYTES, Chunk, Source, expand_inputs, group_text, parse_chunk, read_source
from mct.data.tokenizer import Encoder, Tokenizer, resolve_tokenizer


@dataclass
class Encoded:
    """One chunk encoded: ``tokens`` (each document's ids then EOS, the dataset dtype),
    ``lengths`` (per document, EOS included), documents skipped (``empty``, ``binary``),
    ``raw_bytes`` read, and the round-trip check of its first document (``checked``,
    ``mismatched``: 0 or 1)."""

    tokens: np.ndarray
    lengths: np.ndarray
    empty: int
    binary: int
    raw_bytes: int
    checked: int
    mismatched: int


def encode_chunk(enc: Encoder, chunk: Chunk, text_field: str) -> Encoded:
    """Parse and encode one chunk. Raises ValueError (FILE:LINE) for a bad record."""
    parsed = parse_chunk(chunk, text_field)
    tok = enc.tok
    ids = enc.encode_batch(parsed.texts)
    eos = np.array([tok.eos_id], dtype=tok.dtype)
    parts = [p for a in ids for p in (a.astype(tok.dtype), eos)]
    tokens = np.concatenate(parts) if parts else np.empty(0, tok.dtype)
    lengths = np.array([a.size + 1 for a in ids], dtype=np.int64)
    # decoding the first document of each chunk proves the tokenizer lossless on this data
    mismatched = int(bool(ids) and enc.decode(ids[0]) != parsed.texts[0])
    return Encoded(tokens, lengths, parsed.empty, parsed.binary, sum(map(len, chunk.items)),
                   int(bool(ids)), mismatched)


_worker_encoder: list[Encoder] = []
"""The one Encoder of a pool worker process, set by its initializer (never in the parent)."""


def _init_worker(tok: Tokenizer) -> None:
    _worker_encoder.append(Encoder(tok))


def _worker_task(chunk: Chunk, text_field: str) -> Encoded:
    return encode_chunk(_worker_encoder[0], chunk, text_field)


@contextlib.contextmanager
def _single_threaded_tokenizers() -> Iterator[None]:
    """TOKENIZERS_PARALLELISM=false for the block (inherited by forked workers), restored after."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def _chunks(sources: list[Source], digests: list[dict], chunk_bytes: int) -> Iterator[Chunk]:
    def raw() -> Iterator[Chunk]:
        for src, digest in zip(sources, digests):
            yield from read_source(src, digest, chunk_bytes)
    return group_text(raw(), chunk_bytes)


def _texts(sources: list[Source], text_field: str, chunk_bytes: int) -> Iterator[str]:
    """Every non-empty document's text, streamed (the BPE trainer's input)."""
    for chunk in _chunks(sources, [{} for _ in sources], chunk_bytes):
        yield from parse_chunk(chunk, text_field).texts


def _encoded(chunks: Iterator[Chunk], tok: Tokenizer, text_field: str, workers: int) -> Iterator[Encoded]:
    """Encoded chunks in input order; at most 2 x workers in flight."""
    if workers == 1:
        enc = Encoder(tok)
        for c in chunks:
            yield encode_chunk(enc, c, text_field)
        return
    # fork: workers start in milliseconds and share the parent's imports; spawn elsewhere
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    pool = ctx.Pool(workers, initializer=_init_worker, initargs=(tok,))
    try:
        pending: deque = deque()
        for c in chunks:
            pending.append(pool.apply_async(_worker_task, (c, text_field)))
            while len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        pool.close()
    finally:
        pool.terminate()
        pool.join()


def prepare(inputs: list[str], out: str, *, tokenizer: str = "bytes", text_field: str = "text",
            workers: int = 1, progress: bool = True, chunk_bytes: int = CHUNK_BYTES) -> dict[str, Any]:
    """Tokenize ``inputs`` into the dataset directory ``out`` (see the module
    docstring). Returns its meta.json (plus ``seconds``, not stored). Creates ``out``
    only when complete. Raises ValueError (one line, naming the value and the fix) for
    bad arguments, unreadable inputs, a bad record (``FILE:LINE: ...``) or no documents."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"--workers must be an integer >= 1, got {workers!r}")
    if not text_field:
        raise ValueError("--text-field is empty; pass the JSON field that holds the text, e.g. --text-field text")
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    out_path = check_out_dir(out)
    sources = expand_inputs(inputs)
    t0 = time.perf_counter()
    tok = resolve_tokenizer(tokenizer, texts=lambda: _texts(sources, text_field, chunk_bytes))
    digests: list[dict] = [{} for _ in sources]
    counts = dict.fromkeys(("empty", "binary", "checked", "mismatched"), 0)
    from tqdm import tqdm
    has_gz = any(s.kind == "jsonl.gz" for s in sources)  # its text is larger than its file
    bar = tqdm(total=None if has_gz else sum(s.size for s in sources), unit="B", unit_scale=True,
               desc="prepare", disable=not progress, smoothing=0.1)
    try:
        encoded = contextlib.closing(_encoded(_chunks(sources, digests, chunk_bytes), tok, text_field, workers))
        with _single_threaded_tokenizers(), DatasetWriter(out_path, tok.dtype) as writer, encoded as stream:
            for enc in stream:
                writer.add(enc.tokens, enc.lengths)
                for k in counts:
                    counts[k] += getattr(enc, k)
                bar.update(enc.raw_bytes)
            meta = writer.commit({
                "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "tokenizer": tok.kind,
                "text_field": text_field, "skipped_empty": counts["empty"], "skipped_binary": counts["binary"],
                "roundtrip": {"checked": counts["checked"], "mismatched": counts["mismatched"]},
                "inputs": [{"name": s.name, **d} for s, d in zip(sources, digests)]}, tok.json)
    finally:
        bar.close()
    return {**meta, "seconds": time.perf_counter() - t0}


def summary(meta: dict[str, Any], out: str) -> tuple[str, str | None]:
    """(the line `mct prepare` prints, a warning or None) for ``prepare``'s result."""
    mb = sum(i["bytes"] for i in meta["inputs"]) / 1e6
    line = (f"prepared {out}: {meta['documents']:,} documents, {meta['tokens']:,} tokens ({meta['dtype']}, "
            f"vocab_size {meta['vocab_size']}, eos_id {meta['eos_id']}); skipped {meta['skipped_empty']} empty, "
            f"{meta['skipped_binary']} non-text; {mb:.1f} MB in {meta['seconds']:.1f} s "
            f"({mb / max(meta['seconds'], 1e-9):.1f} MB/s); train with --set data.path={out} "
            f"--set model.vocab_size={meta['vocab_size']}")
    rt = meta["roundtrip"]
    warning = (f"the tokenizer did not decode {rt['mismatched']} of {rt['checked']} checked documents back to "
               f"their text (it normalizes or drops characters); the dataset is not lossless"
               if rt["mismatched"] else None)
    return line, warning
