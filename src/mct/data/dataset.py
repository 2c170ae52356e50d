"""The prepared dataset: the public on-disk format of ``mct prepare`` (docs/data.md).

    DIR/tokens.bin      every document's ids then its EOS id; little-endian uint16 when
                        vocab_size <= 65536, else uint32
    DIR/docs.idx        int64 little-endian offsets into tokens.bin, documents + 1 of
                        them: document k is tokens[idx[k]:idx[k+1]] (its EOS last);
                        idx[0] = 0, idx[-1] = number of tokens
    DIR/meta.json       format, dtype, vocab_size, eos_id, documents, tokens, sha256s
    DIR/tokenizer.json  the tokenizer (Hugging Face tokenizers format)

Written into a hidden sibling directory and renamed to DIR when whole (meta.json last),
so DIR exists only complete: a killed ``mct prepare`` leaves nothing training accepts.
Read memory-mapped: opening a 10 GB dataset reads its meta.json and checks file sizes.
The mapping gives shape and dtype; the scans and the sampler's windows read the file with
``pread`` (``pread_into``), so a training process's resident set does not grow with the
dataset: the kernel's page cache keeps what was read, outside the process.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mct.errors import WRITE, describe, user_error
from mct.outputs import Owned, check_dir_output, install_dir

DATASET_FORMAT = "mct-prepared-v1"
META, TOKENS, DOCS, TOKENIZER = "meta.json", "tokens.bin", "docs.idx", "tokenizer.json"


def check_out_dir(out: str | os.PathLike, force: bool = False, owned: Owned | None = None) -> Path:
    """``out`` as a Path if a dataset may be written there (``mct.outputs``): a new name
    (missing parents are created), an empty directory, or with ``force`` an earlier
    dataset (only its own files); never a link, FIFO or file, nor (``owned``) a run's own
    tree. Raises ValueError (one line, the value and the fix) otherwise."""
    return check_dir_output(Path(out).expanduser(), "--out", force=force, writes=(META, TOKENS, DOCS, TOKENIZER),
                            command="mct prepare", owned=owned, parents=True)


class DatasetWriter:
    """Appends documents to a dataset under construction; ``commit`` makes it DIR (over an
    earlier dataset only with ``force``). ``abort`` (or any exception inside ``with``)
    removes everything written."""

    def __init__(self, out: Path, dtype: np.dtype, force: bool = False) -> None:
        self.out, self.dtype, self.force = out, np.dtype(dtype), force
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_partials(out)
            self.tmp = out.parent / f".{out.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self.tmp.mkdir()
        except OSError as e:
            raise user_error(e, e.filename or out.parent, WRITE) from None
        self.tokens_f = open(self.tmp / TOKENS, "wb")
        self.docs_f = open(self.tmp / DOCS, "wb")
        self.docs_f.write(np.zeros(1, "<i8").tobytes())
        self.n_tokens = self.n_docs = self.doc_end = 0
        self.sha = hashlib.sha256()

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents: ``tokens`` (ids of all, each followed by EOS, in
        ``self.dtype``) and ``lengths`` (per document ending here, its tokens in
        ``tokens``, EOS included). Tokens after the last are of a document that goes on
        in the next call (a document streamed in pieces)."""
        assert tokens.dtype == self.dtype and int(lengths.sum()) <= tokens.size, "a worker broke the chunk contract"
        data = np.ascontiguousarray(tokens).data
        self.tokens_f.write(data)
        self.sha.update(data)
        ends = self.n_tokens + np.cumsum(lengths, dtype=np.int64)
        self.docs_f.write(ends.astype("<i8").tobytes())
        self.doc_end = int(ends[-1]) if ends.size else self.doc_end
        self.n_tokens += int(tokens.size)
        self.n_docs += int(lengths.size)

    def commit(self, meta: dict[str, Any], tokenizer_json: str) -> dict[str, Any]:
        """Write tokenizer.json and meta.json (``meta`` plus the format fields), fsync,
        rename to DIR. Returns the full meta. Raises ValueError for an empty dataset."""
        if self.n_docs == 0:
            raise ValueError("the inputs hold no non-empty document; nothing to prepare")
        assert self.doc_end == self.n_tokens, "a document streamed in pieces never ended"
        for f in (self.tokens_f, self.docs_f):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        tok_bytes = tokenizer_json.encode("utf-8")
        (self.tmp / TOKENIZER).write_bytes(tok_bytes)
        full = {"format": DATASET_FORMAT, "dtype": "uint16" if self.dtype.itemsize == 2 else "uint32",
                "byte_order": "little", **meta, "documents": self.n_docs, "tokens": self.n_tokens,
                "tokens_sha256": self.sha.hexdigest(), "tokenizer_sha256": hashlib.sha256(tok_bytes).hexdigest()}
        (self.tmp / META).write_text(json.dumps(full, indent=1) + "\n")
        for name in (TOKENIZER, META):
            with open(self.tmp / name, "rb") as f:
                os.fsync(f.fileno())
        install_dir(self.tmp, self.out, force=self.force)  # over an earlier dataset: check_out_dir allowed it
        return full

    def abort(self) -> None:
        """Close and remove the partial directory (idempotent)."""
        for f in (self.tokens_f, self.docs_f):
            f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def remove_stale_partials(out: Path) -> list[Path]:
    """Remove the hidden partial directories of ``out`` left by a killed ``mct prepare``
    (``.NAME.partial-PID-XXXXXXXX`` whose process is gone; an older unnamed one
    ``.NAME.partial-XXXXXXXX`` too). A live prepare's is kept. Returns those removed."""
    removed = []
    for p in out.parent.glob(f".{out.name}.partial-*"):
        pid = p.name.rsplit(".partial-", 1)[1].split("-")[0]
        if "-" in p.name.rsplit(".partial-", 1)[1] and pid.isdigit() and _alive(int(pid)):
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def is_prepared(path: Path) -> bool:
    """A directory holding a meta.json of this format."""
    return path.is_dir() and (path / META).is_file()


def is_dataset_dir(path: Path) -> bool:
    """A directory holding tokens.bin or docs.idx: a dataset made by ``mct prepare``,
    complete or not (an output, never an input)."""
    return (path / TOKENS).exists() or (path / DOCS).exists()


def looks_partial(path: Path) -> bool:
    """A directory with dataset files but no meta.json: an unfinished or damaged dataset."""
    return path.is_dir() and not (path / META).exists() and is_dataset_dir(path)


@dataclass(frozen=True)
class PreparedDataset:
    """An opened dataset: ``meta``, ``tokens`` (memory-mapped, [tokens]), ``offsets``
    (memory-mapped int64, [documents + 1]), ``path``, ``meta_sha256`` (of meta.json)."""

    path: Path
    meta: dict[str, Any]
    tokens: np.ndarray
    offsets: np.ndarray
    meta_sha256: str


def open_prepared(path: Path) -> PreparedDataset:
    """Open DIR, checking meta.json's fields against the file sizes and docs.idx's ends.
    Raises ValueError (naming the file and the fix) for anything inconsistent."""
    fix = f"re-create it with `mct prepare ... --out {path}`"
    try:
        raw = (path / META).read_bytes()
    except OSError as e:
        raise ValueError(f"data.path: {describe(e, path / META)}") from None
    try:
        meta = json.loads(raw)
        dtype = {"uint16": "<u2", "uint32": "<u4"}[meta["dtype"]]
        n_tok, n_doc = int(meta["tokens"]), int(meta["documents"])
        int(meta["vocab_size"]), int(meta["eos_id"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"data.path: {path / META} is not a valid dataset meta.json ({type(e).__name__}: {e}); "
                         f"{fix}") from None
    if meta.get("format") != DATASET_FORMAT:
        raise ValueError(f"data.path: {path / META} has format {meta.get('format')!r}, not {DATASET_FORMAT!r}; {fix}")
    for name, want in ((TOKENS, n_tok * np.dtype(dtype).itemsize), (DOCS, (n_doc + 1) * 8)):
        have = (path / name).stat().st_size if (path / name).is_file() else None
        if have != want:
            raise ValueError(f"data.path: {path / name} is {have} bytes, meta.json says {want}; {fix}")
    if not (path / TOKENIZER).is_file():
        raise ValueError(f"data.path: {path / TOKENIZER} is missing; {fix}")
    if n_tok == 0 or n_doc == 0:
        raise ValueError(f"data.path: {path} holds no documents; {fix} from non-empty inputs")
    tokens = np.memmap(path / TOKENS, dtype=dtype, mode="r")
    offsets = np.memmap(path / DOCS, dtype="<i8", mode="r")
    if offsets[0] != 0 or offsets[-1] != n_tok or np.any(np.diff(offsets) < 1):
        raise ValueError(f"data.path: {path / DOCS} offsets are not increasing from 0 to {n_tok}; {fix}")
    return PreparedDataset(path, meta, tokens, offsets, hashlib.sha256(raw).hexdigest())


SCAN_BLOCK = 1 << 22
"""Bytes of tokens.bin read at a time by ``scan_tokens`` (the most of it resident while it reads)."""


def pread_into(file: Any, view: memoryview, pos: int) -> None:
    """Fill ``view`` with the bytes of ``file`` (an unbuffered binary file) from byte ``pos``
    on: ``preadv`` straight into it, nothing mapped into the process. A page fault on a
    mapping can map a whole large folio (2 MiB on ext4) for a read of a few KiB, and every
    page a mapping touched counts in the resident set until unmapped: a dataset read once
    through ``np.memmap`` is resident whole. Raises ValueError (naming the file) if it ends
    first: it was cut short or replaced during the run."""
    done = 0
    while done < len(view):
        if hasattr(os, "preadv"):
            got = os.preadv(file.fileno(), [view[done:]], pos + done)
        else:  # no preadv on this platform: seek and read (a file here has one reader at a time)
            file.seek(pos + done)
            got = file.readinto(view[done:]) or 0
        if got <= 0:
            name = file.name if isinstance(file.name, str) else "the corpus's token file"
            raise ValueError(f"{name} ended at byte {pos + done} while reading tokens: it was truncated or "
                             "replaced during the run; restore it, or re-create it and start a new run")
        done += got


def read_blocks(path: Path, dtype: np.dtype, size: int, block_bytes: int = SCAN_BLOCK):
    """Yield ``path``'s ``size`` tokens of ``dtype`` in consecutive blocks of at most
    ``block_bytes``, each a view of one reused buffer (valid until the next block): memory
    flat in the file's size, read with ``pread_into``. The buffer is an anonymous mapping of
    its own, so the heap's thresholds never see it."""
    item = np.dtype(dtype).itemsize
    step = max(1, block_bytes // item)
    buf = mmap.mmap(-1, step * item)
    with open(path, "rb", buffering=0) as f:
        for i in range(0, size, step):
            n = min(step, size - i)
            pread_into(f, memoryview(buf)[:n * item], i * item)
            yield np.frombuffer(buf, dtype=dtype, count=n)


def scan_tokens(ds: PreparedDataset, sha: bool = False) -> tuple[int, str | None]:
    """(the largest token id, the sha256 of tokens.bin when ``sha``), read in blocks of
    ``SCAN_BLOCK`` bytes (``read_blocks``: memory flat in the dataset's size, none of it
    left resident)."""
    h = hashlib.sha256() if sha else None
    top = 0
    for block in read_blocks(ds.path / TOKENS, ds.tokens.dtype, ds.tokens.size):
        top = max(top, int(block.max()))
        if h is not None:
            h.update(block.data)
    return top, h.hexdigest() if h is not None else None


def check_tokens_in_vocab(ds: PreparedDataset, top: int) -> None:
    """Raise ValueError when tokens.bin holds an id the dataset's own vocabulary lacks
    (meta.json's vocab_size edited down, or tokens.bin written by something else)."""
    if top >= int(ds.meta["vocab_size"]):
        raise ValueError(f"data.path: {ds.path / TOKENS} holds token id {top}, but meta.json says vocab_size "
                         f"{ds.meta['vocab_size']} (ids must be below it); re-create it with "
                         f"`mct prepare ... --out {ds.path}`")


def check_tokens_sha256(ds: PreparedDataset) -> None:
    """Raise ValueError when tokens.bin's sha256 is not the one meta.json recorded
    (the tokens changed in place since ``mct prepare`` wrote them). Reads tokens.bin."""
    top, digest = scan_tokens(ds, sha=True)
    if digest != ds.meta.get("tokens_sha256"):
        raise ValueError(f"data.path: {ds.path / TOKENS} has sha256 {digest[:12]}..., but meta.json recorded "
                         f"{str(ds.meta.get('tokens_sha256'))[:12]}...: its tokens changed since it was prepared; "
                         f"restore it, or re-create it with `mct prepare ... --out {ds.path}` and start a new run")
    check_tokens_in_vocab(ds, top)


class DocumentSpans:
    """Some documents of a flat token array, read as one concatenated 1-D array without
    copying it: ``size``, ``dtype``, ``len()`` and ``view[i]`` for an int, a slice or
    an int array (the sampler's windows). Memory: two int64 per document. A read returns a
    copy; over a file-backed ``np.memmap`` it reads the file (``pread_into``), so no page of
    the file is ever mapped into the process and its resident set does not grow with the
    dataset."""

    ndim = 1

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, file: Any = None) -> None:
        """``file``: the open unbuffered binary file ``tokens`` maps, to read from (a file
        without a name); by default a whole-file ``np.memmap``'s own file is opened."""
        self.tokens, self.starts = tokens, np.asarray(starts, np.int64)
        self.cum = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        self.size = int(self.cum[-1])
        self.shape = (self.size,)
        self.dtype = tokens.dtype
        whole = isinstance(tokens, np.memmap) and isinstance(tokens.base, mmap.mmap) and tokens.filename
        if file is None and whole:
            file = open(tokens.filename, "rb", buffering=0)
        self._file = file

    def __len__(self) -> int:
        return self.size

    def _real(self, idx: np.ndarray) -> np.ndarray:
        if idx.size and (idx.min() < 0 or idx.max() >= self.size):
            raise IndexError(f"index out of range for {self.size} tokens")
        doc = np.searchsorted(self.cum, idx, side="right") - 1
        return self.starts[doc] + (idx - self.cum[doc])

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            return self[np.arange(*key.indices(self.size), dtype=np.int64)]
        real = self._real(np.asarray(key, dtype=np.int64))
        if self._file is None:
            return np.asarray(self.tokens[real])
        return self._pread(real)

    def _pread(self, real: np.ndarray) -> np.ndarray:
        """``tokens[real]`` read from the file (``pread_into``), a call per run of
        consecutive positions, straight into the result."""
        flat = real.reshape(-1)
        out = np.empty(flat.size, self.dtype)
        if not flat.size:
            return out.reshape(real.shape)
        item, base = self.dtype.itemsize, int(self.tokens.offset)
        cuts = np.flatnonzero(np.diff(flat) != 1) + 1
        view = memoryview(out.view(np.uint8))
        for a, b in zip(np.concatenate([[0], cuts]).tolist(), np.concatenate([cuts, [flat.size]]).tolist()):
            pread_into(self._file, view[a * item:b * item], base + int(flat[a]) * item)
        return out.reshape(real.shape)

    def tobytes(self) -> bytes:
        """All tokens as bytes (reads the whole split: for tests and small data)."""
        return self[:].tobytes()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """``np.asarray(spans)``: every token, read into a new array (the whole split)."""
        out = self[:]
        return out if dtype is None else out.astype(dtype, copy=False)


def doc_hash(seed: int, n: int) -> np.ndarray:
    """Stable uniform numbers in [0, 1) for documents 0..n-1 of a seed: splitmix64 of
    (seed, index), vectorized (a million documents in milliseconds, no Python loop)."""
    def mix(z: np.ndarray) -> np.ndarray:
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))
    with np.errstate(over="ignore"):
        key = mix(np.array([seed % 2**64], dtype=np.uint64))[0]
        z = mix(np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + key)
    return (z >> np.uint64(11)).astype(np.float64) / 2.0**53
