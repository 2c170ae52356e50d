"""Tokenizers of ``mct prepare``: ``bytes``, a Hugging Face ``tokenizer.json`` (a file or
a directory holding one), or ``train:VOCAB`` (a byte-level BPE trained offline on the
inputs with the ``tokenizers`` library). All of them are written out as a
``tokenizer.json`` that the ``tokenizers`` library (and ``transformers``) loads as is.

Ids: ``bytes`` keeps today's ids (a token is a UTF-8 byte, 0..255) and adds EOS = 256;
a trained BPE has EOS = 0 and the 256 bytes next; a user's tokenizer keeps its ids and
its EOS (found by name, else ``<|endoftext|>`` is added). A user's tokenizer places its
special tokens as it places them itself: the ids its post-processor puts around a text
(a model's BOS; ``add_bos_token`` / ``add_eos_token`` of tokenizer_config.json override
it, as transformers' tokenizers do) are ``Tokenizer.prefix`` / ``suffix``, put around each
document; the EOS ends it (once: a suffix that ends with it is not doubled). ``bytes`` and
``train`` add no template. Text that spells a special token is encoded as text, so
decoding a document's ids (without its template and EOS) gives its text back exactly for
``bytes`` and ``train``. ``tokenizer_identity`` names a tokenizer by what it maps (its
model and added tokens), never by its path or its file's bytes.

Nothing here reads the network: ``tokenizers`` builds everything from local files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np

if TYPE_CHECKING:
    from mct.data.corpus import Corpus

EOS_TOKEN = "<|endoftext|>"
EOS_NAMES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>")
"""Names tried, in order, for the EOS of a user's tokenizer without tokenizer_config.json."""
MIN_TRAIN_VOCAB = 257
"""``train:VOCAB`` needs the 256 bytes and EOS."""
MAX_TRAIN_VOCAB = 1 << 20
"""``train:VOCAB`` above this is refused: the trainer's tables grow with VOCAB (and no
language model has more than a few hundred thousand ids)."""
MAX_WORD_BYTES = 128
"""A trained BPE cuts each pre-token (a word) into pieces of at most this many bytes
before merging: a megabyte without a space is then many words, not one, so training and
encoding stay linear in the text (merges never span more than this)."""
_PIECE_PROBES = ("Hello, world.\nThe next line, with words.", "x.\ny", "a b\nc d", "12 345\n678 9",
                 "日本語のテキスト\n次の行", "don't\n's and 've", "def f(x):\n    return x\nprint(f(1))",
                 "Ünïcödé wörds\nflow on")
"""Texts on which a tokenizer must encode ``a | b`` (cut by textstream.cut_ok) as ``ab``."""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the ByteLevel alphabet of ``tokenizers``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


# tokenizers (the Rust library) is loaded where a tokenizer other than the built-in bytes
# is used: the byte corpus of `mct train` never loads it.
def _byte_level(tok: Any, use_regex: bool) -> Any:
    from tokenizers import decoders, pre_tokenizers
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)
    tok.decoder = decoders.ByteLevel()
    return tok


def bytes_tokenizer_json(eos: bool = True) -> str:
    """tokenizer.json whose ids are the UTF-8 bytes 0..255 (no merges), plus EOS = 256
    when ``eos``: what ``bytes`` (and the byte corpus of ``mct train``) encode. Written
    here, not by ``tokenizers`` (about 3 MiB resident once loaded, kept out of a training
    process whose corpus is bytes): the same string as a byte-level BPE of those 256 ids
    serialized by the library (``Tokenizer.to_str()``; tests/data/test_prepare.py holds
    them equal), so the library and transformers load it as theirs."""
    table = bytes_to_unicode()
    added = [{"id": 256, "content": EOS_TOKEN, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True}] if eos else []
    doc = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
           "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                             "use_regex": False},
           "post_processor": None,
           "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                     "ignore_merges": False, "vocab": {table[b]: b for b in range(256)}, "merges": []}}
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":"))


@dataclass
class Tokenizer:
    """A resolved tokenizer: ``kind`` ("bytes" | "file" | "train"), its ``json`` (what
    tokenizer.json holds), ``vocab_size`` (ids are < it), ``eos_id``, ``source`` (the
    spec as given), ``pieces_ok`` (it encodes a text cut where textstream.py cuts a big
    document as it encodes the whole). Picklable (workers rebuild the library object
    from ``json``)."""

    kind: str
    json: str
    vocab_size: int
    eos_id: int
    source: str
    pieces_ok: bool = True
    prefix: tuple[int, ...] = ()
    """Ids put before each document (the model's BOS), as the tokenizer places them."""
    suffix: tuple[int, ...] = ()
    """Ids put after each document's text, before its EOS (an EOS last here is not doubled)."""

    def closing(self) -> tuple[int, ...]:
        """What ends a document: ``suffix`` then EOS, EOS once."""
        return self.suffix if self.suffix[-1:] == (self.eos_id,) else (*self.suffix, self.eos_id)

    @property
    def dtype(self) -> np.dtype:
        """uint16 when every id fits (vocab <= 65536), else uint32; little-endian."""
        return np.dtype("<u2" if self.vocab_size <= 65536 else "<u4")

    def encoder(self) -> "Encoder":
        return Encoder(self)


class Encoder:
    """Encodes and decodes with one Tokenizer in this process (built once)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self._hf = None
        if tok.kind != "bytes":
            from tokenizers import Tokenizer as HF
            self._hf = HF.from_str(tok.json)
            self._hf.encode_special_tokens = True  # a document that spells "<|endoftext|>" stays text

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Texts -> int64 id arrays (no EOS, no template tokens)."""
        if self._hf is None:
            return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in texts]
        return [np.asarray(e.ids, dtype=np.int64) for e in self._hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text, special tokens kept (so EOS shows as its name)."""
        arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64).reshape(-1)
        if self._hf is None and (arr.size == 0 or int(arr.max()) < 256):  # vectorized: a piece is a megabyte
            return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
        from tokenizers import Tokenizer as HF
        hf = self._hf or HF.from_str(self.tok.json)
        return hf.decode(arr.tolist(), skip_special_tokens=False)


def _tokenizer_config(d: Path) -> dict[str, Any]:
    """tokenizer_config.json of directory ``d`` as a dict ({} when absent or unreadable)."""
    try:
        cfg = json.loads((d / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _token_name(cfg: dict[str, Any], key: str) -> str | None:
    """The name of special token ``key`` ('eos_token', 'bos_token') in a tokenizer config."""
    tok = cfg.get(key)
    return tok.get("content") if isinstance(tok, dict) else tok if isinstance(tok, str) else None


def _template(hf: Any, cfg: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(prefix, suffix): the ids ``hf``'s post-processor puts before and after a text,
    with ``add_bos_token`` / ``add_eos_token`` of ``cfg`` (tokenizer_config.json)
    adding or removing the BOS / EOS, as transformers' tokenizers read them."""
    enc = hf.encode("a", add_special_tokens=True)
    mask = enc.special_tokens_mask
    first = mask.index(0) if 0 in mask else len(mask)
    last = len(mask) - mask[::-1].index(0) if 0 in mask else len(mask)
    prefix, suffix = list(enc.ids[:first]), list(enc.ids[last:])
    for key, ids, at in (("bos", prefix, 0), ("eos", suffix, -1)):
        want, name = cfg.get(f"add_{key}_token"), _token_name(cfg, f"{key}_token")
        tid = hf.token_to_id(name) if name else None
        if not isinstance(want, bool) or tid is None:
            continue
        has = bool(ids) and ids[at] == tid
        if want and not has:
            ids.insert(0 if at == 0 else len(ids), tid)
        elif has and not want:
            ids.pop(at)
    return tuple(prefix), tuple(suffix)


def tokenizer_identity(text: str) -> str:
    """sha256 of what a tokenizer.json (``text``) maps: its ``model`` (vocabulary, merges)
    and ``added_tokens``, in a canonical form (key order and the two spellings of BPE
    merges do not count). Two files of the same identity give every token the same id.
    Raises ValueError for text that is not a tokenizer.json object."""
    try:
        d = json.loads(text)
        model, added = d["model"], d.get("added_tokens") or []
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"not a tokenizer.json ({type(e).__name__}: {e})") from None
    if isinstance(model, dict) and isinstance(model.get("merges"), list):
        model = {**model, "merges": [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]}
    added = sorted(({"id": a.get("id"), "content": a.get("content"), "special": a.get("special")}
                    for a in added if isinstance(a, dict)), key=lambda a: (str(a["id"]), str(a["content"])))
    canon = json.dumps({"model": model, "added_tokens": added}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()


def _from_file(spec: str) -> Tokenizer:
    from tokenizers import AddedToken, Tokenizer as HF
    p = Path(spec).expanduser()
    f = p / "tokenizer.json" if p.is_dir() else p
    if not f.is_file():
        raise ValueError(f"--tokenizer {spec!r}: no tokenizer.json there; pass 'bytes', 'train:VOCAB', a "
                         f"tokenizer.json file or a directory holding one")
    try:
        hf = HF.from_file(str(f))
    except Exception as e:  # the library raises its own Exception type for any malformed file
        raise ValueError(f"--tokenizer {spec!r}: {f} is not a tokenizer.json the tokenizers library reads "
                         f"({str(e).splitlines()[0][:160]}); pass a valid one") from None
    cfg = _tokenizer_config(f.parent)
    names = [n for n in [_token_name(cfg, "eos_token"), *EOS_NAMES] if n]
    eos = next((hf.token_to_id(n) for n in names if hf.token_to_id(n) is not None), None)
    if eos is None:  # documents need a separator: add one, recorded in the dataset's tokenizer.json
        hf.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False)])
        eos = hf.token_to_id(EOS_TOKEN)
    # ids may be sparse: the model needs max id + 1 rows, not the number of tokens
    vocab_size = max(hf.get_vocab(with_added_tokens=True).values()) + 1
    prefix, suffix = _template(hf, cfg)
    return Tokenizer(kind="file", json=hf.to_str(), vocab_size=vocab_size, eos_id=int(eos), source=spec,
                     prefix=prefix, suffix=suffix)


def _pieces_ok(tok: Tokenizer) -> bool:
    """Whether ``tok`` encodes each probe text cut at every allowed place as the whole."""
    from mct.data.textstream import cut_ok
    enc = Encoder(tok)
    for text in _PIECE_PROBES:
        raw = text.encode("utf-8")
        whole = enc.encode_batch([text])[0].tolist()
        for i in (i for i in range(1, len(raw)) if cut_ok(raw, i)):
            a, b = enc.encode_batch([raw[:i].decode("utf-8"), raw[i:].decode("utf-8")])
            if a.tolist() + b.tolist() != whole:
                return False
    return True


def parse_train_vocab(spec: str) -> int:
    """``train:VOCAB`` -> VOCAB. Raises ValueError for a malformed or too small size."""
    text = spec.split(":", 1)[1]
    try:
        vocab = int(text)
    except ValueError:
        raise ValueError(f"--tokenizer {spec!r}: VOCAB must be an integer, e.g. train:8192") from None
    if not MIN_TRAIN_VOCAB <= vocab <= MAX_TRAIN_VOCAB:
        raise ValueError(f"--tokenizer {spec!r}: VOCAB must be in [{MIN_TRAIN_VOCAB}, {MAX_TRAIN_VOCAB}] (256 bytes + "
                         f"EOS at least; the trainer's memory grows with VOCAB), e.g. train:8192")
    return vocab


def train_bpe(texts: Iterable[str], vocab: int, spec: str = "", progress: bool = False) -> Tokenizer:
    """A byte-level BPE of at most ``vocab`` ids (fewer when the texts have no more
    merges) trained on ``texts`` (streamed once; the library's progress bars when
    ``progress``). EOS = 0, then the 256 bytes. Words are cut to ``MAX_WORD_BYTES``."""
    from tokenizers import Regex, Tokenizer as HF, models, pre_tokenizers, trainers
    hf = _byte_level(HF(models.BPE()), use_regex=True)
    hf.pre_tokenizer = pre_tokenizers.Sequence([hf.pre_tokenizer, pre_tokenizers.Split(
        Regex(f".{{1,{MAX_WORD_BYTES}}}"), behavior="isolated")])  # ByteLevel made every byte one char
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS_TOKEN], show_progress=progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(kind="train", json=hf.to_str(), vocab_size=hf.get_vocab_size(with_added_tokens=True),
                     eos_id=int(hf.token_to_id(EOS_TOKEN)), source=spec or f"train:{vocab}")


def resolve_tokenizer(spec: str, texts: Any = None, progress: bool = False) -> Tokenizer:
    """``bytes`` | ``train:VOCAB`` | a tokenizer.json file or directory -> Tokenizer.
    ``texts``: a callable returning an iterable of document texts, read only to train.
    Raises ValueError (naming the spec and the fix) for anything else."""
    if spec == "bytes":
        return Tokenizer(kind="bytes", json=bytes_tokenizer_json(), vocab_size=257, eos_id=256, source=spec)
    if spec.startswith("train:"):
        vocab = parse_train_vocab(spec)
        assert texts is not None, "training a tokenizer needs the documents"
        tok = train_bpe(texts(), vocab, spec, progress)
    elif not spec.strip():
        raise ValueError("--tokenizer is blank; pass 'bytes', 'train:VOCAB', or a tokenizer.json file or directory")
    else:
        tok = _from_file(spec)
    tok.pieces_ok = _pieces_ok(tok)
    return tok


def copy_tokenizer(corpus: Corpus, run_dir: str | os.PathLike) -> Path | None:
    """Put the tokenizer that decodes ``corpus``'s ids at ``RUN_DIR/tokenizer.json``: a
    prepared dataset's own, or the byte tokenizer (ids 0..255) of a text corpus. A
    ``.bin`` corpus has no known tokenizer: nothing is written and None returned.
    Writes through a temporary name, so the file is whole or absent."""
    dst = Path(run_dir) / "tokenizer.json"
    tmp = dst.with_name(f".tokenizer.json.tmp{os.getpid()}")
    if corpus.tokenizer_path:
        shutil.copyfile(corpus.tokenizer_path, tmp)
    elif corpus.train.dtype == np.uint8:
        tmp.write_text(bytes_tokenizer_json(eos=False))
    else:
        return None
    os.replace(tmp, dst)
    return dst
