"""Data pipeline contracts: file-level split, no val leakage, stateless per-rank sampler."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mct.data import corpus as data_mod
from mct.config import EngineConfig
from mct.data import BatchSampler, ByteTokenizer, Corpus, build_data, load_corpus


def _write_files(root: Path, n: int, size: int = 200) -> dict[str, bytes]:
    """n files, each filled with its own marker text, in nested dirs; returns rel -> content."""
    out = {}
    for i in range(n):
        rel = f"d{i % 7}/f{i:04d}.txt"
        marker = f"<file {i:04d}>"
        content = (marker * (size // len(marker) + 1))[:size].encode()
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(content)
        out[rel] = content
    return out


def _contains(haystack: np.ndarray, needle: bytes) -> bool:
    return needle in haystack.tobytes()


def _sampler(corpus: Corpus, **kw) -> BatchSampler:
    args = dict(seq_len=16, micro_batch_size=4, grad_accum=3, world_size=2, seed=7)
    args.update(kw)
    return BatchSampler(corpus, **args)


# --- tokenizer ---------------------------------------------------------------------

def test_byte_tokenizer_round_trips_unicode_and_replaces_invalid_bytes():
    tok = ByteTokenizer()
    ids = tok.encode("héllo, wörld ✓")
    assert ids.dtype == np.uint8 and tok.vocab_size == 256
    assert tok.decode(ids) == "héllo, wörld ✓"
    assert tok.decode(torch.tensor([104, 0xFF, 105])) == "h\ufffdi"
    with pytest.raises(ValueError, match="must be in \\[0, 256\\)"):
        tok.decode([300])


# --- split ---------------------------------------------------------------------------

def test_split_is_by_file_disjoint_and_covers_all_files(tmp_path):
    files = _write_files(tmp_path, 50)
    c = load_corpus(str(tmp_path), seed=1, val_fraction=0.2, seq_len=8)
    assert set(c.train_files).isdisjoint(c.val_files)
    assert set(c.train_files) | set(c.val_files) == set(files)
    assert c.train.size + c.val.size == sum(len(b) for b in files.values())
    assert c.train.dtype == np.uint8 and c.val.dtype == np.uint8
    assert c.train_files == sorted(c.train_files)  # file order kept


def test_val_fraction_is_roughly_respected_on_200_files(tmp_path):
    _write_files(tmp_path, 200, size=40)
    for frac in (0.1, 0.5):
        c = load_corpus(str(tmp_path), seed=3, val_fraction=frac, seq_len=8)
        assert abs(len(c.val_files) / 200 - frac) < 0.08, (frac, len(c.val_files))


def test_split_is_stable_across_loads_and_changes_with_seed(tmp_path):
    _write_files(tmp_path, 60)
    a = load_corpus(str(tmp_path), seed=11, val_fraction=0.3, seq_len=8)
    b = load_corpus(str(tmp_path), seed=11, val_fraction=0.3, seq_len=8)
    other = load_corpus(str(tmp_path), seed=12, val_fraction=0.3, seq_len=8)
    assert a.val_files == b.val_files and a.fingerprint == b.fingerprint
    np.testing.assert_array_equal(a.train, b.train)
    assert other.val_files != a.val_files and other.fingerprint != a.fingerprint


def test_split_hash_is_sha256_based_not_python_hash():
    # Fixed expected value: Python's hash() is salted per process and would not match.
    import hashlib
    digest = hashlib.sha256(b"5\x00a/b.txt").digest()
    assert data_mod.split_hash(5, "a/b.txt") == int.from_bytes(digest[:8], "big") / 2.0**64


def test_each_split_gets_at_least_one_file_even_when_the_hash_gives_none(tmp_path):
    _write_files(tmp_path, 3)
    lo = load_corpus(str(tmp_path), seed=0, val_fraction=1e-9, seq_len=8)
    hi = load_corpus(str(tmp_path), seed=0, val_fraction=1 - 1e-9, seq_len=8)
    assert len(lo.val_files) == 1 and len(lo.train_files) == 2
    assert len(hi.train_files) == 1 and len(hi.val_files) == 2


def test_fingerprint_changes_when_content_changes(tmp_path):
    _write_files(tmp_path, 10)
    a = load_corpus(str(tmp_path), seed=1, val_fraction=0.3, seq_len=8)
    p = tmp_path / "d0/f0000.txt"
    p.write_bytes(p.read_bytes().replace(b"<", b">"))  # same size, same names
    b = load_corpus(str(tmp_path), seed=1, val_fraction=0.3, seq_len=8)
    assert a.fingerprint != b.fingerprint


def test_directory_skips_binary_and_hidden_files(tmp_path):
    files = _write_files(tmp_path, 5)
    (tmp_path / "blob.dat").write_bytes(b"abc\x00def")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / ".hidden").write_text("secret")
    c = load_corpus(str(tmp_path), seed=1, val_fraction=0.3, seq_len=8)
    assert sorted(c.train_files + c.val_files) == sorted(files)


# --- no leakage ----------------------------------------------------------------------

def test_no_training_window_contains_validation_text(tmp_path):
    files = _write_files(tmp_path, 40, size=300)
    c = load_corpus(str(tmp_path), seed=2, val_fraction=0.25, seq_len=16)
    assert c.val_files
    for rel in c.val_files:
        marker = f"<file {rel[-8:-4]}>".encode()
        assert not _contains(c.train, marker), rel
        assert _contains(c.val, files[rel])
    s = _sampler(c)
    val_markers = [f"<file {rel[-8:-4]}>".encode() for rel in c.val_files]
    for step in range(20):
        for r in range(2):
            for x, _ in s.micro_batches(step, r):
                for row in x.to(torch.uint8).numpy():
                    assert not any(m in row.tobytes() for m in val_markers)


def test_single_text_file_is_split_into_contiguous_documents(tmp_path):
    text = b"".join(f"[doc line {i:05d}]\n".encode() for i in range(3000))
    (tmp_path / "book.txt").write_bytes(text)
    c = load_corpus(str(tmp_path / "book.txt"), seed=4, val_fraction=0.2, seq_len=32, doc_bytes=1000)
    n_docs = len(c.train_files) + len(c.val_files)
    assert n_docs == -(-len(text) // 1000) and all(n.startswith("book.txt#") for n in c.train_files)
    assert c.train.size + c.val.size == len(text)
    # val is exactly the concatenation of its documents: one contiguous run per document
    bounds = [i * len(text) // n_docs for i in range(n_docs + 1)]
    all_names = sorted(c.train_files + c.val_files)
    val_bytes = b"".join(text[bounds[i]:bounds[i + 1]] for i, n in enumerate(all_names) if n in c.val_files)
    assert c.val.tobytes() == val_bytes


def test_directory_with_one_text_file_is_cut_into_documents(tmp_path):
    (tmp_path / "only.txt").write_text("abcdefghij" * 100)
    c = load_corpus(str(tmp_path), seed=1, val_fraction=0.5, seq_len=8, doc_bytes=100)
    assert sorted(c.train_files + c.val_files) == [f"only.txt#{i}" for i in range(10)]
    assert c.train_files and c.val_files


# --- sampler -------------------------------------------------------------------------

@pytest.fixture
def corpus(tmp_path) -> Corpus:
    _write_files(tmp_path, 30, size=400)
    return load_corpus(str(tmp_path), seed=5, val_fraction=0.3, seq_len=16)


def test_batches_are_int64_and_targets_are_inputs_shifted_by_one(corpus):
    s = _sampler(corpus)
    x, y = s.batch(0, 1, 1)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    torch.testing.assert_close(x[:, 1:], y[:, :-1])
    offsets = s.step_offsets(0)[1, 1]
    for row, target, o in zip(x, y, offsets):
        assert row.numpy().tolist() == corpus.train[o:o + 16].tolist()
        assert target.numpy().tolist() == corpus.train[o + 1:o + 17].tolist()


def test_same_step_micro_rank_gives_identical_batch_from_a_fresh_sampler(corpus):
    a = _sampler(corpus).batch(9, 2, 1)
    b = _sampler(corpus).batch(9, 2, 1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    mb = _sampler(corpus).micro_batches(9, 1)
    assert len(mb) == 3 and torch.equal(mb[2][0], a[0])


def test_windows_are_disjoint_across_ranks_and_micro_batches_of_a_step(corpus):
    s = _sampler(corpus, world_size=4, grad_accum=2, micro_batch_size=5)
    for step in range(10):
        offs = s.step_offsets(step)
        assert offs.shape == (4, 2, 5) and len(set(offs.ravel().tolist())) == 40
        for r in range(4):
            for m, (x, _) in enumerate(s.micro_batches(step, r)):
                expected = corpus.train[offs[r, m][:, None] + np.arange(16)]
                assert np.array_equal(x.numpy(), expected)  # each batch is its own slice of offsets


def test_windows_stay_distinct_when_the_step_uses_every_train_offset():
    # 40 start offsets and 40 windows per step: any draw with replacement would repeat one.
    tokens = np.arange(16 + 40, dtype=np.uint8)
    c = Corpus(train=tokens, val=tokens[:17].copy(), train_files=["a"], val_files=["b"],
               fingerprint="x", source="synthetic", min_vocab_size=256)
    s = _sampler(c, world_size=4, grad_accum=2, micro_batch_size=5)
    for step in range(5):
        firsts = [int(v) for r in range(4) for x, _ in s.micro_batches(step, r) for v in x[:, 0]]
        assert sorted(firsts) == list(range(40))


def test_different_steps_draw_different_windows(corpus):
    s = _sampler(corpus)
    assert not torch.equal(s.batch(0, 0, 0)[0], s.batch(1, 0, 0)[0])
    assert not np.array_equal(s.step_offsets(0), s.step_offsets(1))


def test_val_batches_come_from_val_only_and_ignore_training_draws(corpus):
    s = _sampler(corpus)
    before = [s.val_batch(i, rank=r) for i in range(3) for r in range(2)]
    for step in range(5):
        s.micro_batches(step, 0)
    after = [_sampler(corpus).val_batch(i, rank=r) for i in range(3) for r in range(2)]
    for (x0, y0), (x1, y1) in zip(before, after):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)
    val_bytes = corpus.val.tobytes()
    for x, _ in before:
        for row in x:
            assert row.to(torch.uint8).numpy().tobytes() in val_bytes
    for o in s.val_offsets(0).ravel():
        assert 0 <= o <= corpus.val.size - 17


def test_val_batches_are_the_same_on_any_world_size(corpus):
    # a run resharded to another number of ranks validates on the same samples
    one, three = _sampler(corpus, world_size=1), _sampler(corpus, world_size=3)
    for i in range(3):
        assert np.array_equal(one.val_offsets(i), three.val_offsets(i))
        assert all(torch.equal(a, b) for a, b in zip(one.val_batch(i), three.val_batch(i, rank=2)))


def test_sampler_rejects_out_of_range_rank_micro_and_step(corpus):
    s = _sampler(corpus)
    with pytest.raises(ValueError, match="rank = 2 is not allowed: must be an integer in \\[0, 2\\)"):
        s.batch(0, 0, 2)
    with pytest.raises(ValueError, match="micro = 3 is not allowed: must be an integer in \\[0, 3\\)"):
        s.batch(0, 3, 0)
    with pytest.raises(ValueError, match="step = -1 is not allowed: must be an integer >= 0"):
        s.batch(-1, 0, 0)


def test_sampler_rejects_a_train_split_too_small_for_one_step(corpus):
    with pytest.raises(ValueError, match="distinct windows.*use a larger corpus or smaller batches"):
        _sampler(corpus, micro_batch_size=10_000)


# --- .bin ----------------------------------------------------------------------------

def test_bin_round_trip_keeps_uint16_tokens_and_samples(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1000, size=5000).astype("<u2")
    tokens[123] = 999
    path = tmp_path / "toks.bin"
    tokens.tofile(path)
    c = load_corpus(str(path), seed=1, val_fraction=0.3, seq_len=32, doc_bytes=500)
    assert c.train.dtype == np.uint16 and c.train.size + c.val.size == 5000
    assert c.min_vocab_size == int(tokens.max()) + 1
    assert sorted(c.train_files + c.val_files) == [f"toks.bin#{i}" for i in range(10)]
    x, y = _sampler(c, seq_len=32).batch(0, 0, 0)
    assert x.dtype == torch.int64 and int(x.max()) < 1000
    c.check_vocab(1000)
    with pytest.raises(ValueError, match="token ids up to 999.*set model.vocab_size >= 1000"):
        c.check_vocab(256)


# --- errors --------------------------------------------------------------------------

def _put(root: Path, name: str, content: bytes | None) -> str:
    """Create ``name`` under root (a file, or a dir when content is None); return its path."""
    if content is None:
        (root / name).mkdir()
    else:
        (root / name).write_bytes(content)
    return str(root / name)


@pytest.mark.parametrize("name,content,fragment", [
    ("   ", b"", "is blank; use '' for the stdlib corpus"),
    ("nope.txt", "absent", "does not exist; point it at a text file"),
    ("e.txt", b"", "is an empty file"),
    ("sub", None, "holds no non-empty UTF-8 text files; add text files"),
    ("t.bin", b"abc", "3 bytes; a .bin must hold uint16 .*a non-zero, even number of bytes"),
    ("b.txt", b"\xff\xfe\x00x" * 10, "is not UTF-8 text .*pre-tokenize it into a uint16 .bin"),
    ("s.txt", b"short text", "fewer than one window of model.seq_len \\+ 1 = 65; use a larger corpus"),
])
def test_bad_data_paths_raise_value_error_naming_the_problem(tmp_path, name, content, fragment):
    if name.strip() == "":
        path = name
    elif content == "absent":
        path = str(tmp_path / name)
    else:
        path = _put(tmp_path, name, content)
    with pytest.raises(ValueError, match=fragment):
        load_corpus(path, seed=0, val_fraction=0.1, seq_len=64)


def test_unreadable_file_raises_value_error(tmp_path, monkeypatch):
    _write_files(tmp_path, 3)

    def deny(path: Path) -> bytes:
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(Path, "read_bytes", deny)
    with pytest.raises(ValueError, match="cannot read .*permission denied .check the path.s permissions"):
        load_corpus(str(tmp_path), seed=0, val_fraction=0.1, seq_len=8)


def test_bad_val_fraction_raises_value_error(tmp_path):
    _write_files(tmp_path, 3)
    with pytest.raises(ValueError, match="data.val_fraction = 1.0 must be in \\(0, 1\\)"):
        load_corpus(str(tmp_path), seed=0, val_fraction=1.0, seq_len=8)


# --- default corpus / config ---------------------------------------------------------

def test_default_corpus_is_stdlib_sources_loaded_in_a_few_seconds():
    start = time.perf_counter()
    c = load_corpus("", seed=1337, val_fraction=0.1, seq_len=128)
    elapsed = time.perf_counter() - start
    assert c.train.size + c.val.size > 1_000_000 and elapsed < 5.0
    assert c.train.size + c.val.size <= data_mod.STDLIB_CAP_BYTES
    assert c.source.startswith("python-stdlib:") and len(c.val_files) > 0
    assert not any(f.split("/")[0] in ("test", "tests", "site-packages", "idlelib", "lib2to3")
                   for f in c.train_files + c.val_files)
    assert c.min_vocab_size <= 256


def test_build_data_wires_config_keys(tmp_path):
    _write_files(tmp_path, 20, size=300)
    cfg = EngineConfig.from_dict({"seed": 3, "model": {"seq_len": 16},
                                  "data": {"path": str(tmp_path), "micro_batch_size": 2, "grad_accum": 2}})
    corpus, sampler = build_data(cfg, world_size=2)
    assert sampler.step_offsets(0).shape == (2, 2, 2)
    assert sampler.batch(0, 1, 1)[0].shape == (2, 16)
    assert corpus.fingerprint == load_corpus(str(tmp_path), seed=3, val_fraction=0.1, seq_len=16).fingerprint


def test_a_uint16_bin_beyond_256_ids_is_bounded_by_the_models_own_vocabulary(tmp_path):
    """model.vocab_size (256 by default) is the built-in GPT's: an hf: or factory model's
    own embedding rows bound the ids (task.build.check_tokens), so build_data must not
    refuse a .bin with ids above 255 for them."""
    path = tmp_path / "toks.bin"
    np.arange(4000, dtype="<u2").__mod__(1000).astype("<u2").tofile(path)
    hf = EngineConfig.from_dict({"model": {"source": "hf:some/dir", "seq_len": 16}, "data": {"path": str(path)}})
    corpus, _ = build_data(hf)
    assert corpus.min_vocab_size == 1000
    with pytest.raises(ValueError, match="token ids up to 999.*model.vocab_size = 256"):
        build_data(EngineConfig.from_dict({"model": {"seq_len": 16}, "data": {"path": str(path)}}))


def test_a_prepared_dataset_whose_meta_lowers_the_vocab_is_refused_on_load(tmp_path):
    from mct.data.pipeline import prepare
    import json
    (tmp_path / "a.txt").write_text("\n\n".join(f"paragraph {i} with text" for i in range(10)))
    prepare([str(tmp_path / "a.txt")], str(tmp_path / "ds"), split="paragraph", progress=False)
    load_corpus(str(tmp_path / "ds"), seed=0, val_fraction=0.2, seq_len=4)
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    (tmp_path / "ds" / "meta.json").write_text(json.dumps({**meta, "vocab_size": 200}))
    with pytest.raises(ValueError, match="holds token id 256, but meta.json says vocab_size 200"):
        load_corpus(str(tmp_path / "ds"), seed=0, val_fraction=0.2, seq_len=4)
