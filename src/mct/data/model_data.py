"""``data.path`` for a Hugging Face model (``model.source = 'hf:DIR'``): the tokens are the model's.

- Raw text, JSON Lines or parquet (a file or a directory, as ``mct prepare`` reads them:
  JSON Lines by their ``text`` field, never their JSON syntax) is tokenized with DIR's own
  ``tokenizer.json``, special tokens placed as that tokenizer places them, each document
  ended by its EOS. This is ``mct prepare --tokenizer DIR`` (``pipeline.prepare``, the one
  implementation), run once into a cache beside the data,
  ``PARENT/.mct-tokens/KEY/`` where KEY hashes the inputs' content, the tokenizer's files,
  the text field and the split (never a path: moved or renamed inputs hit the cache). A
  file lock makes every rank of a run (and concurrent runs) wait for one writer.
- A prepared dataset trains as it is, unless it holds UTF-8 bytes (``--tokenizer bytes``)
  and DIR's vocabulary is not bytes: refused. Another tokenizer's dataset is compared by
  content (``tokenizer_identity``), never by path; the run warns about it at start.
- A DIR with no tokenizer files at all (a model whose vocabulary is bytes) keeps the byte
  corpus of ``load_corpus``; a DIR whose tokenizer is not a ``tokenizer.json``
  (``tokenizer.model``, ``vocab.json``) is refused for raw text, naming ``mct prepare``.
- A ``.bin`` of token ids is read as it is (its tokenizer is unknown).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from mct.data.corpus import Corpus, load_corpus, load_prepared
from mct.data.dataset import DATASET_FORMAT, is_prepared, looks_partial, open_prepared
from mct.data.sources import expand_inputs
from mct.data.tokenizer import bytes_tokenizer_json, tokenizer_identity

CACHE_DIR = ".mct-tokens"
"""The cache of tokenized data, beside ``data.path``."""
TEXT_FIELD = "text"
"""The JSON Lines / parquet field read (``mct prepare --text-field`` prepares another)."""
OTHER_TOKENIZERS = ("tokenizer.model", "vocab.json", "merges.txt", "spiece.model", "vocab.txt")
"""Tokenizer files of a model directory that mct does not read (it reads tokenizer.json)."""


def model_corpus(path: str, model_dir: str, *, seed: int, val_fraction: float, seq_len: int) -> Corpus:
    """The Corpus of ``path`` (``data.path``) for the model of ``model_dir``, tokenized
    by its own tokenizer (see the module docstring). May write the cache beside
    ``path``. Raises ValueError (one line) for data the model cannot train on and what
    ``load_corpus`` / ``mct prepare`` raise for the data itself."""
    d = Path(model_dir)
    own = d / "tokenizer.json"
    p = Path(path).expanduser()
    raw = path != "" and not is_prepared(p) and not looks_partial(p) and not (p.is_file() and p.suffix == ".bin")
    if not own.is_file():
        other = [n for n in OTHER_TOKENIZERS if (d / n).is_file()]
        if other and raw:
            raise ValueError(f"data.path = {path!r} is text, and hf:{model_dir} has no tokenizer.json to tokenize it "
                             f"with (only {', '.join(other)}); save one (AutoTokenizer.from_pretrained(DIR)"
                             f".save_pretrained(DIR)) or prepare the data with `mct prepare {path} --tokenizer "
                             f"TOKENIZER.json --out DS` and set data.path=DS")
        return load_corpus(path, seed=seed, val_fraction=val_fraction, seq_len=seq_len)
    identity = tokenizer_identity(_read(own))
    byte_level = identity in {tokenizer_identity(bytes_tokenizer_json(eos=e)) for e in (False, True)}
    if is_prepared(p) and not byte_level and open_prepared(p).meta.get("tokenizer") == "bytes":
        raise ValueError(f"data.path = {path!r} holds UTF-8 bytes (mct prepare --tokenizer bytes), but hf:{model_dir} "
                         f"reads the ids of its own tokenizer.json; prepare the inputs with `mct prepare INPUT "
                         f"--tokenizer {model_dir} --out DS` and set data.path=DS")
    if not raw or byte_level:
        return load_corpus(path, seed=seed, val_fraction=val_fraction, seq_len=seq_len)
    return load_prepared(tokenized(path, d), seed=seed, val_fraction=val_fraction, seq_len=seq_len, cut_lone=True)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read the model's tokenizer ({e}); fix or replace the file") from None


def tokenized(path: str, model_dir: Path) -> Path:
    """The prepared dataset of text ``path`` under ``model_dir``'s tokenizer: from the
    cache, or written there now (one line on stderr says so). Raises ValueError for a
    path that is missing, blank or the stdlib default, an unwritable cache, and what
    ``mct prepare`` raises."""
    fix = f"`mct prepare {path or 'INPUT'} --tokenizer {model_dir} --out DS` and set data.path=DS"
    if not path.strip():
        raise ValueError(f"data.path = {path!r}: an hf: model with a tokenizer trains on your text; set data.path to "
                         f"a text file, JSON Lines or parquet file, or a directory of them (or prepare it: {fix})")
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"data.path = {path!r} does not exist; point it at a text, JSON Lines or parquet file, or a "
                         f"directory of them")
    root = p.absolute().parent / CACHE_DIR
    try:
        root.mkdir(exist_ok=True)
    except OSError as e:
        raise ValueError(f"data.path = {path!r}: the tokens of hf:{model_dir} are cached beside it, but {root} "
                         f"cannot be created ({e.strerror}); prepare them elsewhere with {fix}") from None
    key = cache_key(path, model_dir)
    out = root / key[:32]
    with _locked(root / f"{key[:32]}.lock"):
        if not is_prepared(out):
            print(f"mct: tokenizing {path} with hf:{model_dir}'s tokenizer into {out} (once: runs on the same text "
                  f"and tokenizer reuse it)", file=sys.stderr, flush=True)
            from mct.data.pipeline import prepare  # the mct prepare pipeline (imports tqdm)
            try:
                prepare([path], str(out), tokenizer=str(model_dir), text_field=TEXT_FIELD, progress=False)
            except ValueError as e:
                hint = (f"; mct train reads the {TEXT_FIELD!r} field: for another, prepare the data with "
                        f"{fix.replace('--out', '--text-field NAME --out')}" if "--text-field" in str(e) else "")
                raise ValueError(f"data.path: {e}{hint}") from None
    return out


def cache_key(path: str, model_dir: Path) -> str:
    """sha256 over what the tokens depend on: the dataset format, the tokenizer's files,
    the text field, and each input's kind and content in reading order (no path)."""
    h = hashlib.sha256(f"{DATASET_FORMAT}\0{TEXT_FIELD}\0file\0".encode())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        f = model_dir / name
        h.update(hashlib.sha256(f.read_bytes()).digest() if f.is_file() else b"-")
    for src in expand_inputs([path]):
        h.update(f"\0{src.kind}\0{src.size}\0".encode())
        try:
            with open(src.path, "rb") as f:
                h.update(hashlib.file_digest(f, "sha256").digest())
        except OSError as e:
            raise ValueError(f"data.path: cannot read {src.path} ({e.strerror}); fix its permissions") from None
    return h.hexdigest()


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created) for the block: one writer of a cache entry."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
