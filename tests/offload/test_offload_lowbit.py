"""Offload of low-precision optimizer state (``optimizer.state_dtype`` bf16 / int8): the
store holds the state compressed (bf16 moments; int8 / uint8 codes and fp32 per-block
scales), the streamed step is the resident step bit for bit, and checkpoints, resume,
resharding, rollback snapshots and the planner's offloaded bytes work as for fp32 state."""

from __future__ import annotations

import os

import pytest
import torch

from mct.config import EngineConfig
from mct.engine import Engine
from mct.models.gpt import GPT, gpt_loss, optimizer_groups
from mct.optim import make_adamw, state_bytes_per_param
from mct.optim.lowbit import BLOCK
from tests.distributed import run_distributed
from tests.helpers import batches, tiny_config

STORED = {"bf16": {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16},
          "int8": {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8,
                   "exp_avg_scale": torch.float32, "exp_avg_sq_scale": torch.float32}}
"""The records each moment keeps in the store, by state dtype."""


def _cfg(state_dtype: str, stage: int, offload: dict | None, tmp: str) -> EngineConfig:
    off = {"offload": {**offload, "dir": tmp, "chunk_mb": 0.002}} if offload else {}  # 512-element chunks
    return tiny_config(zero={"stage": stage}, precision={"mode": "bf16"}, train={"grad_clip": 1.0},
                       optimizer={"state_dtype": state_dtype}, **off)


def _engine(cfg: EngineConfig) -> Engine:
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model)
    return Engine(model, make_adamw(cfg.optimizer, lr=1e-2, seed=cfg.seed), cfg,
                  param_groups=optimizer_groups(model, 0.1))


def _train(e: Engine, steps: range, rank: int = 0) -> list[tuple]:
    return [(o.loss, o.grad_norm, o.skipped) for o in (e.train_step(batches(s, rank, 2), gpt_loss) for s in steps)]


def _state(e: Engine) -> dict[str, torch.Tensor]:
    """Weights (fp32, by name) and this rank's optimizer state pieces, as they are stored."""
    return {**{f"w/{k}": v for k, v in e.full_state_dict().items()},
            **{k: v.detach().clone() for k, v in e.state_dict()["tensors"].items()}}


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def int8_stage3(tmp_path_factory) -> tuple[list[tuple], dict[str, torch.Tensor]]:
    """3 uninterrupted steps with int8 state at stage 3, resident: (step results, state)."""
    ref = _engine(_cfg("int8", 3, None, str(tmp_path_factory.mktemp("ref"))))
    return _train(ref, range(3)), _state(ref)


@pytest.mark.parametrize("state_dtype, stage, offload", [
    ("int8", 0, {"optimizer": "disk"}), ("int8", 3, {"optimizer": "disk", "params": "disk"}),
    ("bf16", 0, {"optimizer": "cpu"}), ("bf16", 3, {"optimizer": "disk"})])
def test_offloaded_low_precision_state_is_the_resident_state_bit_for_bit(state_dtype, stage, offload, tmp_path):
    """3 steps (2 micro-batches, clipping, 512-element chunks: up to 17 per shard) with the
    state offloaded: the same losses, weights and optimizer state bytes as resident."""
    ref = _engine(_cfg(state_dtype, stage, None, str(tmp_path)))
    ref_steps = _train(ref, range(3))
    e = _engine(_cfg(state_dtype, stage, offload, str(tmp_path)))
    assert _train(e, range(3)) == ref_steps
    got, want = _state(e), _state(ref)
    assert _same_bits(got, want)
    assert {k.rsplit("/", 1)[1]: v.dtype for k, v in got.items() if "/optim/" in k and v.dim()} == STORED[state_dtype]
    assert len(e.optimizer.state) == 0 and e.tracker.live()["optimizer"] == 0  # the store owns the state
    e.close()


def test_the_store_holds_the_compressed_state_and_its_file_is_that_size(tmp_path):
    """int8 state offloaded to disk: every unit's moment records are int8 / uint8 codes
    and one fp32 scale per 256 elements, ~2.03 bytes per element against fp32's 8; the
    file on disk is exactly its records (4 KiB aligned) and the tracker reports them."""
    sizes = {}
    for state_dtype in ("fp32", "int8"):
        e = _engine(_cfg(state_dtype, 0, {"optimizer": "disk"}, str(tmp_path)))
        _train(e, range(1))
        store = e.offload.store
        state = {k: r for k, r in store.records.items() if not k.endswith(".master")}
        S = sum(u.layout.shard_numel for u in e.sharded.units)
        sizes[state_dtype] = os.path.getsize(store.path), sum(r.nbytes for r in state.values())
        assert sizes[state_dtype][0] == sum(-(-r.nbytes // 4096) * 4096 for r in store.records.values())
        assert sizes[state_dtype][1] == state_bytes_per_param(state_dtype) * S
        assert e.tracker.offloaded()["disk"] == store.nbytes
        if state_dtype == "int8":
            assert {(k.split(".", 1)[1], r.dtype, r.numel * (BLOCK if "scale" in k else 1))
                    for k, r in state.items() if k.startswith("u0.")} == {
                (name, dt, e.sharded.units[0].layout.shard_numel) for name, dt in STORED["int8"].items()}
        e.close()
    assert sizes["int8"][0] < 0.7 * sizes["fp32"][0]  # the file: 4 + 2.03 bytes per element against 4 + 8


@pytest.mark.parametrize("save_offload, load_offload, how", [
    ("disk", "disk", "files"), ("disk", "none", "files"), ("none", "cpu", "files"), ("cpu", "disk", "memory")])
def test_resume_of_offloaded_int8_state_is_bit_identical_to_uninterrupted(save_offload, load_offload, how,
                                                                             int8_stage3, tmp_path):
    """2 steps, a checkpoint (``Engine.save``, streamed a piece at a time; or
    ``state_dict()`` in memory), a fresh engine loads it (offloaded or not) and takes
    step 3: the losses, weights and state of 3 uninterrupted steps."""
    def cfg(tier: str) -> EngineConfig:
        return _cfg("int8", 3, None if tier == "none" else {"optimizer": tier}, str(tmp_path))
    ref_steps, ref_state = int8_stage3
    first = _engine(cfg(save_offload))
    _train(first, range(2))
    second = _engine(cfg(load_offload))
    if how == "files":
        first.save(str(tmp_path / "ckpt"))
        second.load(str(tmp_path / "ckpt"))
    else:
        second.load_state_dict(first.state_dict())
    assert _train(second, range(2, 3)) == ref_steps[2:]
    assert _same_bits(_state(second), ref_state)
    first.close()
    second.close()


@pytest.mark.slow
def test_mct_train_resumes_an_offloaded_int8_run_bit_identically_and_reports_it(tmp_path):
    """`mct train` (stage 3, int8 state, optimizer and parameters on disk), checkpoint
    after step 2, resumed to step 4: the weights and losses of the uninterrupted run;
    `mct report` names the state dtype; no offload folder outlives a run."""
    from mct.persistence.resume import resume_config
    from mct.reporting.report import load_run, report_table
    from mct.run.trainer import train
    from tests.persistence.test_resume import _rows, _write_corpus, tiny_run
    corpus, off = _write_corpus(tmp_path / "corpus"), tmp_path / "off"

    def run_cfg(steps: int) -> EngineConfig:
        return EngineConfig.from_dict({**tiny_run(corpus, steps=steps), "zero": {"stage": 3},
                                       "precision": {"mode": "bf16"}, "optimizer": {"state_dtype": "int8"},
                                       "offload": {"optimizer": "disk", "params": "disk", "dir": str(off),
                                                   "chunk_mb": 0.002}})
    train(run_cfg(4), tmp_path / "full", progress=False)
    train(run_cfg(2), tmp_path / "resumed", progress=False)
    train(resume_config(tmp_path / "resumed", ["train.steps=4"], 1), tmp_path / "resumed", progress=False,
          resume=True)
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    assert (resumed / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()
    assert [r["loss"] for r in _rows(resumed)] == [r["loss"] for r in _rows(full)]
    assert "optimizer state: int8" in report_table(load_run(resumed))
    assert not off.exists() or list(off.iterdir()) == []


def test_checkpoint_of_offloaded_int8_state_holds_the_codes(tmp_path):
    """An offloaded int8 engine's checkpoint (streamed from the store) keeps the codes
    and scales as they are (their dtypes in the DCP metadata), and its data file is
    smaller than fp32 state's by about the 6 bytes per element the codes save (less
    the per-tensor headers of the two extra scale tensors per unit)."""
    from torch.distributed.checkpoint import FileSystemReader
    size = {}
    for state_dtype in ("fp32", "int8"):
        e = _engine(_cfg(state_dtype, 0, {"optimizer": "disk"}, str(tmp_path)))
        _train(e, range(1))
        e.save(str(tmp_path / state_dtype))
        size[state_dtype] = sum(f.stat().st_size for f in (tmp_path / state_dtype / "engine").glob("*.distcp"))
        n = sum(u.layout.numel for u in e.sharded.units)
        e.close()
    meta = FileSystemReader(str(tmp_path / "int8" / "engine")).read_metadata().state_dict_metadata
    stored = {k.rsplit("/", 1)[1]: m.properties.dtype for k, m in meta.items() if "/optim/" in k and m.size != (1,)}
    assert {k: v for k, v in stored.items() if k != "step"} == STORED["int8"], stored
    assert size["fp32"] - size["int8"] >= 0.85 * (8 - state_bytes_per_param("int8")) * n, (size, n)


def test_rollback_snapshot_of_offloaded_int8_state_restores_it_exactly(int8_stage3, tmp_path):
    """A snapshot in the store after step 1, two more steps, the snapshot restored, the
    same two steps again: the bytes of 3 uninterrupted steps (stage 3, disk)."""
    ref_steps, ref_state = int8_stage3
    e = _engine(_cfg("int8", 3, {"optimizer": "disk", "params": "disk"}, str(tmp_path)))
    _train(e, range(1))
    handle = e.snapshot_state("snap")
    _train(e, range(5, 7))  # other batches: the state moves on
    assert not _same_bits(_state(e), ref_state)
    e.load_snapshot_state(handle)
    assert _train(e, range(1, 3)) == ref_steps[1:]
    assert _same_bits(_state(e), ref_state)
    e.close()


def _dry_run(cfg: EngineConfig):
    from mct.planner import dry_run
    return dry_run(lambda: GPT(cfg.model), gpt_loss, batches(0, 0, 2), cfg, 1,
                   optimizer=make_adamw(cfg.optimizer, lr=1e-2, seed=cfg.seed),
                   param_groups=lambda m: optimizer_groups(m, 0.1))


def test_planner_predicts_the_offloaded_compressed_bytes_of_a_real_run(tmp_path):
    """The dry run (the engine on fake tensors) says how many bytes int8 state puts on
    disk: exactly the real run's, none of it resident."""
    cfg = _cfg("int8", 3, {"optimizer": "disk"}, str(tmp_path))
    run = _dry_run(cfg)
    assert run.phases[run.phase]["optimizer"] == 0 and run.offloaded["disk"] > 0
    e = _engine(cfg)
    _train(e, range(2))
    assert run.offloaded == e.tracker.offloaded()
    e.close()


@pytest.mark.slow
def test_planner_peaks_of_offloaded_int8_state_are_a_real_runs(tmp_path):
    """Its steady and first-step peaks are within 5% of every live storage of the real
    run (counted independently of the engine's tracker)."""
    from tests.storage_count import measure
    cfg = _cfg("int8", 3, {"optimizer": "disk"}, str(tmp_path))
    run = _dry_run(cfg)
    got = measure(lambda: GPT(cfg.model), gpt_loss, lambda s, r: batches(s, r, 2), cfg, 0,
                  optimizer=make_adamw(cfg.optimizer, lr=1e-2, seed=cfg.seed),
                  param_groups=lambda m: optimizer_groups(m, 0.1))
    for pred, meas in ((run.peak, got["steps"][1]), (run.first_step_peak, got["steps"][0])):
        assert abs(pred - meas) <= 0.05 * meas, (pred, meas)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_cuda_offloaded_int8_state_is_the_resident_state_bit_for_bit(tier, tmp_path):
    """On CUDA (pinned host records, side-stream copies; disk through pinned staging)
    the codes and scales stream through the device pool: the resident run's bits."""
    from mct.dist import DistContext
    ctx = DistContext(device=torch.device("cuda", 0))

    def run(offload: dict | None):
        cfg = _cfg("int8", 3, offload, str(tmp_path))
        torch.manual_seed(cfg.seed)
        model = GPT(cfg.model)
        e = Engine(model, make_adamw(cfg.optimizer, lr=1e-2, seed=cfg.seed), cfg,
                   param_groups=optimizer_groups(model, 0.1), ctx=ctx)
        outs = [e.train_step([(x.cuda(), y.cuda()) for x, y in batches(s, 0, 2)], gpt_loss) for s in range(3)]
        state = {k: v.cpu() for k, v in _state(e).items()}
        e.close()
        return [(o.loss, o.grad_norm) for o in outs], state
    steps, state = run({"optimizer": tier, "params": tier})
    ref_steps, ref_state = run(None)
    assert steps == ref_steps and _same_bits(state, ref_state)


# ---- two ranks: shards at offsets other than 0, resharding ----
def _two_rank(rank: int, world: int, tmp: str) -> dict:
    out = {}
    for stage, offload in ((1, {"optimizer": "disk"}), (3, {"optimizer": "cpu", "params": "disk"})):
        ref = _engine(_cfg("int8", stage, None, tmp))
        ref_steps = _train(ref, range(3), rank)
        e = _engine(_cfg("int8", stage, offload, tmp))
        out[stage] = _train(e, range(3), rank) == ref_steps and _same_bits(_state(e), _state(ref))
        if stage == 3:
            e.save(os.path.join(tmp, "ckpt"))
        e.close()
    return out


@pytest.mark.multirank
def test_two_rank_offloaded_int8_state_is_resident_bit_for_bit_and_reshards_to_one(tmp_path):
    """2 ranks, stages 1 and 3: offloaded int8 state is the resident state bit for bit
    (each rank's chunks placed at its shard's offset); the 2-rank checkpoint then loads
    into one offloaded rank exactly as into one resident rank, and they step alike."""
    results = run_distributed(_two_rank, 2, str(tmp_path), timeout=300)
    assert all(all(r.values()) for r in results), results
    engines = [_engine(_cfg("int8", 3, off, str(tmp_path))) for off in (None, {"optimizer": "disk"})]
    for e in engines:
        e.load(str(tmp_path / "ckpt"))
    assert _same_bits(_state(engines[0]), _state(engines[1]))
    assert _train(engines[0], range(3, 4)) == _train(engines[1], range(3, 4))
    assert _same_bits(_state(engines[0]), _state(engines[1]))
    for e in engines:
        e.close()
