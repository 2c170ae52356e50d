"""Weights export: streamed one unit at a time, byte-identical to safetensors' own
writer; ``mct export`` writes only new regular files (or one it is told to replace),
never a run's own files, with the umask's mode, and fails in one line leaving nothing."""

from __future__ import annotations

import os
import resource
import signal
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mct.cli import main
from mct.engine import Engine
from mct.models.gpt import GPT, gpt_loss, optimizer_groups
from mct.persistence.export import export_engine
from mct.persistence.safetensors_out import SafetensorsWriter
from tests.helpers import adamw, batches, checkpointed_run, tiny_config


def test_streamed_writer_is_byte_identical_to_save_file(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"b.weight": torch.randn(3, 5, generator=g), "a": torch.randn(7, generator=g),
               "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4), "z.bias": torch.randn(1, generator=g)}
    save_file(tensors, str(tmp_path / "want.safetensors"))
    w = SafetensorsWriter(tmp_path / "got.safetensors", {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()})
    for k in ["z.bias", "a", "empty", "scalar", "b.weight"]:  # any order
        w.put(k, tensors[k])
    w.commit()
    assert (tmp_path / "got.safetensors").read_bytes() == (tmp_path / "want.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["got.safetensors", "want.safetensors"]


def _export_rank(rank: int, world: int, out: str, offload: dict) -> bool:
    cfg = tiny_config(zero={"stage": 3}, precision={"mode": "bf16"}, offload={**offload, "dir": out + ".offload"})
    torch.manual_seed(0)
    model = GPT(cfg.model)
    model.wpe.weight.requires_grad_(False)  # a frozen parameter is exported too
    engine = Engine(model, adamw, cfg, param_groups=optimizer_groups(model, 0.1))
    engine.train_step(batches(0, rank), gpt_loss)
    want = {k: v.clone() for k, v in engine.full_state_dict().items()}
    export_engine(engine, out)
    engine.close()
    if rank == 0:
        save_file(want, out + ".want")
        return Path(out).read_bytes() == Path(out + ".want").read_bytes()
    return True


# two ranks with disk offload: tests/offload/test_offload.py::test_two_rank_offloaded_checkpoint_and_export_stream_exactly
@pytest.mark.parametrize("offload", [{"optimizer": "cpu"}, {"optimizer": "disk", "params": "disk"}],
                         ids=["stage3-cpu", "stage3-disk"])
def test_engine_export_equals_the_full_state_dict_byte_for_byte(tmp_path, offload):
    out = str(tmp_path / "model.safetensors")
    assert _export_rank(0, 1, out, offload)
    assert not (tmp_path / "model.safetensors.offload").exists()  # offload.dir made by the run, removed by it
    assert "wpe.weight" in load_file(out)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A directory shaped as a run (metadata.json, checkpoints/step_N) around a real checkpoint."""
    root = tmp_path_factory.mktemp("export")
    run, engine, _ = checkpointed_run(root)
    (run / "metadata.json").write_text("{}\n")
    save_file(engine.full_state_dict(), str(root / "want.safetensors"))
    return run


def _export(argv: list[str], capsys) -> tuple[int, str]:
    rc = main(["export", *argv])
    return rc, capsys.readouterr().err.strip()


def test_export_writes_a_new_file_with_the_umask_mode(run, tmp_path, capsys):
    out = tmp_path / "w.safetensors"
    old = os.umask(0o027)
    try:
        assert _export([str(run), "--out", str(out)], capsys)[0] == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
    assert out.read_bytes() == (run.parent / "want.safetensors").read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]  # no temporary left


def test_export_replaces_a_regular_file_only_with_force(run, tmp_path, capsys):
    out = tmp_path / "w.safetensors"
    out.write_text("keep me")
    rc, err = _export([str(run), "--out", str(out)], capsys)
    assert rc == 2 and "already exists; pass --force" in err and "\n" not in err
    assert out.read_text() == "keep me"
    assert _export([str(run), "--out", str(out), "--force"], capsys)[0] == 0
    assert out.read_bytes() == (run.parent / "want.safetensors").read_bytes()


def _symlink(p: Path) -> None:
    (p.parent / "target").write_text("target")
    p.symlink_to(p.parent / "target")


@pytest.mark.parametrize("make,kind", [(_symlink, "a symbolic link"), (os.mkfifo, "a FIFO")], ids=["symlink", "fifo"])
def test_export_never_replaces_what_is_not_a_regular_file(run, tmp_path, capsys, make, kind):
    out = tmp_path / "w.safetensors"
    make(out)
    before = sorted(os.listdir(tmp_path))
    rc, err = _export([str(run), "--out", str(out), "--force"], capsys)
    assert rc == 2 and kind in err and "\n" not in err
    assert sorted(os.listdir(tmp_path)) == before and os.path.lexists(out)
    assert stat.S_IFMT(os.lstat(out).st_mode) != stat.S_IFREG


@pytest.mark.parametrize("where", ["metadata.json", "metrics.jsonl", "model.safetensors",
                                   "checkpoints/step_00000001/x.safetensors", "checkpoints/w.safetensors"])
def test_export_never_writes_into_a_runs_own_files(run, capsys, where):
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    rc, err = _export([str(run), "--out", str(run / where), "--force"], capsys)
    assert rc == 2 and ("own files" in err or "inside checkpoint" in err) and "\n" not in err, err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_export_to_a_full_place_is_one_line_naming_path_and_bytes(run, tmp_path, capsys):
    # a file-size limit makes the reservation fail as a full disk would (EFBIG instead of ENOSPC)
    out = tmp_path / "w.safetensors"
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, old_limit[1]))
    try:
        rc, err = _export([str(run), "--out", str(out)], capsys)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    size = (run.parent / "want.safetensors").stat().st_size
    assert rc == 2 and str(out) in err and f"{size:,} bytes needed" in err and "\n" not in err, err
    assert list(tmp_path.iterdir()) == []
