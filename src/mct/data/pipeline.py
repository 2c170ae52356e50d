"""``mct prepare INPUT... --out DIR``: inputs -> tokenized dataset (format: dataset.py).

The pipeline streams: the main process reads inputs in chunks of about 1 MiB of raw
records (``sources.read_source``), ``workers`` processes parse and encode them
(``encode_chunk``; ``workers.OrderedWorkers``), and the main process appends the results in input order. At most
``2 x workers`` chunks are in flight, so memory does not grow with the corpus. With
``workers = 1`` the chunks are encoded in the main process (no IPC). Each encoder runs
single-threaded (TOKENIZERS_PARALLELISM=false for the encode phase): the parallelism is
the workers. ``train:VOCAB`` first streams the inputs once through the BPE trainer.

Atomic: everything goes to a hidden sibling of DIR that becomes DIR only when whole
(``DatasetWriter``); any error, Ctrl-C or kill leaves no DIR.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from mct.data.dataset import DatasetWriter, check_out_dir
from mct.data.sources import CHUNK_BYTES, Chunk, Source, never, expand_inputs, group_text, parse_chunk, read_source
from mct.data.textstream import SPLITS
from mct.data.tokenizer import Encoder, Tokenizer, resolve_tokenizer, tokenizer_identity
from mct.data.workers import OrderedWorkers
from mct.outputs import Owned


@dataclass
class Encoded:
    """One chunk encoded: ``tokens`` (each document's ids then EOS, the dataset dtype;
    a document streamed in pieces gets its EOS after its last), ``lengths`` (per
    document ending in the chunk, its tokens in the chunk, EOS included; the tokens
    after the last are a document that goes on), documents skipped (``empty``, ``binary``),
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
    """Parse and encode one chunk: each document its tokenizer's prefix (a model's BOS),
    its text's ids, the suffix and EOS (``Tokenizer.closing``). Raises ValueError
    (FILE:LINE) for a bad record."""
    parsed = parse_chunk(chunk, text_field)
    tok = enc.tok
    ids = enc.encode_batch(parsed.texts)
    prefix, closing = np.array(tok.prefix, dtype=tok.dtype), np.array(tok.closing(), dtype=tok.dtype)
    parts, ends, run = [], [], 0
    for a, start, end in zip(ids, parsed.starts, parsed.ends):  # a piece: the template at its document's ends
        piece = [prefix] if start else []
        piece.append(a.astype(tok.dtype))
        if end:
            piece.append(closing)
        parts += piece
        run += sum(p.size for p in piece)
        if end:
            ends.append(run)
            run = 0
    tokens = np.concatenate(parts) if parts else np.empty(0, tok.dtype)
    lengths = np.array(ends, dtype=np.int64)
    # decoding the first document of each chunk proves the tokenizer lossless on this data
    mismatched = int(bool(ids) and enc.decode(ids[0]) != parsed.texts[0])
    return Encoded(tokens, lengths, parsed.empty, parsed.binary, sum(len(x) for x in chunk.items if x),
                   int(bool(ids)), mismatched)


def _encode_in_worker(text_field: str, enc: Encoder, chunk: Chunk) -> Encoded:
    return encode_chunk(enc, chunk, text_field)


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


@dataclass(frozen=True)
class _Reading:
    """How inputs are read: ``split`` of text files, ``chunk_bytes``, ``may_cut``
    (called before a document is cut into pieces) and ``text_field``."""

    split: str
    chunk_bytes: int
    may_cut: Callable[[], None]
    text_field: str


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt in the block (as Ctrl-C does), so the same
    clean-up runs: the pool is terminated and joined, the partial directory removed."""
    def handler(signum, frame):
        raise KeyboardInterrupt
    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _chunks(sources: list[Source], digests: list[dict], how: _Reading) -> Iterator[Chunk]:
    def raw() -> Iterator[Chunk]:
        for src, digest in zip(sources, digests):
            yield from read_source(src, digest, how.chunk_bytes, how.split, how.may_cut, how.text_field)
    return group_text(raw(), how.chunk_bytes)


def _texts(sources: list[Source], how: _Reading) -> Iterator[str]:
    """Every non-empty document's text (a big one in pieces), streamed: the BPE
    trainer's input. Pieces are cut where its pre-tokenizer cuts, so the counts hold."""
    for chunk in _chunks(sources, [{} for _ in sources], how):
        yield from parse_chunk(chunk, how.text_field).texts


def _cut_check(tok: Tokenizer) -> Callable[[], None]:
    """``may_cut`` for ``tok``: raises when it does not encode a document in pieces as it
    encodes it whole (a pre-tokenizer that marks each text's start)."""
    def check() -> None:
        if not tok.pieces_ok:
            raise ValueError(f"--tokenizer {tok.source!r} encodes text cut at a line break differently from the "
                             f"whole (its pre-tokenizer marks where each text starts), so a document larger than "
                             f"{CHUNK_BYTES >> 20} MiB cannot stream; pass --split paragraph or --split line")
    return check


def _encoded(chunks: Iterator[Chunk], tok: Tokenizer, text_field: str, workers: int) -> Iterator[Encoded]:
    """Encoded chunks in input order; at most 2 x workers in flight."""
    if workers == 1:
        enc = Encoder(tok)
        for c in chunks:
            yield encode_chunk(enc, c, text_field)
        return
    with OrderedWorkers(workers, Encoder, tok, functools.partial(_encode_in_worker, text_field)) as pool:
        yield from pool.map(chunks)


MAX_ENCODE_WORKERS = max(64, 2 * (os.cpu_count() or 1))
"""--workers above this is refused: each worker is a process holding a tokenizer."""


def _check_args(workers: Any, text_field: str, chunk_bytes: int, split: str) -> None:
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_ENCODE_WORKERS:
        raise ValueError(f"--workers must be an integer in [1, {MAX_ENCODE_WORKERS}] (at most twice the CPU cores, 64 at "
                         f"least), got {workers!r}; e.g. --workers {min(8, os.cpu_count() or 1)}")
    if not text_field:
        raise ValueError("--text-field is empty; pass the JSON field that holds the text, e.g. --text-field text")
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    if split not in SPLITS:
        raise ValueError(f"--split {split!r} is not one of {', '.join(SPLITS)}; e.g. --split paragraph")


def prepare(inputs: list[str], out: str, *, tokenizer: str = "bytes", text_field: str = "text",
            workers: int = 1, progress: bool = True, chunk_bytes: int = CHUNK_BYTES,
            split: str = "file", force: bool = False, owned: Owned | None = None) -> dict[str, Any]:
    """Tokenize ``inputs`` into the dataset directory ``out`` (see the module
    docstring); ``split`` cuts text files into documents (textstream.py). Returns its
    meta.json (plus ``seconds``, not stored). Creates ``out`` only when complete.
    Raises ValueError (one line, naming the value and the fix) for bad arguments,
    unreadable inputs, a bad record (``FILE:LINE: ...``) or no documents, and for an ``out``
    that ``check_out_dir`` refuses (``force``: replace an earlier dataset; ``owned``: the
    run's-own-files check)."""
    _check_args(workers, text_field, chunk_bytes, split)
    out_path = check_out_dir(out, force, owned)
    sources = expand_inputs(inputs)
    t0 = time.perf_counter()
    reading = _Reading(split, chunk_bytes, never, text_field)
    tok = resolve_tokenizer(tokenizer, texts=lambda: _texts(sources, reading), progress=progress)
    how = dataclasses.replace(reading, may_cut=_cut_check(tok))
    digests: list[dict] = [{} for _ in sources]
    counts = dict.fromkeys(("empty", "binary", "checked", "mismatched"), 0)
    from tqdm import tqdm
    has_gz = any(s.kind in ("jsonl.gz", "parquet", "arrow") for s in sources)  # text larger than the file
    bar = tqdm(total=None if has_gz else sum(s.size for s in sources), unit="B", unit_scale=True,
               desc="prepare", disable=not progress, smoothing=0.1)
    try:
        encoded = contextlib.closing(_encoded(_chunks(sources, digests, how), tok, text_field, workers))
        with _single_threaded_tokenizers(), DatasetWriter(out_path, tok.dtype, force) as writer, encoded as stream:
            for enc in stream:
                writer.add(enc.tokens, enc.lengths)
                for k in counts:
                    counts[k] += getattr(enc, k)
                bar.update(enc.raw_bytes)
            meta = writer.commit({
                "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "tokenizer": tok.kind,
                "template": {"prefix": list(tok.prefix), "suffix": list(tok.suffix)},
                "tokenizer_identity": tokenizer_identity(tok.json),
                "text_field": text_field, "split": split, "skipped_empty": counts["empty"],
                "skipped_binary": counts["binary"],
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
            f"(the built-in GPT also --set model.vocab_size={meta['vocab_size']}; an hf: model has its own)")
    rt = meta["roundtrip"]
    warning = (f"the tokenizer did not decode {rt['mismatched']} of {rt['checked']} checked documents back to "
               f"their text (it normalizes or drops characters); the dataset is not lossless"
               if rt["mismatched"] else None)
    return line, warning
