"""Corpus loading: byte tokenizer, sources, the document-level train/validation split.

Corpus sources (``data.path``):

- ``""``: the Python standard library's own ``.py`` sources on this machine (found via
  ``sysconfig``; ``site-packages``, ``test``/``tests``, ``idlelib`` and ``lib2to3`` are
  left out). Files are taken in sorted relative-path order until the next would pass
  8 MiB, so loading takes about a second at most (sizes come from stat, so only the files
  kept are read) and nothing is downloaded. The corpus differs between Python versions;
  the fingerprint records which one a run used.
- a text file: cut into contiguous documents of at most ``doc_bytes`` (64 KiB) each,
  at least two, sizes equal to within one byte.
- a directory: every UTF-8 file without NUL bytes under it (recursive, sorted, hidden
  names skipped) is one document. A directory holding a single text file is cut like a file.
- a ``.bin``: uint16 little-endian tokens, cut into documents like a file; each split a
  ``DocumentSpans`` view of the file (never a copy), read with ``pread``.
- a prepared dataset (a directory made by ``mct prepare``, see ``dataset.py``):
  memory-mapped; its documents are split by ``doc_hash(seed, index)`` (vectorized, so a
  start costs milliseconds for millions of documents) and each split is a
  ``DocumentSpans`` view, never a copy. The fingerprint comes from meta.json (which
  holds the sha256 of the tokens, the tokenizer and every input), never from the tokens.

Each document goes to validation when ``sha256(seed, name)`` maps below ``val_fraction``
(stable across processes and Python runs), with at least one document on each side.
Train and validation are separate token streams, so no training window can contain
validation text.

No source is held by the process: text files are read one at a time into a ``TokenSpool``
(an unnamed file in mct's cache directory, ``mct.data.spool``), and every split is a
``DocumentSpans`` read with ``pread`` from that file, a ``.bin`` or a prepared dataset's
tokens.bin (never through a mapping: ``mct.data.dataset.pread_into``).
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from mct.errors import describe

from mct.data.dataset import (DocumentSpans, check_tokens_in_vocab, check_tokens_sha256, doc_hash, is_prepared,
                              looks_partial, open_prepared, pread_into, scan_tokens)
from mct.data.spool import TokenSpool


DOC_BYTES = 64 * 1024
"""Size cap of one document when a single file or a .bin is split (bytes or tokens)."""
STDLIB_CAP_BYTES = 8 * 1024 * 1024
"""The default corpus stops before this many bytes of stdlib sources."""
_STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests",
                                   "idlelib", "lib2to3", "__pycache__"})


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255, lossless for any text."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        """``text`` -> uint8 array of its UTF-8 bytes."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, ids: Any) -> str:
        """Sequence/array/tensor of ids in [0, 256) -> text; invalid UTF-8 becomes U+FFFD.
        Raises ValueError for ids outside [0, 256)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().cpu().numpy()
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError(f"byte ids must be in [0, 256), got min {arr.min()} max {arr.max()}; "
                             "ids from a .bin corpus need that corpus's own tokenizer to decode")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


@dataclass(frozen=True, kw_only=True)
class Corpus:
    """Tokens split by document. ``train``/``val``: 1-D uint8 (text) or uint16 (.bin)
    arrays, documents concatenated in sorted order, or ``DocumentSpans`` views of a
    prepared dataset (uint16/uint32). ``*_files``: document names (relative paths,
    ``name#index`` for pieces of one file, ``doc<index>`` in a prepared dataset).
    ``fingerprint``: sha256 over names, sizes, split and content (prepared: over
    meta.json and the split). ``min_vocab_size``: largest token id + 1 (prepared: the
    tokenizer's vocab size). ``dataset``: a prepared dataset's meta.json (its input
    list cut to a count), and ``tokenizer_path`` its tokenizer.json (None for other
    sources). ``train_bounds`` / ``val_bounds``: where each document of a split starts
    in its concatenated tokens, int64 [documents + 1] (the last = the split's size); None
    (a Corpus built by hand) reads as one document (``bounds``)."""

    train: np.ndarray | DocumentSpans
    val: np.ndarray | DocumentSpans
    train_files: Sequence[str]
    val_files: Sequence[str]
    fingerprint: str
    source: str
    min_vocab_size: int
    dataset: dict[str, Any] | None = None
    tokenizer_path: str | None = None
    train_bounds: np.ndarray | None = None
    val_bounds: np.ndarray | None = None

    def bounds(self, split: str) -> np.ndarray:
        """Document start offsets of ``split`` ('train' or 'val') in its tokens, int64
        [documents + 1]: a prepared dataset's spans, else the recorded bounds, else one
        document."""
        tokens, recorded = (self.train, self.train_bounds) if split == "train" else (self.val, self.val_bounds)
        if isinstance(tokens, DocumentSpans):
            return tokens.cum
        return recorded if recorded is not None else np.array([0, tokens.size], dtype=np.int64)

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError if any token id is >= ``vocab_size``."""
        if self.dataset is not None and self.min_vocab_size > vocab_size:
            raise ValueError(f"the dataset {self.source!r} has a tokenizer of {self.min_vocab_size} ids, but "
                             f"model.vocab_size = {vocab_size}; set model.vocab_size >= {self.min_vocab_size}")
        if self.min_vocab_size > vocab_size:
            raise ValueError(f"corpus {self.source!r} has token ids up to {self.min_vocab_size - 1}, "
                             f"but model.vocab_size = {vocab_size}; set model.vocab_size >= "
                             f"{self.min_vocab_size}")

    def verify_contents(self) -> None:
        """For a prepared dataset, stream tokens.bin through sha256 and raise ValueError
        unless it is what meta.json recorded (``--resume`` calls this: the fingerprint
        comes from meta.json, so tokens changed in place would pass it). No-op for
        other sources, whose fingerprint hashes their content."""
        if self.dataset is not None:
            check_tokens_sha256(open_prepared(Path(self.source)))

    def metadata(self) -> dict[str, Any]:
        """A JSON-ready summary for run metadata."""
        return {"source": self.source, "fingerprint": self.fingerprint,
                "train_tokens": int(self.train.size), "val_tokens": int(self.val.size),
                "train_files": len(self.train_files), "val_files": len(self.val_files),
                "dtype": str(self.train.dtype), "min_vocab_size": self.min_vocab_size,
                **({"dataset": self.dataset} if self.dataset is not None else {})}


def _read_bytes(path: Path) -> bytes:
    """One place for file reads, so an unreadable file becomes a ValueError."""
    try:
        return path.read_bytes()
    except OSError as e:
        raise ValueError(f"data.path: {describe(e, path)}; fix it or remove it from the corpus") from None


def _is_text(data: bytes) -> bool:
    if b"\x00" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _walk_sorted(root: Path, skip_dir) -> list[Path]:
    """Files under ``root`` in sorted relative-path order, pruning dirs where skip_dir(name)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not skip_dir(d)]
        # regular files only: reading a FIFO or device found in the tree would block or never end
        found += [Path(dirpath, f) for f in filenames if not f.startswith(".") and Path(dirpath, f).is_file()]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def stdlib_sources() -> list[Path]:
    """The files of the default corpus (``data.path = ''``), in its order: to prepare the
    same documents with another tokenizer (benchmarks/tokenizer_bpb.py)."""
    root = _stdlib_root()
    return [root / name for name, _ in _stdlib_documents(root)]


def _stdlib_root() -> Path:
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise ValueError(f"data.path = '' uses the Python standard library sources, but {str(root)!r} "
                         "is not a directory here; set data.path to a text file or directory")
    return root


def _stdlib_documents(root: Path) -> Iterator[tuple[str, bytes]]:
    """The default corpus's documents, one file read at a time (see the module docstring)."""
    files = _walk_sorted(root, lambda d: d in _STDLIB_EXCLUDED_DIRS or d.startswith("."))
    total = 0
    for f in (f for f in files if f.suffix == ".py"):
        if total + f.stat().st_size > STDLIB_CAP_BYTES:
            break
        data = _read_bytes(f)
        if data and _is_text(data):
            yield f.relative_to(root).as_posix(), data
            total += len(data)


def _chunk_bounds(name: str, n: int, doc_bytes: int) -> tuple[list[str], list[int]]:
    """The names and bounds of one stream of ``n`` tokens cut into >= 2 contiguous documents
    of at most ``doc_bytes`` tokens each, sizes equal to within one."""
    n_docs = max(2, math.ceil(n / doc_bytes))
    if n < n_docs:
        raise ValueError(f"data.path {name!r} has only {n} tokens; it cannot be split into "
                         "train and validation documents; use a larger corpus")
    width = len(str(n_docs - 1))
    return [f"{name}#{i:0{width}d}" for i in range(n_docs)], [i * n // n_docs for i in range(n_docs + 1)]


def _bin_corpus(path: Path, seed: int, val_fraction: float, doc_bytes: int) -> Corpus:
    """A .bin's Corpus: cut into documents like a text file (``_chunk_bounds``) and split
    (``_split_documents``), each split a ``DocumentSpans`` view of the file, never a copy,
    so the process holds none of the file after loading it."""
    size = path.stat().st_size
    if size == 0 or size % 2:
        raise ValueError(f"data.path = {str(path)!r} is {size} bytes; a .bin must hold uint16 "
                         "little-endian tokens (a non-zero, even number of bytes); re-export it")
    try:
        tokens = np.memmap(path, dtype="<u2", mode="r")
        file = open(path, "rb", buffering=0)
    except OSError as e:
        raise ValueError(f"data.path: {describe(e, path)}") from None
    with file:
        names, bounds = _chunk_bounds(path.name, tokens.size, doc_bytes)
        buf = np.empty(max(np.diff(bounds)), dtype="<u2")

        def read(start: int, n: int) -> np.ndarray:
            pread_into(file, memoryview(buf.view(np.uint8))[:2 * n], 2 * start)
            return buf[:n]

        return _split_documents(names, np.array(bounds, dtype=np.int64), read,
                                lambda starts, lengths: DocumentSpans(tokens, starts, lengths),
                                np.dtype(np.uint16), str(path), seed, val_fraction)


def _text_file_documents(path: Path) -> Iterator[tuple[str, bytes]]:
    data = _read_bytes(path)
    if not data:
        raise ValueError(f"data.path = {str(path)!r} is an empty file; point it at a file with text")
    if not _is_text(data):
        raise ValueError(f"data.path = {str(path)!r} is not UTF-8 text (or holds NUL bytes); "
                         "convert it to UTF-8, or pre-tokenize it into a uint16 .bin")
    yield path.name, data


def _dir_documents(root: Path) -> Iterator[tuple[str, bytes]]:
    for f in _walk_sorted(root, lambda d: d.startswith(".") or d == "__pycache__"):
        data = _read_bytes(f)
        if data and _is_text(data):
            yield f.relative_to(root).as_posix(), data


def _text_corpus(docs: Iterable[tuple[str, bytes]], source: str, none_found: str, seed: int,
                 val_fraction: float, doc_bytes: int) -> Corpus:
    """A byte corpus from ``docs`` (name, UTF-8 bytes), read one at a time into a
    ``TokenSpool`` (an unnamed file, read back with ``pread``): the process holds one document
    while loading and none after. A lone document is cut like a text file (``_chunk_bounds``),
    then split (``_split_documents``, which reads the documents back in order). Raises ValueError(``none_found``) for
    no documents, and what ``_chunk_bounds`` raises."""
    spool = TokenSpool()
    names, sizes = [], []
    for name, data in docs:
        names.append(name)
        sizes.append(len(data))
        spool.add(data)
    if not names:
        raise ValueError(none_found)
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    if len(names) == 1:  # a lone file still needs a document on each side of the split
        names, cut = _chunk_bounds(names[0], sizes[0], doc_bytes)
        bounds = np.array(cut, dtype=np.int64)
    buf = np.empty(int(np.diff(bounds).max()), np.uint8)
    return _split_documents(names, bounds, lambda start, n: spool.read(start, n, buf), spool.spans,
                            np.dtype(np.uint8), source, seed, val_fraction)


def _split_documents(names: list[str], bounds: np.ndarray, read: Callable[[int, int], np.ndarray],
                     spans: Callable[[np.ndarray, np.ndarray], DocumentSpans], dtype: np.dtype, source: str,
                     seed: int, val_fraction: float) -> Corpus:
    """The Corpus of documents ``names`` at ``bounds`` (token offsets, documents + 1) of one
    token stream: split by name (``_assign``), each split ``spans(starts, lengths)``; the
    fingerprint and the largest id from one pass over the documents, ``read(start, n)``
    giving each (a view valid until the next call); ``dtype`` the tokens' (fingerprinted)."""
    starts, lengths = bounds[:-1], np.diff(bounds)
    is_val = np.array(_assign(names, seed, val_fraction))
    top = 0

    def each() -> Iterator[tuple[str, np.ndarray]]:
        nonlocal top
        for name, start, n in zip(names, starts.tolist(), lengths.tolist()):
            toks = read(start, n)
            top = max(top, int(toks.max()))
            yield name, toks

    fingerprint = _fingerprint(each(), is_val.tolist(), dtype)
    return Corpus(train=spans(starts[~is_val], lengths[~is_val]), val=spans(starts[is_val], lengths[is_val]),
                  train_files=[n for n, v in zip(names, is_val) if not v],
                  val_files=[n for n, v in zip(names, is_val) if v],
                  fingerprint=fingerprint, source=source, min_vocab_size=top + 1)


def split_hash(seed: int, name: str) -> float:
    """Stable uniform number in [0, 1) for (seed, document name); sha256-based."""
    digest = hashlib.sha256(f"{seed}\x00{name}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _assign(names: list[str], seed: int, val_fraction: float) -> list[bool]:
    """True = validation. Forces one document onto each side (the nearest by hash)."""
    return _assign_hashes(np.array([split_hash(seed, n) for n in names]), val_fraction).tolist()


def _assign_hashes(h: np.ndarray, val_fraction: float) -> np.ndarray:
    """Documents whose hash is below ``val_fraction`` go to validation (True), with one
    document forced onto each side (the nearest by hash)."""
    assert h.size >= 2, "callers guarantee at least two documents"
    is_val = h < val_fraction
    if not is_val.any():
        is_val[int(np.argmin(h))] = True
    if is_val.all():
        is_val[int(np.argmax(h))] = False
    return is_val


class _DocNames(Sequence[str]):
    """Names ``doc<index>`` of some documents of a prepared dataset, made on demand."""

    def __init__(self, indices: np.ndarray) -> None:
        self.indices = indices

    def __len__(self) -> int:
        return int(self.indices.size)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [f"doc{k}" for k in self.indices[i]]
        return f"doc{self.indices[i]}"


def load_prepared(path: Path, *, seed: int, val_fraction: float, seq_len: int, cut_lone: bool = False) -> Corpus:
    """A prepared dataset's Corpus (``load_corpus`` of a prepared DIR); ``cut_lone``: a
    dataset of one document is cut into pieces of at most ``DOC_BYTES`` tokens (at least
    two), as a lone text file is, instead of refused. Raises what ``load_corpus`` raises."""
    return _check_split_sizes(_prepared_corpus(path, seed, val_fraction, cut_lone), seq_len)


def _prepared_corpus(path: Path, seed: int, val_fraction: float, cut_lone: bool = False) -> Corpus:
    """The document-level split of a prepared dataset (see the module docstring)."""
    ds = open_prepared(path)
    check_tokens_in_vocab(ds, scan_tokens(ds)[0])
    n = int(ds.meta["documents"])
    starts, lengths = np.asarray(ds.offsets[:-1]), np.diff(ds.offsets)
    if n == 1 and cut_lone:
        pieces = max(2, math.ceil(int(lengths[0]) / DOC_BYTES))
        bounds = np.arange(pieces + 1, dtype=np.int64) * int(lengths[0]) // pieces
        starts, lengths, n = bounds[:-1], np.diff(bounds), pieces
    if n < 2 or lengths.min() < 1:
        raise ValueError(f"data.path = {str(path)!r} holds {ds.meta['documents']} document; a train/validation "
                         "split by document needs at least two; prepare more documents")
    is_val = _assign_hashes(doc_hash(seed, n), val_fraction)
    train_idx, val_idx = np.flatnonzero(~is_val), np.flatnonzero(is_val)
    fp = hashlib.sha256(f"prepared\0{ds.meta_sha256}\0{seed}\0{val_fraction!r}\0{val_idx.size}".encode())
    return Corpus(train=DocumentSpans(ds.tokens, starts[train_idx], lengths[train_idx]),
                  val=DocumentSpans(ds.tokens, starts[val_idx], lengths[val_idx]),
                  train_files=_DocNames(train_idx), val_files=_DocNames(val_idx), fingerprint=fp.hexdigest(),
                  source=str(path), min_vocab_size=int(ds.meta["vocab_size"]), dataset=_dataset_summary(ds),
                  tokenizer_path=str(path / "tokenizer.json"))


def _dataset_summary(ds: Any) -> dict[str, Any]:
    """meta.json for run metadata, its per-input list cut to a count (a directory of a
    million files would bloat metadata.json); ``meta_sha256`` identifies the full file."""
    inputs = ds.meta.get("inputs") or []
    return {**{k: v for k, v in ds.meta.items() if k != "inputs"}, "inputs": len(inputs),
            "input_bytes": sum(int(i.get("bytes", 0)) for i in inputs), "meta_sha256": ds.meta_sha256}


def _check_split_sizes(corpus: Corpus, seq_len: int) -> Corpus:
    for split, arr in (("train", corpus.train), ("validation", corpus.val)):
        if arr.size < seq_len + 1:
            raise ValueError(f"the {split} split of {corpus.source!r} has {arr.size} tokens, fewer than one "
                             f"window of model.seq_len + 1 = {seq_len + 1}; use a larger corpus, "
                             "reduce model.seq_len, or change data.val_fraction")
    return corpus


def _fingerprint(docs: Iterable[tuple[str, np.ndarray]], is_val: list[bool], dtype: np.dtype) -> str:
    h = hashlib.sha256(str(dtype).encode())
    for (name, toks), v in zip(docs, is_val):
        h.update(f"{name}\x00{toks.size}\x00{'val' if v else 'train'}\n".encode("utf-8"))
        h.update(np.ascontiguousarray(toks).data)  # ~10 ms for 8 MB: content is hashed too
    return h.hexdigest()


def load_corpus(path: str, *, seed: int, val_fraction: float, seq_len: int,
                doc_bytes: int = DOC_BYTES) -> Corpus:
    """Load ``path`` (see the module docstring; ``""`` = stdlib sources) and split it by
    document. Returns a Corpus; reads files, mutates nothing. Raises ValueError for a
    blank or missing path, unreadable or empty files, a directory without text files, a
    .bin of odd length, ``val_fraction`` outside (0, 1), or a split shorter than
    ``seq_len + 1`` tokens."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"data.val_fraction = {val_fraction!r} must be in (0, 1), e.g. 0.1")
    if seq_len < 1:
        raise ValueError(f"model.seq_len = {seq_len!r} must be >= 1")
    if doc_bytes < 1:
        raise ValueError(f"doc_bytes = {doc_bytes!r} must be >= 1")
    if path == "":
        root = _stdlib_root()
        return _check_split_sizes(_text_corpus(
            _stdlib_documents(root), f"python-stdlib:{root}", f"data.path = '' found no Python sources under "
            f"{str(root)!r}; set data.path to a text file or directory", seed, val_fraction, doc_bytes), seq_len)
    if not path.strip():
        raise ValueError(f"data.path = {path!r} is blank; use '' for the stdlib corpus, or a "
                         "text file, directory or .bin")
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"data.path = {path!r} does not exist; point it at a text file, a "
                         "directory of text files or a uint16 .bin (or '' for the stdlib corpus)")
    if not p.is_dir() and not p.is_file():
        raise ValueError(f"data.path = {path!r} is not a regular file or directory (a device, FIFO or "
                         "socket); point it at a text file, a directory of text files or a uint16 .bin")
    if is_prepared(p):
        return _check_split_sizes(_prepared_corpus(p, seed, val_fraction), seq_len)
    if looks_partial(p):
        raise ValueError(f"data.path = {path!r} holds tokens.bin or docs.idx but no meta.json: an unfinished "
                         f"or damaged prepared dataset; run `mct prepare` again")
    if p.suffix == ".bin" and not p.is_dir():
        return _check_split_sizes(_bin_corpus(p, seed, val_fraction, doc_bytes), seq_len)
    docs = _dir_documents(p) if p.is_dir() else _text_file_documents(p)
    none_found = (f"data.path = {str(p)!r} holds no non-empty UTF-8 text files; add text files, or point "
                  "data.path at a file or a .bin")
    return _check_split_sizes(_text_corpus(docs, str(p), none_found, seed, val_fraction, doc_bytes), seq_len)
