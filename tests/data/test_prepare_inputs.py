"""`mct prepare` inputs: big documents streamed in pieces (same tokens as whole, bounded
memory, UTF-8 split across reads), ``--split``, parquet and ``save_to_disk`` arrow,
hostile input (signals, stale partials, datasets inside inputs), the BPE word cap."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mct.cli import main
from mct.data import pipeline, sources
from mct.data.dataset import open_prepared
from mct.data.pipeline import prepare
from mct.data.textstream import cut_ok, safe_cut
from mct.data.tokenizer import MAX_WORD_BYTES, Encoder, resolve_tokenizer

REPO = Path(__file__).resolve().parents[2]
BIG = ("Hello wörld, this is 日本語 text.\nSecond line  with  two spaces\n\n  \nPara two, 'quoted' x.\n" * 40
       + "solid" * 10 + " end\r\nlast line")


def _docs(out: Path) -> list[str]:
    from tokenizers import Tokenizer
    ds, hf = open_prepared(out), Tokenizer.from_file(str(out / "tokenizer.json"))
    return [hf.decode(ds.tokens[a:b - 1].tolist()) for a, b in zip(ds.offsets[:-1], ds.offsets[1:])]


@pytest.mark.parametrize("spec", ["bytes", "train:400"])
def test_a_big_document_streams_in_bounded_pieces_with_the_tokens_of_the_whole(tmp_path, spec, monkeypatch):
    (tmp_path / "big.txt").write_text(BIG, encoding="utf-8")
    seen: list[int] = []
    encode = pipeline.encode_chunk
    monkeypatch.setattr(pipeline, "encode_chunk", lambda enc, c, f: (seen.extend(map(len, c.items)), encode(enc, c, f))[1])
    out = tmp_path / "ds"
    meta = prepare([str(tmp_path / "big.txt")], str(out), tokenizer=spec, chunk_bytes=64, progress=False)
    assert meta["documents"] == 1 and _docs(out) == [BIG]
    assert len(seen) > 20 and max(seen) <= 2 * 64, "a document must reach the encoder in pieces of ~2 chunks at most"
    whole = Encoder(resolve_tokenizer(str(out / "tokenizer.json"))).encode_batch([BIG])[0]
    assert np.array_equal(open_prepared(out).tokens[:-1], whole), "pieces cut where the pre-tokenizer cuts"


def test_utf8_split_across_reads_is_fine_and_a_bad_byte_is_named_by_its_offset(tmp_path, capfd):
    text = "ü日\U0001F600" * 200  # 9 bytes a round, every read of 7 bytes splits a character
    (tmp_path / "u.txt").write_text(text, encoding="utf-8")
    prepare([str(tmp_path / "u.txt")], str(tmp_path / "ds"), chunk_bytes=7, progress=False)
    assert _docs(tmp_path / "ds") == [text]
    raw = bytearray(text.encode("utf-8"))
    raw[1008] = 0xFF  # the first byte of a character: the bad sequence starts there
    (tmp_path / "bad.txt").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"bad\.txt: not UTF-8 text \(byte 1008\)"):
        prepare([str(tmp_path / "bad.txt")], str(tmp_path / "ds2"), chunk_bytes=64, progress=False)
    assert not (tmp_path / "ds2").exists() and not list(tmp_path.glob(".ds2.partial-*"))


@pytest.mark.parametrize("split", ["paragraph", "line"])
def test_split_paragraph_and_line_make_the_documents_they_say(tmp_path, split):
    (tmp_path / "t.txt").write_text(BIG, encoding="utf-8", newline="")
    if split == "line":
        want = [line.removesuffix("\r") for line in BIG.split("\n") if line]
    else:
        want, cur = [], []
        for line in BIG.split("\n") + [""]:
            if line.strip():
                cur.append(line)
            elif cur:
                want.append("\n".join(cur))
                cur = []
    for chunk in (16, 1 << 20):  # pieces of documents, and whole documents
        out = tmp_path / f"ds{chunk}"
        prepare([str(tmp_path / "t.txt")], str(out), split=split, chunk_bytes=chunk, progress=False)
        assert _docs(out) == want, (split, chunk)
        assert json.loads((out / "meta.json").read_text())["split"] == split
    assert main(["prepare", str(tmp_path / "t.txt"), "--out", str(tmp_path / "cli"), "--split", split,
                 "--workers", "2", "--no-progress"]) == 0
    assert _docs(tmp_path / "cli") == want


def test_cut_rules_cut_only_between_pretokens():
    buf = "a\nb  c\n\nd e".encode()
    assert [i for i in range(len(buf)) if cut_ok(buf, i)] == [2, 9]  # after "a\n"; before the " " of "d e"
    assert safe_cut(b"x" * 50, 10) == 49 and safe_cut("é".encode() * 20, 3) % 2 == 0


def test_a_tokenizer_that_marks_text_starts_refuses_a_big_document_with_the_split_fix(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {"▁": 0, **{c: i + 1 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz.,'\n")}, "<unk>": 40}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    hf.decoder = decoders.Metaspace(prepend_scheme="always")
    hf.save(str(tmp_path / "tok.json"))
    tok = resolve_tokenizer(str(tmp_path / "tok.json"))
    assert not tok.pieces_ok and resolve_tokenizer("bytes").pieces_ok
    (tmp_path / "big.txt").write_text("abc def\n" * 50)
    with pytest.raises(ValueError, match="--split paragraph or --split line"):
        prepare([str(tmp_path / "big.txt")], str(tmp_path / "ds"), tokenizer=str(tmp_path / "tok.json"),
                chunk_bytes=64, progress=False)
    prepare([str(tmp_path / "big.txt")], str(tmp_path / "ds"), tokenizer=str(tmp_path / "tok.json"), split="line",
            chunk_bytes=64, progress=False)  # every line is small: nothing to cut


def test_a_trained_bpe_cuts_words_so_a_megabyte_without_spaces_is_many(tmp_path):
    tok = resolve_tokenizer("train:300", texts=lambda: iter(["ab" * 5000, "hello world"]))
    from tokenizers import Tokenizer
    pieces = Tokenizer.from_str(tok.json).pre_tokenizer.pre_tokenize_str("ab" * 5000)
    assert len(pieces) == 10000 // MAX_WORD_BYTES + 1 and max(len(p) for p, _ in pieces) == MAX_WORD_BYTES
    enc = Encoder(tok)
    assert enc.decode(enc.encode_batch(["ab" * 5000])[0]) == "ab" * 5000


def test_parquet_and_a_save_to_disk_directory_are_read_by_rows(tmp_path, capfd):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    texts = ["first row", "", "zwéite 行", "third"]
    pq.write_table(pa.table({"body": texts, "n": list(range(4))}), tmp_path / "a.parquet", row_group_size=1)
    sd = tmp_path / "sd"
    sd.mkdir()
    with pa.OSFile(str(sd / "data-00000-of-00001.arrow"), "wb") as f, \
            pa.ipc.new_stream(f, pa.schema([("body", pa.string())])) as w:
        w.write_table(pa.table({"body": ["arrow one", "arrow two"]}))
    (sd / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (sd / "dataset_info.json").write_text("{}")  # never a document
    out = tmp_path / "ds"
    assert main(["prepare", str(tmp_path / "a.parquet"), str(sd), "--out", str(out), "--text-field", "body",
                 "--workers", "2", "--no-progress"]) == 0
    assert _docs(out) == ["first row", "zwéite 行", "third", "arrow one", "arrow two"]
    assert json.loads((out / "meta.json").read_text())["skipped_empty"] == 1
    pq.write_table(pa.table({"body": ["x", None]}), tmp_path / "null.parquet")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    for args, why in ((["null.parquet", "--text-field", "body"], "null.parquet: row 2: column 'body' is null"),
                      (["a.parquet"], "no 'text' column (columns: body, n)"),
                      (["a.parquet", "--text-field", "n"], "holds int64, not strings"),
                      (["bad.parquet"], "bad.parquet: not a readable parquet file")):
        capfd.readouterr()
        assert main(["prepare", str(tmp_path / args[0]), *args[1:], "--out", str(tmp_path / "x"), "--no-progress"]) == 2
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0], err
    assert not (tmp_path / "x").exists()


def test_missing_pyarrow_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    (tmp_path / "a.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ValueError, match=r"needs pyarrow.*mct\[parquet\]"):
        prepare([str(tmp_path / "a.parquet")], str(tmp_path / "ds"), progress=False)


def test_a_prepared_dataset_inside_an_input_directory_is_not_read_as_text(tmp_path, capfd):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("some text")
    assert main(["prepare", str(tmp_path / "in"), "--out", str(tmp_path / "in" / "ds"), "--no-progress"]) == 0
    assert main(["prepare", str(tmp_path / "in"), "--out", str(tmp_path / "again"), "--no-progress"]) == 0
    meta = json.loads((tmp_path / "again" / "meta.json").read_text())
    assert [i["name"] for i in meta["inputs"]] == [f"{tmp_path / 'in'}/a.txt"] and _docs(tmp_path / "again") == ["some text"]
    capfd.readouterr()
    assert main(["prepare", str(tmp_path / "in" / "ds"), "--out", str(tmp_path / "x"), "--no-progress"]) == 2
    assert "is a prepared dataset" in capfd.readouterr().err


def test_a_killed_runs_partial_directory_is_removed_by_the_next_run(tmp_path):
    (tmp_path / "a.txt").write_text("text")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = [tmp_path / f".ds.partial-{int(dead.stdout)}-0123abcd", tmp_path / ".ds.partial-89abcdef"]
    live = tmp_path / f".ds.partial-{os.getpid()}-fedc0123"
    for d in (*stale, live):
        d.mkdir()
        (d / "tokens.bin").write_bytes(b"\0\0")
    prepare([str(tmp_path / "a.txt")], str(tmp_path / "ds"), progress=False)
    assert not any(d.exists() for d in stale) and live.exists() and (tmp_path / "ds" / "meta.json").is_file()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.cli
def test_a_signal_mid_prepare_leaves_no_directory_and_no_process(tmp_path, sig):
    (tmp_path / "big.txt").write_text(("word " * 200 + "\n") * 100000)  # 100 MB: encodes for ~1 s after the first write
    out = tmp_path / "ds_signal_target"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "mct", "prepare", str(tmp_path / "big.txt"), "--out", str(out),
                             "--workers", "2", "--no-progress"], env=env, start_new_session=True,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    # signalled once tokens are being written: workers running, large results in flight (a
    # multiprocessing.Pool hung for ever here, its terminate waiting on a worker mid-write)
    while not _written(tmp_path.glob(".ds_signal_target.partial-*/tokens.bin")) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.005)
    os.killpg(proc.pid, sig) if sig == signal.SIGINT else proc.send_signal(sig)  # Ctrl-C reaches the whole group
    try:  # communicate, not wait: a child that writes more than a pipe holds would block on it
        _, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"mct prepare still running 240 s after {sig.name}: {proc.communicate()[1][-3000:]}")
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    assert not out.exists() and not list(tmp_path.glob(".ds_signal_target.partial-*"))
    time.sleep(0.5)
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline_has(p, str(out))]
    assert left == [], "a worker outlived the prepare"


def _written(paths) -> bool:
    try:
        return any(p.stat().st_size > 0 for p in paths)
    except OSError:
        return False


def _cmdline_has(p: Path, text: str) -> bool:
    try:
        return text in (p / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def test_workers_and_train_vocab_are_bounded_with_the_limit_in_the_message(tmp_path):
    (tmp_path / "a.txt").write_text("text")
    with pytest.raises(ValueError, match=rf"--workers must be an integer in \[1, {pipeline.MAX_ENCODE_WORKERS}\]"):
        prepare([str(tmp_path / "a.txt")], str(tmp_path / "ds"), workers=100000, progress=False)
    with pytest.raises(ValueError, match=r"VOCAB must be in \[257, 1048576\]"):
        prepare([str(tmp_path / "a.txt")], str(tmp_path / "ds"), tokenizer="train:4294967296", progress=False)
    assert sources.CHUNK_BYTES == 1 << 20
