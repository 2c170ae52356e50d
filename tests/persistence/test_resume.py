"""Run checkpoints and `--resume` in process: fallback from damaged checkpoints, one
clean metrics history, resharding N -> M ranks across stages, run-dir reuse refused,
export equal to the final weights."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from mct.cli import main
from mct.config import EngineConfig
from mct.persistence.files import file_digest
from mct.persistence.resume import resume_config
from mct.persistence.run_dir import LOCK_FILE, RunLock, checkpoints, step_dir
from mct.run.trainer import train
from tests.distributed import run_distributed


def _write_corpus(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for i in range(12):
        (d / f"f{i:02d}.txt").write_text(f"file {i}: " + "the quick brown fox jumps over the lazy dog. " * 40)
    return d


def tiny_run(corpus: Path, **train_keys) -> dict:
    return {"seed": 5, "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16, "dropout": 0.1},
            "data": {"path": str(corpus), "micro_batch_size": 2, "grad_accum": 1},
            "train": {"steps": 6, "warmup_steps": 2, "eval_every": 3, "eval_batches": 1, "log_every": 1,
                      "checkpoint_every": 2, "keep_checkpoints": 3, "grad_clip": 1.0,  # as the CLI's recipe
                      **train_keys}}


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _resume(run: Path, *sets: str) -> None:
    train(resume_config(run, list(sets), 1), run, progress=False, resume=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """One uninterrupted single-process run with checkpoints after steps 2, 4 and 6."""
    root = tmp_path_factory.mktemp("base")
    run = root / "run"
    train(EngineConfig.from_dict(tiny_run(_write_corpus(root / "corpus"))), run, progress=False)
    assert [s for s, _ in checkpoints(run)] == [2, 4, 6]
    return run


def _copy(base: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(base, run)
    return run


def _damage_truncate(ck: Path, old: Path) -> None:
    f = ck / "engine" / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _damage_zero(ck: Path, old: Path) -> None:
    (ck / "rank0.json").write_bytes(b"")


def _damage_wrong_step(ck: Path, old: Path) -> None:
    shutil.copy(old / "rank0.json", ck / "rank0.json")  # a rank file of another step


def _damage_renamed(ck: Path, old: Path) -> None:
    shutil.rmtree(ck)
    shutil.copytree(old, ck)  # a whole checkpoint of step 4 under the name of step 6


def _damage_wrong_shape(ck: Path, old: Path) -> None:
    info = json.loads((ck / "engine.json").read_text())
    info["units"][0]["params"][0][1][0] += 1
    (ck / "engine.json").write_text(json.dumps(info))
    meta = json.loads((ck / "meta.json").read_text())  # a consistent manifest: only the shape is wrong
    meta["files"]["engine.json"] = file_digest(ck / "engine.json")
    (ck / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("damage,why", [(_damage_truncate, "bytes"), (_damage_zero, "0 bytes"),
                                        (_damage_wrong_step, "sha256"), (_damage_renamed, "named for step 6"),
                                        (_damage_wrong_shape, "has shape")])
def test_resume_falls_back_from_a_damaged_newest_checkpoint(base, tmp_path, capfd, damage, why):
    run = _copy(base, tmp_path)
    damage(step_dir(run, 6), step_dir(run, 4))
    _resume(run)
    err = capfd.readouterr().err
    warning = [line for line in err.splitlines() if "warning" in line]
    assert len(warning) == 1 and "step_00000006" in warning[0] and why in warning[0]
    assert "resuming from step_00000004" in warning[0]
    # the run continued from step 4 and ended exactly where the uninterrupted one did
    assert (run / "model.safetensors").read_bytes() == (base / "model.safetensors").read_bytes()
    assert [(r["step"], r["loss"]) for r in _rows(run)] == [(r["step"], r["loss"]) for r in _rows(base)]
    assert (run / "checkpoints" / "step_00000006.damaged").is_dir()
    resumes = json.loads((run / "metadata.json").read_text())["resumes"]
    assert [(r["from_step"], r["world_size"], r["zero_stage"]) for r in resumes] == [(4, 1, 0)]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["step"], e["action"]) for e in events] == [("resume", 4, "restore step_00000004")]


def test_resume_of_a_finished_run_changes_nothing_and_can_extend_it(base, tmp_path):
    run = _copy(base, tmp_path)
    _resume(run)
    assert (run / "model.safetensors").read_bytes() == (base / "model.safetensors").read_bytes()
    assert _rows(run) == _rows(base)
    _resume(run, "train.steps=8", "train.keep_checkpoints=1")
    assert [r["step"] for r in _rows(run)] == list(range(8))
    assert [s for s, _ in checkpoints(run)] == [8]
    assert json.loads((step_dir(run, 8) / "trainer.json").read_text())["config"]["train"]["steps"] == 8
    resumes = json.loads((run / "metadata.json").read_text())["resumes"]
    assert resumes[-1]["changed"] == {"train.steps": [6, 8], "train.keep_checkpoints": [3, 1]}


def test_no_usable_checkpoint_is_one_line_exit_2(base, tmp_path, capfd):
    run = _copy(base, tmp_path)
    for _, ck in checkpoints(run):
        (ck / "rank0.json").write_bytes(b"")
    assert main(["train", "--resume", str(run), "--no-progress"]) == 2
    err = capfd.readouterr().err.strip()
    assert err.startswith("mct: error: no usable checkpoint") and "\n" not in err


def test_resume_refuses_a_changed_corpus(base, tmp_path, capfd):
    run = _copy(base, tmp_path)
    corpus = Path(json.loads((run / "metadata.json").read_text())["config"]["data"]["path"])
    shutil.copytree(corpus, tmp_path / "saved")
    try:
        (corpus / "f00.txt").write_text("changed")
        assert main(["train", "--resume", str(run), "--no-progress", "--set", "train.steps=8"]) == 2
        assert "corpus at data.path changed" in capfd.readouterr().err
    finally:
        shutil.rmtree(corpus)
        shutil.copytree(tmp_path / "saved", corpus)


def test_resume_refuses_changes_that_make_another_run(base, capfd):
    before = _tree(base)
    for key in ("model.d_model=64", "seed=1", "precision.mode=bf16", "train.lr=0.1", "data.micro_batch_size=4",
                "optimizer.eps=0.5", "optimizer.betas=[0.8, 0.9]", "optimizer.state_dtype=int8"):
        assert main(["train", "--resume", str(base), "--set", key]) == 2
        err = capfd.readouterr().err.strip()
        name, value = key.split("=")
        assert err.startswith(f"mct: error: --resume cannot change {name} from ") and "\n" not in err, err
        assert "--run-dir" in err or "--init-from RUN_DIR --set optimizer.state_dtype=int8" in err, err
    assert "from 'fp32' to 'int8'" in err and "resume with optimizer.state_dtype=fp32" in err  # both values, the fix
    assert _tree(base) == before
    assert main(["train", "--resume", str(base), "--nproc", "4"]) == 2  # 1 micro-batch cannot split 4 ways
    assert "cannot split evenly" in capfd.readouterr().err


def _tree(run: Path) -> dict[str, tuple[str, int]]:
    return {str(p.relative_to(run)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(run.rglob("*")) if p.is_file()}


def test_a_run_dir_is_never_reused(base, tmp_path, capfd):
    before = _tree(base)
    for nproc in ("1", "2"):  # refused by the launcher too, before any worker starts
        assert main(["train", "--run-dir", str(base), "--nproc", nproc, "--set", "train.steps=1"]) == 2
        err = capfd.readouterr().err.strip()
        assert "already holds a run" in err and "--resume" in err and "\n" not in err
    assert _tree(base) == before
    (tmp_path / "file").write_text("x")
    for bad, why in ((tmp_path / "file", "is a file, not a directory"), (tmp_path / "file" / "sub", "not writable")):
        assert main(["train", "--run-dir", str(bad), "--set", "train.steps=1"]) == 2
        err = capfd.readouterr().err.strip()
        assert why in err and "\n" not in err


def test_a_run_dir_in_use_is_refused_in_one_line_and_left_unchanged(base, tmp_path, capfd):
    assert not (base / LOCK_FILE).exists()  # a finished run holds no lock
    run = _copy(base, tmp_path)
    before = _tree(run)
    lock = RunLock(run)  # as a run training in it holds
    try:
        for argv in (["--resume", str(run), "--set", "train.steps=8"], ["--run-dir", str(tmp_path / "new")]):
            if argv[0] == "--run-dir":
                lock.release()
                lock = RunLock(tmp_path / "new")  # a second new run racing the first for one directory
            assert main(["train", "--no-progress", *argv]) == 2
            err = capfd.readouterr().err.strip()
            assert "is in use by a running mct" in err and f"pid {os.getpid()}" in err and "\n" not in err, err
    finally:
        lock.release()
    assert _tree(run) == before and list((tmp_path / "new").iterdir()) == []


def test_a_change_the_schema_allows_is_honoured_and_recorded(base, tmp_path):
    """`mct train --resume` with a key a resume may change: the run continues with it, and
    metadata.json's resume entry records the key with both values."""
    run = _copy(base, tmp_path)
    shutil.rmtree(step_dir(run, 6))  # as if stopped after the checkpoint of step 4
    assert main(["train", "--resume", str(run), "--no-progress", "--set", "train.log_every=3",
                 "--set", "checkpointing.policy=all"]) == 0
    assert [r["step"] for r in _rows(run)] == [0, 1, 2, 3, 5]  # 4 is not a multiple of 3; the last step is logged
    assert all(r["recompute_policy"] == "all" for r in _rows(run)[4:])
    resume = json.loads((run / "metadata.json").read_text())["resumes"][-1]
    assert resume["from_step"] == 4
    assert resume["changed"] == {"train.log_every": [1, 3], "checkpointing.policy": ["none", "all"]}


def test_resume_with_no_steps_left_says_so_exits_0_and_records_nothing(base, tmp_path, capfd):
    run = _copy(base, tmp_path)
    before = _tree(run)
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    err = capfd.readouterr().err.strip()
    assert "already completed 6 steps" in err and "nothing to do" in err and "\n" not in err, err
    assert _tree(run) == before  # no resume record, no event, no rewritten metrics or checkpoint
    (run / "model.safetensors").unlink()  # stopped between its last checkpoint and its export
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert "wrote" in capfd.readouterr().err
    assert _tree(run).keys() == before.keys()
    assert (run / "model.safetensors").read_bytes() == (base / "model.safetensors").read_bytes()


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_newest_complete_checkpoint(tmp_path, monkeypatch):
    import resource
    import signal

    from mct.persistence import shards
    real, calls = shards.save_pieces, []

    def second_save_hits_a_full_disk(*args, **kwargs):
        # a file-size limit fails the write as a full disk does (EFBIG where a disk gives ENOSPC)
        calls.append(1)
        if len(calls) < 2:
            return real(*args, **kwargs)
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limit[1]))
        try:
            return real(*args, **kwargs)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)
            signal.signal(signal.SIGXFSZ, handler)
    monkeypatch.setattr(shards, "save_pieces", second_save_hits_a_full_disk)
    run = tmp_path / "run"
    with pytest.raises(ValueError) as e:
        train(EngineConfig.from_dict(tiny_run(_write_corpus(tmp_path / "corpus"), steps=4)), run, progress=False)
    msg = str(e.value)
    assert f"cannot write {step_dir(run, 4)}" in msg and "bytes needed" in msg and "\n" not in msg, msg
    assert [s for s, _ in checkpoints(run, complete_only=False)] == [2]  # the torn one is gone, step 2 is whole
    assert not [p for p in run.rglob("*") if ".tmp" in p.name]


def test_export_equals_the_final_weights(base, tmp_path, capfd):
    out = tmp_path / "w.safetensors"
    assert main(["export", str(base), "--out", str(out)]) == 0
    assert out.read_bytes() == (base / "model.safetensors").read_bytes()
    assert main(["export", str(tmp_path), "--out", str(out)]) == 2
    assert "neither a run directory nor a complete checkpoint" in capfd.readouterr().err


# ---- resharding ----
def _train_rank(rank: int, world: int, d: dict, run: str, resume_sets: list[str] | None) -> None:
    if resume_sets is None:
        train(EngineConfig.from_dict(d), run, progress=False)
    else:
        train(resume_config(run, resume_sets, world), run, progress=False, resume=True)


def _launch(world: int, d: dict, run: Path, resume_sets: list[str] | None = None) -> None:
    if world == 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as the spawned ranks
        try:
            _train_rank(0, 1, d, str(run), resume_sets)
        finally:
            torch.set_num_threads(threads)
    else:
        run_distributed(_train_rank, world, d, str(run), resume_sets)


def _rel_diff(a: Path, b: Path) -> float:
    from safetensors.torch import load_file
    sa, sb = load_file(str(a)), load_file(str(b))
    num = sum(float((sa[k] - sb[k]).double().square().sum()) for k in sb)
    return (num / sum(float(v.double().square().sum()) for v in sb.values())) ** 0.5


@pytest.mark.multirank
@pytest.mark.parametrize("world,stage,resumes", [(2, 2, [(1, 0), (3, 3)]), (1, 0, [(2, 1)])])
def test_resume_reshards_across_world_sizes_and_stages(tmp_path, world, stage, resumes):
    """A run with 6 micro-batches per step (world x grad_accum), dropout on, resumed
    from its step-4 checkpoint on another number of ranks at another stage, ends
    where the uninterrupted run ends, up to fp32 reduction order."""
    d = tiny_run(_write_corpus(tmp_path / "corpus"), steps=8, checkpoint_every=4, eval_every=0)
    d["data"]["grad_accum"] = 6 // world
    d["zero"] = {"stage": stage}
    whole = tmp_path / "whole"
    _launch(world, d, whole)
    from mct.persistence.export_file import export
    export(whole, tmp_path / "exported.safetensors")  # one process, whatever world size saved it
    assert (tmp_path / "exported.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()
    for new_world, new_stage in resumes:
        run = tmp_path / f"to{new_world}"
        shutil.copytree(whole, run)
        shutil.rmtree(step_dir(run, 8))
        _launch(new_world, d, run, [f"zero.stage={new_stage}"])
        rel = _rel_diff(run / "model.safetensors", whole / "model.safetensors")
        assert 0 <= rel < 1e-5, (new_world, new_stage, rel)
        rows, ref = _rows(run), _rows(whole)
        assert [r["step"] for r in rows] == list(range(8))
        assert all(abs(a["loss"] - b["loss"]) < 1e-5 for a, b in zip(rows, ref))
        resumes_meta = json.loads((run / "metadata.json").read_text())["resumes"]
        assert resumes_meta[-1]["world_size"] == new_world and resumes_meta[-1]["zero_stage"] == new_stage


@pytest.mark.slow
def test_a_resumed_run_keeps_its_per_block_checkpointing_and_trains_as_uninterrupted(tmp_path):
    """checkpointing.per_block is recorded with the run (metadata, each checkpoint's config)
    and a resume continues with it: the same losses as the run that was not stopped, the
    same blocks recomputed; `mct report` names it. Changing it on resume is allowed, a
    conflicting policy is one line."""
    from mct.reporting.report import load_run, plot_title, report_table
    d = tiny_run(_write_corpus(tmp_path / "corpus"), steps=6, checkpoint_every=2, eval_every=0)
    d["model"]["n_layer"] = 3
    d["checkpointing"] = {"per_block": {"all": 1, "selective": 1}}
    base = tmp_path / "base"
    train(EngineConfig.from_dict(d), base, progress=False)
    run = _copy(base, tmp_path)
    shutil.rmtree(step_dir(run, 6))  # as if stopped after the checkpoint of step 4
    _resume(run)
    recorded = json.loads((step_dir(run, 6) / "trainer.json").read_text())["config"]["checkpointing"]
    assert (recorded["policy"], recorded["per_block"]) == ("per_block", {"all": 1, "selective": 1})
    rows, want = _rows(run), _rows(base)
    assert [r["loss"] for r in rows] == [r["loss"] for r in want]
    assert all((r["recompute_policy"], r["recompute_checkpointed_blocks"], r["recompute_selective_blocks"])
               == ("all*1,selective*1", 2, 1) for r in rows)
    assert "checkpointing per block: all*1,selective*1" in report_table(load_run(run))
    assert "checkpointing all*1,selective*1" in plot_title(load_run(run))
    with pytest.raises(ValueError, match="checkpointing.policy = 'all' sets them all: keep one"):
        resume_config(run, ["checkpointing.policy=all"], 1)
    changed = resume_config(run, ["checkpointing.per_block=all=3"], 1).checkpointing
    assert (changed.policy, changed.per_block) == ("per_block", {"all": 3})
