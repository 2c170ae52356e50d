"""`mct prepare` and training on its datasets: lossless tokenizers, the public format's
invariants, one-line FILE:LINE errors with nothing written, atomicity, the split by
document, the vocab check, and resume refusing a changed dataset."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from mct.cli import main
from mct.data import load_corpus
from mct.data import pipeline as prepare_mod
from mct.data.pipeline import prepare
from mct.data.dataset import DocumentSpans, open_prepared
from mct.data.tokenizer import Encoder, Tokenizer, bytes_to_unicode, copy_tokenizer

TEXTS = ["def f(x):\n    return x + 1\n", "héllo wörld ✓ 你好 \U0001F600", "spells <|endoftext|> and </s> as text",
         "tabs\tand\r\nnewlines\n\n", "a" * 300, "import os\nprint(os.sep)\n"]


def _inputs(d: Path, texts: list[str] = TEXTS) -> list[str]:
    """The texts as a .jsonl (first half, with an empty record and a blank line), a
    .jsonl.gz (second half) and a directory of text files (all again); returns INPUTs."""
    d.mkdir(parents=True, exist_ok=True)
    half = len(texts) // 2
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(texts[:half])]
    (d / "a.jsonl").write_text("\n".join([lines[0], json.dumps({"text": ""}), "", *lines[1:]]) + "\n")
    with gzip.open(d / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps({"text": t}) + "\n" for t in texts[half:]))
    (d / "docs").mkdir(exist_ok=True)
    for i, t in enumerate(texts):
        (d / "docs" / f"{i:02d}.txt").write_bytes(t.encode("utf-8"))
    return [str(d / "a.jsonl"), str(d / "b.jsonl.gz"), str(d / "docs")]


def _documents(ds_dir: Path) -> list[np.ndarray]:
    ds = open_prepared(ds_dir)
    return [np.asarray(ds.tokens[a:b]) for a, b in zip(ds.offsets[:-1], ds.offsets[1:])]


def _sparse_tokenizer_json(path: Path) -> Path:
    """A byte-level tokenizer.json whose ids start at 70000 (so uint32 tokens), no EOS."""
    from tokenizers import Tokenizer as HF, decoders, models, pre_tokenizers
    table = bytes_to_unicode()
    hf = HF(models.BPE({table[b]: 70000 + b for b in range(256)}, []))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    path.write_text(hf.to_str())
    return path


@pytest.mark.parametrize("spec", ["bytes", "train:300", "file"])
def test_round_trip_is_lossless_and_format_invariants_hold(tmp_path, spec):
    inputs = _inputs(tmp_path / "in")
    if spec == "file":
        spec = str(_sparse_tokenizer_json(tmp_path / "tokenizer.json"))
    meta = prepare(inputs, str(tmp_path / "ds"), tokenizer=spec, workers=1, progress=False)
    ds = open_prepared(tmp_path / "ds")
    enc = Encoder(Tokenizer(kind=meta["tokenizer"], json=(tmp_path / "ds" / "tokenizer.json").read_text(),
                            vocab_size=meta["vocab_size"], eos_id=meta["eos_id"], source=spec))
    docs = _documents(tmp_path / "ds")
    assert [enc.decode(d[:-1]) for d in docs] == TEXTS + TEXTS  # input order, every text exact
    assert all(d[-1] == meta["eos_id"] and meta["eos_id"] not in d[:-1] for d in docs)
    assert ds.offsets[0] == 0 and ds.offsets[-1] == meta["tokens"] == ds.tokens.size
    assert meta["documents"] == len(docs) == 2 * len(TEXTS) and meta["skipped_empty"] == 1
    assert int(ds.tokens.max()) < meta["vocab_size"]
    big = meta["vocab_size"] > 65536
    assert ds.tokens.dtype == np.dtype("<u4" if big else "<u2") and meta["dtype"] == ("uint32" if big else "uint16")
    assert (tmp_path / "ds" / "tokens.bin").stat().st_size == meta["tokens"] * (4 if big else 2)
    assert meta["roundtrip"] == {"checked": meta["roundtrip"]["checked"], "mismatched": 0}
    assert [i["name"] for i in meta["inputs"]][:2] == inputs[:2]
    assert meta["inputs"][1]["bytes"] == Path(inputs[1]).stat().st_size  # the file as stored, compressed


def test_sparse_tokenizer_gets_an_eos_and_uint32_and_a_directory_spec_works(tmp_path):
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    _sparse_tokenizer_json(tok_dir / "tokenizer.json")
    meta = prepare(_inputs(tmp_path / "in"), str(tmp_path / "ds"), tokenizer=str(tok_dir), progress=False)
    # the library gives an added token the id after the model's count (256), so ids stay sparse
    assert meta["vocab_size"] == 70256 and meta["eos_id"] == 256 and meta["dtype"] == "uint32"
    assert Tokenizer(kind="bytes", json="", vocab_size=65536, eos_id=0, source="").dtype == np.dtype("<u2")


def test_workers_write_the_same_bytes_as_one_process(tmp_path):
    inputs = _inputs(tmp_path / "in", TEXTS * 20)
    for w in (1, 2):
        prepare(inputs, str(tmp_path / f"w{w}"), tokenizer="bytes", workers=w, progress=False, chunk_bytes=200)
    for name in ("tokens.bin", "docs.idx", "meta.json", "tokenizer.json"):
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name


@pytest.mark.parametrize("record, why", [("{not json", "not JSON"), ("[1, 2]", "a JSON list, not an object"),
                                         ('{"body": "x"}', "no 'text' field"), ('{"text": 3}', "holds number 3"),
                                         ('{"text": null}', "holds null"), ("[" * 100000, "nested too deeply"),
                                         ('{"text": "a\\ud800"}', "lone surrogate")])
def test_bad_jsonl_record_is_one_line_file_line_exit_2_and_nothing_written(tmp_path, capfd, record, why):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n' + record + "\n")
    out = tmp_path / "ds"
    assert main(["prepare", str(bad), "--out", str(out), "--workers", "2", "--no-progress"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"mct: error: {bad}:3: ") and why in err[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # no DIR, no partial sibling


def test_killed_prepare_leaves_nothing_trainable(tmp_path, monkeypatch):
    calls = []
    real = prepare_mod.encode_chunk

    def dies_on_the_third_chunk(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # what Ctrl-C (or a kill's unwinding) does mid-way
        return real(*args)
    monkeypatch.setattr(prepare_mod, "encode_chunk", dies_on_the_third_chunk)
    with pytest.raises(KeyboardInterrupt):
        prepare(_inputs(tmp_path / "in", TEXTS * 20), str(tmp_path / "ds"), workers=1, progress=False,
                chunk_bytes=100)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]
    partial = tmp_path / "partial"  # what a SIGKILL leaves: files without meta.json
    partial.mkdir()
    (partial / "tokens.bin").write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="no meta.json: an unfinished"):
        load_corpus(str(partial), seed=0, val_fraction=0.1, seq_len=4)


def test_split_is_by_document_and_windows_read_the_documents(tmp_path):
    texts = [f"document {i} " * (5 + i % 7) for i in range(60)]
    prepare(_inputs(tmp_path / "in", texts)[:2], str(tmp_path / "ds"), progress=False)
    docs = _documents(tmp_path / "ds")
    c = load_corpus(str(tmp_path / "ds"), seed=3, val_fraction=0.2, seq_len=8)
    train_ids = [int(n[3:]) for n in c.train_files]
    val_ids = [int(n[3:]) for n in c.val_files]
    assert sorted(train_ids + val_ids) == list(range(60)) and 3 <= len(val_ids) <= 24
    assert isinstance(c.train, DocumentSpans) and c.train.dtype == np.uint16
    assert c.train.tobytes() == np.concatenate([docs[i] for i in train_ids]).tobytes()
    assert c.val.tobytes() == np.concatenate([docs[i] for i in val_ids]).tobytes()
    flat = np.concatenate([docs[i] for i in train_ids])
    idx = np.array([[0, 1, 2], [flat.size - 3, flat.size - 2, flat.size - 1], [40, 41, 42]])
    assert np.array_equal(c.train[idx], flat[idx]) and np.array_equal(c.train[5:50:3], flat[5:50:3])
    other = load_corpus(str(tmp_path / "ds"), seed=4, val_fraction=0.2, seq_len=8)
    assert list(other.val_files) != list(c.val_files) and other.fingerprint != c.fingerprint
    again = load_corpus(str(tmp_path / "ds"), seed=3, val_fraction=0.2, seq_len=8)
    assert list(again.val_files) == list(c.val_files) and again.fingerprint == c.fingerprint


def _train_args(ds: Path, run: Path, *sets: str) -> list[str]:
    keys = ["model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.seq_len=16", "train.steps=2",
            "train.checkpoint_every=1", "train.eval_every=2", "train.eval_batches=1", "data.micro_batch_size=2",
            f"data.path={ds}", *sets]
    return ["train", "--run-dir", str(run), "--no-progress", *[a for k in keys for a in ("--set", k)]]


def test_training_on_a_prepared_dataset_records_it_and_copies_its_tokenizer(tmp_path, capfd):
    inputs = _inputs(tmp_path / "in", [f"text number {i}: " + "lorem ipsum " * 20 for i in range(24)])
    assert main(["prepare", *inputs, "--out", str(tmp_path / "ds"), "--tokenizer", "train:300",
                 "--workers", "1", "--no-progress"]) == 0
    vocab = json.loads((tmp_path / "ds" / "meta.json").read_text())["vocab_size"]
    run = tmp_path / "run"
    assert main(_train_args(tmp_path / "ds", run, "model.vocab_size=300")) == 0
    meta = json.loads((run / "metadata.json").read_text())
    recorded = meta["corpus"]["dataset"]
    assert recorded["vocab_size"] == vocab and recorded["documents"] == 48 and recorded["inputs"] == 26
    assert (run / "tokenizer.json").read_bytes() == (tmp_path / "ds" / "tokenizer.json").read_bytes()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r][-1] == 1 and np.isfinite(rows[-1].get("loss", 0.0))
    small = vocab - 1
    assert main(_train_args(tmp_path / "ds", tmp_path / "run2", f"model.vocab_size={small}")) == 2
    err = capfd.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("mct: error: the dataset") and f"model.vocab_size >= {vocab}" in err
    assert not (tmp_path / "run2").exists()

    # re-preparing the same inputs gives the same dataset: the resume accepts it
    shutil.rmtree(tmp_path / "ds")
    assert main(["prepare", *inputs, "--out", str(tmp_path / "ds"), "--tokenizer", "train:300",
                 "--workers", "2", "--no-progress"]) == 0
    # every token changed in place, meta.json untouched: the fingerprint (from meta.json) holds, the
    # resume's streamed sha256 of tokens.bin refuses it
    tokens_bin = tmp_path / "ds" / "tokens.bin"
    good = tokens_bin.read_bytes()
    tokens_bin.write_bytes(np.frombuffer(good, "<u2")[::-1].tobytes())
    capfd.readouterr()
    assert main(["train", "--resume", str(run), "--no-progress", "--set", "train.steps=3"]) == 2
    err = capfd.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("mct: error: data.path:") and "changed since it was prepared" in err, err
    tokens_bin.write_bytes(good)
    assert main(["train", "--resume", str(run), "--no-progress", "--set", "train.steps=3"]) == 0
    # a changed input changes meta.json's sha256s, so the fingerprint: the resume refuses
    shutil.rmtree(tmp_path / "ds")
    (Path(inputs[2]) / "00.txt").write_text("changed text " * 30)
    assert main(["prepare", *inputs, "--out", str(tmp_path / "ds"), "--tokenizer", "train:300",
                 "--workers", "1", "--no-progress"]) == 0
    capfd.readouterr()
    assert main(["train", "--resume", str(run), "--no-progress", "--set", "train.steps=4"]) == 2
    assert "corpus at data.path changed" in capfd.readouterr().err


def test_prepare_argument_errors_are_one_line(tmp_path, capfd):
    (tmp_path / "a.txt").write_text("some text")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    cases = [(["nope.txt"], "does not exist"), (["a.txt", "--out", "taken"], "already exists"),
             (["a.txt", "--tokenizer", "train:100"], "VOCAB must be in"),
             (["a.txt", "--tokenizer", "missing.json"], "no tokenizer.json there"),
             (["a.txt", "--workers", "0"], "--workers must be"), (["latin1.txt"], "latin1.txt: not UTF-8")]
    for args, why in cases:
        args = [str(tmp_path / a) if a.endswith((".txt", ".json")) or a == "taken" else a for a in args]
        out = [] if "--out" in args else ["--out", str(tmp_path / "new")]
        assert main(["prepare", *args, *out, "--no-progress"]) == 2, args
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("mct: error: ") and why in err[0], (args, err)
        assert not (tmp_path / "new").exists()


def test_a_byte_corpus_run_gets_the_byte_tokenizer_and_a_bin_none(tmp_path):
    from tokenizers import Tokenizer as HF
    (tmp_path / "c").mkdir()
    for i in range(4):
        (tmp_path / "c" / f"{i}.txt").write_text(f"héllo {i} ✓ " * 20)
    text = load_corpus(str(tmp_path / "c"), seed=0, val_fraction=0.3, seq_len=8)
    (tmp_path / "run").mkdir()
    hf = HF.from_file(str(copy_tokenizer(text, tmp_path / "run")))
    assert hf.get_vocab_size() == 256 and hf.decode(text.train[:200].tolist()) == text.train[:200].tobytes().decode()
    np.arange(1000, dtype="<u2").tofile(tmp_path / "t.bin")
    tokens = load_corpus(str(tmp_path / "t.bin"), seed=0, val_fraction=0.3, seq_len=8, doc_bytes=100)
    assert copy_tokenizer(tokens, tmp_path / "run2") is None


@pytest.mark.parametrize("eos", [True, False])
def test_the_byte_tokenizer_is_the_librarys_own_string_and_leaves_the_library_unloaded(tmp_path, eos):
    """``bytes_tokenizer_json`` is written without ``tokenizers`` (a training process on a byte
    corpus never loads it): the same string the library serializes for those 256 ids, and a
    process that writes a run's tokenizer.json has not imported the library."""
    import subprocess
    import sys
    from tokenizers import AddedToken, Tokenizer as HF, decoders, models, pre_tokenizers
    from mct.data.tokenizer import EOS_TOKEN, bytes_tokenizer_json
    table = bytes_to_unicode()
    hf = HF(models.BPE({table[b]: b for b in range(256)}, []))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    if eos:
        hf.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False)])
    assert bytes_tokenizer_json(eos=eos) == hf.to_str()
    (tmp_path / "c").mkdir()
    for i in range(2):
        (tmp_path / "c" / f"{i}.txt").write_text("abc " * 50)
    code = ("import sys; from mct.data import load_corpus; from mct.data.tokenizer import copy_tokenizer; "
            f"c = load_corpus({str(tmp_path / 'c')!r}, seed=0, val_fraction=0.5, seq_len=8); "
            f"copy_tokenizer(c, {str(tmp_path)!r}); print('tokenizers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False" and (tmp_path / "tokenizer.json").is_file()


def test_a_lossy_tokenizer_is_prepared_with_a_warning(tmp_path, capfd):
    from tokenizers import Tokenizer as HF, normalizers
    hf = HF.from_file(str(_sparse_tokenizer_json(tmp_path / "tokenizer.json")))
    hf.normalizer = normalizers.Lowercase()  # loses case: decode(encode("Hi")) == "hi"
    hf.save(str(tmp_path / "lossy.json"))
    inputs = _inputs(tmp_path / "in", ["Upper Case", "lower case"])
    assert main(["prepare", *inputs, "--out", str(tmp_path / "ds"), "--tokenizer", str(tmp_path / "lossy.json"),
                 "--workers", "1", "--no-progress"]) == 0
    err = capfd.readouterr().err
    assert "mct: warning: the tokenizer did not decode" in err and "not lossless" in err
    assert json.loads((tmp_path / "ds" / "meta.json").read_text())["roundtrip"]["mismatched"] >= 1
