"""Stage-3 gathers through shared memory (``mct.zero.shm``, ``distributed.shared_memory``):
gloo ranks on one host read each other's fp32 master shards (bf16/fp16 parameters: their
published casts) instead of sending them. The same bits as the messages, only inside a
step's window, and messages wherever sharing cannot be set up."""

from __future__ import annotations

import os
import time

import pytest
import torch

from mct.zero import shm as shared_mod
from tests.distributed import run_distributed
from tests.helpers import adamw, batches, engine_run, gpt_loss, tiny_config


def _shm_files() -> set[str]:
    return {f for f in os.listdir(shared_mod.SHM_DIR) if f.startswith("mct-")}


def slow_second_rank(groups: list[dict]) -> torch.optim.Optimizer:
    """AdamW whose step on rank 1 starts late: a rank that read rank 1's masters before
    rank 1 had written them (a window opened without its barrier) would gather stale weights."""
    opt = adamw(groups)
    step = opt.step
    rank = torch.distributed.get_rank()

    def late_step(*args, **kwargs):
        if rank == 1:
            time.sleep(0.3)
        return step(*args, **kwargs)
    opt.step = late_step
    return opt


def _bits(state: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    return {k: v.contiguous().view(torch.int32).reshape(-1).tolist() for k, v in state.items()}


def _run(rank: int, world: int, shared: bool, **sections) -> tuple:
    cfg = tiny_config(zero={"stage": 3, "bucket_mb": 0.002}, train={"grad_clip": 1.0},
                      distributed={"shared_memory": shared}, **sections)
    losses, state, engine, out = engine_run(cfg, rank, 3, optimizer=slow_second_rank, n_micro=2)
    evals = engine.eval_loss(batches(9, rank)[0], gpt_loss)  # outside a window: messages
    used = engine.shared is not None and engine.shared.windows == 3
    note = engine.shared_note
    # a published cast is a parameter copy: in the tracker's params and the reported state bytes
    casts = sum(u.published.numel() * u.published.element_size() for u in engine.sharded.units
                if u.published is not None)
    counted = (engine.tracker.live()["params"], engine.model_state_bytes()["params"])
    engine.close()
    return losses, evals, _bits(state), used, out.metrics["comm_bytes"], note, casts, counted


def _compare(rank: int, world: int) -> dict:
    before = _shm_files()
    out = {}
    cases = [("plain", {}), ("checkpointed", {"checkpointing": {"policy": "all"}}),
             ("bf16", {"precision": {"mode": "bf16"}})]
    if world == 2:  # fp16 shares casts as bf16 does: one world size is enough (the suite's time)
        cases.append(("fp16 checkpointed", {"precision": {"mode": "fp16"}, "checkpointing": {"policy": "all"}}))
    for name, sections in cases:
        on, off = _run(rank, world, True, **sections), _run(rank, world, False, **sections)
        fp32 = "precision" not in sections
        out[name] = {"used": on[3], "unused": not off[3], "losses": on[0] == off[0], "eval": on[1] == off[1],
                     "state": on[2] == off[2], "bytes": on[4] == off[4],
                     # fp32 shares the masters themselves; bf16/fp16 a cast of each, 2 bytes a parameter
                     "casts": (on[6] == 0) if fp32 else (on[6] > 0 and off[6] == 0),
                     "casts counted": on[7][0] - off[7][0] == on[6] and on[7][1] - off[7][1] == on[6]}
    out["files_left"] = sorted(_shm_files() - before)
    return out


def _room() -> bool:
    st = os.statvfs(shared_mod.SHM_DIR)
    return st.f_bavail * st.f_frsize > shared_mod.SLACK_BYTES + 2**20


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 3])
def test_stage3_gathers_read_peers_masters_with_the_messages_bits(world):
    if not os.path.isdir(shared_mod.SHM_DIR) or not _room():
        pytest.skip(f"no room in {shared_mod.SHM_DIR} for the shards (they would take messages)")
    for rank, res in enumerate(run_distributed(_compare, world)):
        assert res.pop("files_left") == [], rank  # every shard file unlinked once mapped
        for name, checks in res.items():
            assert all(checks.values()), (rank, name, checks)


def _fallback(rank: int, world: int) -> tuple:
    slack, shared_mod.SLACK_BYTES = shared_mod.SLACK_BYTES, 2**62  # no /dev/shm has room: messages
    try:
        return _run(rank, world, True), _run(rank, world, False)
    finally:
        shared_mod.SLACK_BYTES = slack


def _one_rank_without(rank: int, world: int) -> tuple:
    """Only rank 1 finds no shared-memory directory (as on another host): every rank must
    learn it before any uses its files, and keep the messages (no hang, no mixed paths)."""
    was = shared_mod.SHM_DIR
    if rank == 1:
        shared_mod.SHM_DIR = "/nonexistent-shm-dir"
    try:
        return _run(rank, world, True), _run(rank, world, False)
    finally:
        shared_mod.SHM_DIR = was


@pytest.mark.multirank
@pytest.mark.parametrize("case", [_fallback, _one_rank_without])
def test_no_room_in_dev_shm_keeps_the_messages(case):
    for (on, off) in run_distributed(case, 2):
        assert not on[3] and on[0] == off[0] and on[2] == off[2]
        assert on[5].startswith(shared_mod.SETUP_FAILED) and off[5] == ""  # a notice only where it was tried


def test_not_tried_where_it_cannot_apply():
    """One rank (fp32 or bf16) and other stages never touch /dev/shm."""
    before = _shm_files()
    for sections in ({"zero": {"stage": 3}}, {"zero": {"stage": 2}}, {"precision": {"mode": "bf16"}}):
        losses, _, engine, _ = engine_run(tiny_config(**sections), 0, 1)
        assert engine.shared is None and len(losses) == 1
    assert _shm_files() == before


def test_shard_files_of_dead_processes_are_removed(tmp_path, monkeypatch):
    """A start killed between creating its shard files and unlinking them leaves them in
    /dev/shm; the next start removes those of dead processes, never a live one's."""
    monkeypatch.setattr(shared_mod, "SHM_DIR", str(tmp_path))
    import subprocess
    import sys
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    stale = tmp_path / f"mct-0123456789abcdef-p{pid}-r1-u0"
    live = tmp_path / f"mct-0123456789abcdef-p{os.getpid()}-r0-u0"
    other = tmp_path / "mct-not-ours"
    for f in (stale, live, other):
        f.write_bytes(b"x")
    shared_mod._remove_stale()
    assert not stale.exists() and live.exists() and other.exists()


def test_open_file_limit_is_raised_for_the_peers_descriptors():
    """A deep model on many local ranks opens a descriptor per unit and peer: the soft limit
    is raised toward the hard one before the opens (in a child: limits are per process)."""
    import subprocess
    import sys
    code = ("import resource; from mct.zero import shm as shared; "
            "s, h = resource.getrlimit(resource.RLIMIT_NOFILE); resource.setrlimit(resource.RLIMIT_NOFILE, (64, h)); "
            "shared._allow_descriptors(2000); print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], h)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}).stdout.split()
    soft, hard = int(out[0]), int(out[1])
    assert soft >= min(hard if hard >= 0 else 2**31, 2000 + 64), (soft, hard)


def _load_then_step(rank: int, world: int, path: str) -> dict:
    """bf16 casts after a load: the load writes the masters between windows, so the next
    window's cast must come from the loaded weights, not from the engine's own (it has
    stepped once before the load: its casts hold its own weights then)."""
    from mct.engine import Engine
    from mct.models.gpt import GPT, optimizer_groups
    cfg = tiny_config(zero={"stage": 3}, precision={"mode": "bf16"}, train={"grad_clip": 1.0})
    _, _, first, _ = engine_run(cfg, rank, 1)  # one step, saved
    first.save(path)
    for step in (1, 2):
        first.train_step(batches(step, rank, 1), gpt_loss)
    want = _bits(first.full_state_dict())
    casts_used = first.shared is not None and any(u.published is not None for u in first.sharded.units)
    first.close()
    torch.manual_seed(cfg.seed + 1)  # other initial weights: a stale cast would gather these
    model = GPT(cfg.model)
    second = Engine(model, adamw, cfg, param_groups=optimizer_groups(model, 0.1))
    second.train_step(batches(0, rank, 1), gpt_loss)  # its own weights cast and stepped: then loaded over
    second.load(path)
    for step in (1, 2):
        second.train_step(batches(step, rank, 1), gpt_loss)
    got = _bits(second.full_state_dict())
    second.close()
    return {"casts": casts_used, "equal": got == want}


@pytest.mark.multirank
def test_a_loaded_engine_gathers_the_loaded_weights_casts(tmp_path):
    if not os.path.isdir(shared_mod.SHM_DIR) or not _room():
        pytest.skip(f"no room in {shared_mod.SHM_DIR} for the shards (they would take messages)")
    for res in run_distributed(_load_then_step, 2, str(tmp_path / "ck")):
        assert res == {"casts": True, "equal": True}, res
