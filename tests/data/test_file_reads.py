"""A training process reads token files without holding them: a prepared dataset's and a
.bin's splits are ``DocumentSpans`` read with ``pread`` and the scans at load read blocks the
same way, so no page of the file is mapped into the process and its resident set does not
grow with the dataset. Checked exactly on the file's own mapping in /proc/self/smaps."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from mct.data import BatchSampler, Corpus, load_corpus
from mct.data.dataset import DocumentSpans, open_prepared, read_blocks
from mct.data.pipeline import prepare
from mct.data.spool import TokenSpool

needs_smaps = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps (Linux)")


def _mapped_kib(path: Path | int) -> int:
    """Resident KiB of this process's mappings of ``path`` (or of the open file descriptor
    ``path``), found by inode; 0 when not mapped."""
    st = os.fstat(path) if isinstance(path, int) else os.stat(path)
    total, current = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            current = len(head) >= 5 and head[4] == str(st.st_ino) and head[4] != "0"
        elif current and line.startswith("Rss:"):
            total += int(head[1])
    return total


def _dataset(tmp_path: Path, docs: int = 24, chars: int = 40_000) -> Path:
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    for i in range(docs):
        (tmp_path / f"d{i:03d}.txt").write_text(" ".join(rng.choice(words, chars // 5)))
    prepare([str(tmp_path)], str(tmp_path / "ds"), progress=False)
    return tmp_path / "ds"


def _draw(corpus: Corpus, steps: int = 20) -> list:
    s = BatchSampler(corpus, seq_len=64, micro_batch_size=8, grad_accum=1, world_size=1, seed=3)
    return [s.batch(i, 0, 0) for i in range(steps)] + [s.val_batch(i) for i in range(3)]


@needs_smaps
def test_a_prepared_dataset_leaves_no_page_of_its_tokens_resident_after_load_and_batches(tmp_path):
    ds = _dataset(tmp_path)
    corpus = load_corpus(str(ds), seed=0, val_fraction=0.2, seq_len=64)
    _draw(corpus)
    size_kib = (ds / "tokens.bin").stat().st_size // 1024
    assert size_kib > 1500
    # before: the load's scan alone mapped the whole file (every page it read stayed resident)
    assert _mapped_kib(ds / "tokens.bin") <= 8, f"{_mapped_kib(ds / 'tokens.bin')} KiB of {size_kib} resident"


@needs_smaps
def test_a_bin_corpus_is_neither_copied_nor_left_resident(tmp_path):
    path = tmp_path / "toks.bin"
    np.random.default_rng(1).integers(0, 500, size=1_500_000).astype("<u2").tofile(path)
    corpus = load_corpus(str(path), seed=1, val_fraction=0.2, seq_len=64)
    assert isinstance(corpus.train, DocumentSpans) and isinstance(corpus.val, DocumentSpans)
    _draw(corpus)
    assert _mapped_kib(path) <= 8


def test_a_bin_corpus_keeps_its_fingerprint_split_and_tokens(tmp_path):
    """The fingerprint of a .bin is the one a run recorded before it was read in place
    (a resume compares it), and its splits hold the same tokens in the same order."""
    tokens = np.random.default_rng(0).integers(0, 1000, size=5000).astype("<u2")
    tokens.tofile(tmp_path / "fp.bin")
    c = load_corpus(str(tmp_path / "fp.bin"), seed=1, val_fraction=0.3, seq_len=32, doc_bytes=500)
    assert c.fingerprint == "b2684a2f14d8dfe7e4f410a4fddcfaacc0dde2be2cd989fd9377a00ccabd080b"
    assert c.min_vocab_size == int(tokens.max()) + 1 and c.metadata()["dtype"] == "uint16"
    pieces = {f"fp.bin#{i}": tokens[i * 500:(i + 1) * 500] for i in range(10)}
    assert np.array_equal(c.train[:], np.concatenate([pieces[n] for n in c.train_files]))
    assert np.array_equal(c.val[:], np.concatenate([pieces[n] for n in c.val_files]))
    assert c.bounds("train").tolist() == [500 * i for i in range(len(c.train_files) + 1)]


def test_pread_reads_what_the_mapping_holds_across_document_boundaries(tmp_path):
    ds = _dataset(tmp_path, docs=12, chars=3000)
    corpus = load_corpus(str(ds), seed=0, val_fraction=0.3, seq_len=64)
    spans = corpus.train
    assert spans._file is not None  # the pread path, not the mapping
    mapped = DocumentSpans(np.asarray(spans.tokens), spans.starts, np.diff(spans.cum))
    assert mapped._file is None
    rng = np.random.default_rng(5)
    windows = rng.integers(0, spans.size - 200, size=40)[:, None] + np.arange(200)  # many cross a boundary
    assert np.array_equal(spans[windows], mapped[windows])
    assert np.array_equal(spans[::-7], mapped[::-7]) and np.array_equal(spans[3:spans.size], mapped[3:])
    assert spans[17] == mapped[17] and spans[np.array([], dtype=np.int64)].size == 0
    assert np.array_equal(spans[np.array([9, 9, 2, 3, 4, 0])], mapped[np.array([9, 9, 2, 3, 4, 0])])
    with pytest.raises(IndexError):
        spans[np.array([spans.size])]


def test_a_token_file_cut_short_during_a_run_is_a_clear_error(tmp_path):
    path = tmp_path / "toks.bin"
    np.arange(20_000, dtype="<u2").__mod__(300).astype("<u2").tofile(path)
    corpus = load_corpus(str(path), seed=0, val_fraction=0.2, seq_len=16, doc_bytes=1000)
    os.truncate(path, 2000)
    with pytest.raises(ValueError, match="toks.bin ended at byte .* truncated or replaced during the run"):
        corpus.train[corpus.train.size - 5:]


def test_read_blocks_cover_the_file_in_order_whatever_the_block_size(tmp_path):
    ds = _dataset(tmp_path, docs=5, chars=2000)
    whole = np.asarray(open_prepared(ds).tokens)
    for block in (2, 3, 4096, 1 << 22):
        got = np.concatenate([b.copy() for b in read_blocks(ds / "tokens.bin", whole.dtype, whole.size, block)])
        assert np.array_equal(got, whole), block


def _text_dir(root: Path) -> Path:
    rng = np.random.default_rng(2)
    for i in range(30):
        (root / f"f{i:02d}.txt").write_text(" ".join(rng.choice(["one", "two", "three", "four"], 3000)))
    return root


@needs_smaps
def test_a_text_corpus_is_read_from_an_unnamed_file_and_never_resident(tmp_path, monkeypatch):
    monkeypatch.setenv("MCT_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "text").mkdir()
    corpus = load_corpus(str(_text_dir(tmp_path / "text")), seed=0, val_fraction=0.2, seq_len=64)
    assert isinstance(corpus.train, DocumentSpans) and corpus.train._file is corpus.val._file
    fd = corpus.train._file.fileno()
    assert os.fstat(fd).st_nlink == 0 and os.listdir(tmp_path / "cache") == []  # nothing left behind
    assert os.fstat(fd).st_size == corpus.train.size + corpus.val.size
    _draw(corpus)
    assert _mapped_kib(fd) <= 8


def test_a_text_corpus_spooled_or_in_memory_gives_the_same_run(tmp_path, monkeypatch):
    """Where the cache directory cannot hold the file (here a regular file), the tokens stay
    in memory; either way the same tokens, bounds, fingerprint and batches."""
    root = tmp_path / "text"
    root.mkdir()
    _text_dir(root)
    monkeypatch.setenv("MCT_CACHE_DIR", str(tmp_path / "cache"))
    spooled = load_corpus(str(root), seed=4, val_fraction=0.25, seq_len=32)
    (tmp_path / "blocked").write_text("a file, not a directory")
    monkeypatch.setenv("MCT_CACHE_DIR", str(tmp_path / "blocked"))
    kept = load_corpus(str(root), seed=4, val_fraction=0.25, seq_len=32)
    assert spooled.train._file is not None and kept.train._file is None  # pread / memory
    assert spooled.fingerprint == kept.fingerprint and spooled.train_files == kept.train_files
    assert spooled.train.tobytes() == kept.train.tobytes() and spooled.val.tobytes() == kept.val.tobytes()
    for split in ("train", "val"):
        assert np.array_equal(spooled.bounds(split), kept.bounds(split))
    for packing in ("stream", "documents"):
        a, b = (BatchSampler(c, seq_len=32, micro_batch_size=4, grad_accum=2, world_size=2, seed=9, packing=packing)
                for c in (spooled, kept))
        for step in range(3):
            for rank in range(2):
                for x, y in zip(a.micro_batches(step, rank), b.micro_batches(step, rank)):
                    assert all(torch.equal(u, v) for u, v in zip(x, y))
        assert all(torch.equal(u, v) for u, v in zip(a.val_batch(1), b.val_batch(1)))


def test_a_spool_whose_disk_fills_up_goes_on_in_memory_with_every_byte(tmp_path, monkeypatch):
    monkeypatch.setenv("MCT_CACHE_DIR", str(tmp_path / "cache"))
    spool = TokenSpool()
    spool.add(b"first document ")
    assert spool.on_disk

    class Full:  # the file as a full disk leaves it: reads work, writes fail
        def __init__(self, f):
            self.f, self.name = f, f.name

        def write(self, data):
            raise OSError(28, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

    spool._file = Full(spool._file)
    spool.add(b"second one")
    assert not spool.on_disk and spool.size == 25
    assert spool.read(0, 25).tobytes() == b"first document second one"
    spans = spool.spans(np.array([15, 0]), np.array([10, 15]))
    assert spans.tobytes() == b"second onefirst document "


def test_a_platform_without_preadv_reads_the_same_tokens(tmp_path, monkeypatch):
    ds = _dataset(tmp_path, docs=6, chars=2000)
    corpus = load_corpus(str(ds), seed=0, val_fraction=0.3, seq_len=32)
    windows = np.arange(0, corpus.train.size - 100, 97)[:, None] + np.arange(40)
    want = corpus.train[windows]
    monkeypatch.delattr(os, "preadv")
    assert np.array_equal(corpus.train[windows], want)
    assert np.array_equal(load_corpus(str(ds), seed=0, val_fraction=0.3, seq_len=32).train[windows], want)


def test_a_split_reads_whole_into_numpy_as_the_array_it_was(tmp_path, monkeypatch):
    monkeypatch.setenv("MCT_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "a.txt").write_text("hello world, " * 4000)
    c = load_corpus(str(tmp_path / "a.txt"), seed=0, val_fraction=0.5, seq_len=8)
    whole = np.asarray(c.train)
    assert whole.dtype == np.uint8 and whole.tobytes() == c.train.tobytes() and int(whole.max()) == ord("w")
    assert np.asarray(c.train, dtype=np.int64).dtype == np.int64


def test_a_write_that_fails_halfway_keeps_each_byte_once(tmp_path, monkeypatch):
    """A disk that fills in the middle of a document: what reached the file of that document
    is not counted twice when the spool moves to memory."""
    monkeypatch.setenv("MCT_CACHE_DIR", str(tmp_path / "cache"))
    spool = TokenSpool()
    spool.add(b"abc")

    class Half:
        def __init__(self, f):
            self.f, self.name, self.calls = f, f.name, 0

        def write(self, data):
            self.calls += 1
            if self.calls == 1:
                return self.f.write(bytes(data[:2]))
            raise OSError(28, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

    spool._file = Half(spool._file)
    spool.add(b"defg")
    assert not spool.on_disk and spool.size == 7 and spool.read(0, 7).tobytes() == b"abcdefg"
