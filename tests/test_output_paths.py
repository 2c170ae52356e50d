"""Every path a user names for mct to write (``plan --plot``, ``report --plot``, ``export
--out`` in both formats, ``prepare --out``) follows one rule (``mct.outputs``): a new name,
an existing regular file only with ``--force`` (a directory output: an earlier output of
the same command only with ``--force``); never a link, dangling link, FIFO, the other kind
or a run's own file. Each refusal is one ``mct: error:`` line naming the path, exit 2, and
leaves every byte as it was; nothing hangs on a FIFO."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Callable, Iterator

import pytest

from mct.cli import main
from mct.outputs import check_dir_output, install_dir, kind, replace_file, write_file
from tests.helpers import checkpointed_run

PNG = b"\x89PNG\r\n\x1a\n"
PLAN = ["plan", "--set", "model.n_layer=1", "--set", "model.d_model=32", "--set", "model.n_head=2", "--set",
        "model.seq_len=16", "--set", "data.micro_batch_size=2", "--stages", "0", "--policies", "none",
        "--precisions", "fp32", "--workers", "1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run directory: a real one-step checkpoint, metadata.json, three metrics rows."""
    run, _, cfg = checkpointed_run(tmp_path_factory.mktemp("outputs"))
    (run / "metadata.json").write_text(json.dumps({"config": cfg.to_dict(), "world_size": 1}) + "\n")
    rows = [{"step": s, "loss": 5.0 - s, "tokens_per_s": 100.0, "peak_bytes": 2**20} for s in range(3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


@pytest.fixture
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    (d / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 20)
    return d


@pytest.fixture(autouse=True)
def no_hang() -> Iterator[None]:
    """A command that opens a FIFO would block for ever: fail the test after 60 s instead."""
    def expire(signum, frame):
        raise TimeoutError("an mct command blocked (opened a FIFO?)")
    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


# (output, argv before the target, is it a directory output); {run} and {corpus} are filled in
OUTPUTS: dict[str, tuple[list[str], bool]] = {
    "plan-plot": ([*PLAN, "--plot"], False),
    "report-plot": (["report", "{run}", "--plot"], False),
    "export-out": (["export", "{run}", "--out"], False),
    "export-hf-out": (["export", "{run}", "--format", "hf", "--out"], True),
    "prepare-out": (["prepare", "{corpus}", "--no-progress", "--workers", "1", "--out"], True),
}


def _user_file(p: Path) -> None:
    p.write_bytes(b"the user's own notes\n")


def _link_to_file(p: Path) -> None:
    _user_file(p.parent / "notes.txt")
    p.symlink_to(p.parent / "notes.txt")


def _link_to_dir(p: Path) -> None:
    (p.parent / "elsewhere").mkdir()
    _user_file(p.parent / "elsewhere" / "keep.txt")
    p.symlink_to(p.parent / "elsewhere")


def _full_dir(p: Path) -> None:
    p.mkdir()
    _user_file(p / "keep.txt")


# (hostile target, how it is made, the words the error line carries, which outputs it applies to)
HOSTILE: dict[str, tuple[Callable[[Path], None], str, str]] = {
    "symlink-to-a-file": (_link_to_file, "a symbolic link", "all"),
    "symlink-to-a-directory": (_link_to_dir, "a symbolic link", "all"),
    "dangling-symlink": (lambda p: p.symlink_to(p.parent / "nowhere"), "which does not exist", "all"),
    "fifo": (os.mkfifo, "a FIFO", "all"),
    "directory-for-a-file": (_full_dir, "is a directory", "file"),
    "file-for-a-directory": (_user_file, "is a regular file", "dir"),
    "foreign-directory": (_full_dir, "keep.txt", "dir"),
}


def _tree(root: Path) -> dict[str, object]:
    """Every entry under ``root``: a file's bytes, a link's target, a FIFO or a directory."""
    out: dict[str, object] = {}
    for p in sorted(root.rglob("*")):
        k = kind(p) or ""
        out[str(p.relative_to(root))] = (p.read_bytes() if k == "a regular file" else os.readlink(p)
                                         if p.is_symlink() else k)
    return out


def _mct(argv: list[str], capsys) -> tuple[int, str]:
    rc = main(argv)
    return rc, capsys.readouterr().err


def _argv(output: str, target: Path, run: Path, corpus: Path, force: bool) -> list[str]:
    head, _ = OUTPUTS[output]
    return [a.format(run=run, corpus=corpus) for a in head] + [str(target)] + (["--force"] if force else [])


def _refused(rc: int, err: str, target: Path, words: str) -> None:
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("mct: error: "), err
    assert str(target) in lines[0] and words in lines[0], lines[0]


CASES = [(output, hostile, force) for output, (_, directory) in OUTPUTS.items() for hostile, (_, _, applies)
         in HOSTILE.items() if applies in ("all", "dir" if directory else "file") for force in (False, True)]


@pytest.mark.parametrize("output,hostile,force", CASES,
                         ids=[f"{o}-{h}{'-force' if f else ''}" for o, h, f in CASES])
def test_a_hostile_target_is_refused_in_one_line_and_left_byte_identical(output, hostile, force, run, corpus,
                                                                          tmp_path, capsys):
    make, words, _ = HOSTILE[hostile]
    directory = OUTPUTS[output][1]
    if hostile == "foreign-directory" and not force:
        words = "not an empty directory"
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    target = out_dir / ("target" if directory else "target.png" if "plot" in output else "target.safetensors")
    make(target)
    before, run_before = _tree(out_dir), _tree(run)
    rc, err = _mct(_argv(output, target, run, corpus, force), capsys)
    _refused(rc, err, target, words)
    assert _tree(out_dir) == before and _tree(run) == run_before


@pytest.mark.parametrize("output", list(OUTPUTS))
def test_a_runs_own_files_are_never_an_output_even_with_force(output, run, corpus, capsys):
    directory = OUTPUTS[output][1]
    suffix = "" if directory else ".png" if "plot" in output else ".safetensors"
    targets = [run / "checkpoints" / f"mine{suffix}", run / "checkpoints" / "step_00000001" / f"mine{suffix}"]
    targets += [run / "hf", run / "hf" / "mine"] if directory else [run / "hf" / f"mine{suffix}"]
    if output == "export-out":
        targets += [run / "metrics.jsonl", run / "metadata.json", run / "model.safetensors"]
    before = _tree(run)
    for target in targets:
        rc, err = _mct(_argv(output, target, run, corpus, force=True), capsys)
        _refused(rc, err, target, "own files" if "step_" not in str(target) else "inside checkpoint")
    assert _tree(run) == before


@pytest.mark.parametrize("output", ["plan-plot", "report-plot", "export-out"])
def test_an_existing_regular_file_is_refused_then_replaced_with_force(output, run, corpus, tmp_path, capsys):
    target = tmp_path / ("notes.png" if "plot" in output else "notes.safetensors")
    _user_file(target)
    rc, err = _mct(_argv(output, target, run, corpus, force=False), capsys)
    _refused(rc, err, target, "already exists; pass --force")
    assert target.read_bytes() == b"the user's own notes\n"
    rc, err = _mct(_argv(output, target, run, corpus, force=True), capsys)
    assert rc == 0, err
    head = target.read_bytes()[:8]
    assert head == PNG if "plot" in output else head != b"the user", head
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]  # no temporary left


def test_prepare_replaces_only_an_earlier_dataset_with_force(corpus, tmp_path, capsys):
    out = tmp_path / "ds"
    argv = ["prepare", str(corpus), "--no-progress", "--workers", "1", "--out", str(out)]
    assert _mct(argv, capsys)[0] == 0
    first = _tree(out)
    _refused(*_mct(argv, capsys), out, "not an empty directory")
    (corpus / "b.txt").write_text("another document. " * 10)
    assert _mct([*argv, "--force"], capsys)[0] == 0
    assert _tree(out) != first and json.loads((out / "meta.json").read_text())["documents"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # the old one removed, no temporary


def test_an_empty_directory_is_a_new_directory_output(corpus, tmp_path, capsys):
    out = tmp_path / "ds"
    out.mkdir()
    assert _mct(["prepare", str(corpus), "--no-progress", "--workers", "1", "--out", str(out)], capsys)[0] == 0
    assert (out / "meta.json").is_file()


def test_force_replaces_a_directory_only_of_the_commands_own_files(tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "model-00001-of-00002.safetensors").write_bytes(b"x")
    writes = ("config.json", "*.safetensors")
    assert check_dir_output(out, "--out", force=True, writes=writes, command="mct export") == out
    (out / "sub").mkdir()  # a folder the export never makes: not ours to delete
    with pytest.raises(ValueError, match="holds 'sub' \\(a directory\\)"):
        check_dir_output(out, "--out", force=True, writes=writes, command="mct export")


def test_install_dir_swaps_an_earlier_output_whole(tmp_path):
    out, new = tmp_path / "out", tmp_path / ".out.new"
    out.mkdir()
    (out / "old.json").write_text("old")
    new.mkdir()
    (new / "new.json").write_text("new")
    with pytest.raises(ValueError, match="filled by another process"):  # not told to replace: nothing moves
        install_dir(new, out)
    assert [p.name for p in out.iterdir()] == ["old.json"] and (new / "new.json").is_file()
    install_dir(new, out, force=True)
    assert [p.name for p in out.iterdir()] == ["new.json"] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_target_that_becomes_a_link_before_the_rename_is_not_replaced(tmp_path):
    target, tmp = tmp_path / "plot.png", tmp_path / ".plot.png.tmp"
    _user_file(tmp_path / "notes.txt")
    tmp.write_bytes(b"new")
    target.symlink_to(tmp_path / "notes.txt")  # appeared after the check, before the rename
    with pytest.raises(ValueError, match="became a symbolic link"):
        replace_file(tmp, target)
    assert target.is_symlink() and (tmp_path / "notes.txt").read_bytes() == b"the user's own notes\n"
    assert not tmp.exists()


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "w.bin"
    _user_file(target)

    def fail(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError):
        write_file(target, fail)
    assert target.read_bytes() == b"the user's own notes\n" and [p.name for p in tmp_path.iterdir()] == ["w.bin"]


@pytest.mark.parametrize("make,words", [(os.mkfifo, "(a FIFO)"), (_user_file, "(a regular file)"),
                                        (lambda p: p.symlink_to(p.parent / "nowhere"), "which does not exist")],
                         ids=["fifo", "file", "dangling-symlink"])
def test_a_run_dir_that_cannot_be_one_is_named_as_what_it_is(make, words, tmp_path, capsys):
    target = tmp_path / "run"
    make(target)
    before = _tree(tmp_path)
    _refused(*_mct(["train", "--no-progress", "--run-dir", str(target), "--set", "train.steps=1"], capsys), target,
             words)
    assert _tree(tmp_path) == before


def test_a_run_dir_inside_another_runs_checkpoints_is_refused(run, capsys):
    before = _tree(run)
    target = run / "checkpoints" / "new"
    _refused(*_mct(["train", "--no-progress", "--run-dir", str(target), "--set", "train.steps=1"], capsys), target,
             "own files")
    assert _tree(run) == before
