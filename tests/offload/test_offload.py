"""Offload: the disk and host tiers, the chunk pipeline, and the engine with offloaded
state giving bit-identical results to the engine without (stages 0-3, 1-2 ranks)."""

from __future__ import annotations

import gc
import json
import os
import threading

import pytest
import torch

from mct.config import EngineConfig
from mct.engine import Engine
from mct.models.gpt import GPT, gpt_loss, optimizer_groups
from mct.offload import ChunkStream, DiskStore, HostStore, Item
from tests.distributed import run_distributed
from tests.helpers import adamw, batches, sgd_momentum, tiny_config


# ---- config ----
@pytest.mark.parametrize("section, match", [
    ({"offload": {"optimizer": "nvme"}}, "offload.optimizer = 'nvme'"),
    ({"offload": {"optimizer": "none", "params": "disk"}}, "needs offload.optimizer"),
    ({"offload": {"optimizer": "disk", "params": "disk"}, "zero": {"stage": 2}}, "set zero.stage = 3"),
    ({"offload": {"buffers": 1}}, "offload.buffers = 1"),
    ({"offload": {"chunk_mb": 0}}, "offload.chunk_mb = 0"),
])
def test_offload_config_rejects_mistakes_naming_the_key(section, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_dict(section)


def test_missing_offload_dir_is_created_and_removed_with_the_last_store(tmp_path):
    root = tmp_path / "a" / "b"
    first, second = DiskStore(str(root), name="rank0"), DiskStore(str(root), name="rank1")
    assert root.is_dir() and first.dir.startswith(str(root)) and second.dir.startswith(str(root))
    first.close()
    assert root.is_dir()  # rank 1's folder is still in it
    second.close()
    assert list(tmp_path.iterdir()) == []  # every folder mct made is gone, tmp_path stays
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="cannot be created"):
        DiskStore(str(tmp_path / "file" / "sub"))


# ---- stores and the stream ----
@pytest.mark.parametrize("store_cls", [DiskStore, HostStore])
def test_store_round_trips_ranges_of_records_in_any_dtype(store_cls, tmp_path):
    store = store_cls(str(tmp_path)) if store_cls is DiskStore else store_cls()
    a, b = torch.randn(1000), torch.randn(77).to(torch.bfloat16)
    store.allocate("a", 1000, torch.float32)
    store.allocate("b", 77, torch.bfloat16)
    store.write("a", 0, a)
    store.write("b", 0, b)
    store.write("a", 300, a[300:400] * 2)
    out = torch.empty(200)
    store.read("a", 250, 450, out)
    want = a[250:450].clone()
    want[50:150] *= 2
    assert torch.equal(out, want)
    out_b = torch.empty(77, dtype=torch.bfloat16)
    store.read("b", 0, 77, out_b)
    assert torch.equal(out_b, b)
    assert store.nbytes == 1000 * 4 + 77 * 2
    if store_cls is DiskStore:
        folder = store.dir
        assert os.path.isdir(folder) and os.path.dirname(folder) == str(tmp_path)
        store.close()
        assert not os.path.exists(folder)


def test_disk_store_short_read_of_a_truncated_file_raises(tmp_path):
    store = DiskStore(str(tmp_path))
    store.allocate("a", 1024, torch.float32)
    os.truncate(store.path, 100)
    with pytest.raises(OSError, match="short read"):
        store.read("a", 0, 1024, torch.empty(1024))


@pytest.mark.parametrize("slots", [2, 3])
def test_chunk_stream_reads_ahead_and_writes_behind_through_reused_buffers(slots, tmp_path):
    """Each chunk sees exactly its own data although buffers are reused, the reads
    of later chunks run on the I/O thread, and every write lands."""
    store = DiskStore(str(tmp_path))
    data = torch.arange(1000, dtype=torch.float32)
    store.allocate("x", 1000, torch.float32)
    store.write("x", 0, data)
    stream = ChunkStream(torch.device("cpu"), slots=slots, chunk_numel=128)
    chunks = [(a, min(a + 128, 1000)) for a in range(0, 1000, 128)]
    seen, threads = [], set()
    orig = store.read

    def read(*args):
        threads.add(threading.current_thread().name)
        orig(*args)
    store.read = read

    def compute(chunk, slot):
        a, b = chunk
        buf = stream.buffer(slot, "x", torch.float32, b - a)
        seen.append(torch.equal(buf, data[a:b]))
        buf.mul_(-1)
        return [(Item("x", store, "x", a, b), buf)]
    stream.run(chunks, lambda c: [Item("x", store, "x", *c)], compute)
    assert all(seen) and len(seen) == len(chunks)
    assert threads == {t for t in threads if t.startswith("mct-offload-io")} and threads
    out = torch.empty(1000)
    store.read("x", 0, 1000, out)
    assert torch.equal(out, -data)
    assert stream.pool_bytes() == slots * 128 * 4  # one buffer per slot, reused for every chunk
    stream.close()


def test_chunk_stream_surfaces_an_io_error_and_drains(tmp_path):
    store = DiskStore(str(tmp_path))
    store.allocate("x", 256, torch.float32)
    stream = ChunkStream(torch.device("cpu"), slots=2, chunk_numel=64)

    def bad_read(*args):
        raise OSError("disk gone")
    store.read = bad_read
    with pytest.raises(OSError, match="disk gone"):
        stream.run([(0, 64), (64, 128)], lambda c: [Item("x", store, "x", *c)], lambda c, s: [])
    stream.close()


# ---- the engine: offloaded == not offloaded, bit for bit ----
def _run(cfg: EngineConfig, rank: int, steps: int, optimizer=adamw, n_micro: int = 2):
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model)
    engine = Engine(model, optimizer, cfg, param_groups=optimizer_groups(model, 0.1))
    outs = [engine.train_step(batches(step, rank, n_micro), gpt_loss) for step in range(steps)]
    state = engine.full_state_dict()
    return [(o.loss, o.grad_norm, o.skipped) for o in outs], state, engine


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) for k in a)


def _compare(rank: int, world: int, stage: int, mode: str, offload: dict, optimizer, clip: float,
             tmp: str, reference: dict | None = None, persistent_numel: int = 0) -> dict:
    """Train without offload (unless ``reference`` holds that run's result for this
    stage and mode) and with ``offload``; compare step results and final weights."""
    base = {"zero": {"stage": stage, "persistent_numel": persistent_numel}, "precision": {"mode": mode},
            "train": {"grad_clip": clip}}
    key = (stage, mode, persistent_numel)
    if reference is None or key not in reference:
        ref_steps, ref_state, _ = _run(tiny_config(**base), rank, 3, optimizer)
        if reference is not None:
            reference[key] = ref_steps, ref_state
    else:
        ref_steps, ref_state = reference[key]
    cfg = tiny_config(**base, offload={"chunk_mb": 0.002, "dir": tmp, **offload})  # 512-element chunks
    steps, state, engine = _run(cfg, rank, 3, optimizer)
    gc.collect()
    folders = [f for f in os.listdir(tmp) if f.endswith(f"-rank{rank}")]
    engine.close()
    return {"steps_equal": steps == ref_steps, "state_equal": _same_bits(state, ref_state),
            "offloaded": engine.tracker.offloaded(), "live": engine.tracker.live(),
            "bytes": engine.model_state_bytes(), "opt_state": len(engine.optimizer.state),
            "folders": len(folders), "folders_after_close": len([f for f in os.listdir(tmp) if f in folders])}


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize("tier", ["disk", "cpu"])
def test_offloaded_optimizer_is_bit_identical_at_stage0(mode, tier, tmp_path):
    r = _compare(0, 1, 0, mode, {"optimizer": tier}, adamw, 1.0, str(tmp_path))
    assert r["steps_equal"] and r["state_equal"]
    assert r["opt_state"] == 0  # the store owns the optimizer state
    assert r["offloaded"][tier] > 0 and r["live"]["optimizer"] == 0


def test_fused_and_momentum_optimizers_step_identically_in_chunks(tmp_path):
    fused = lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, fused=True)  # noqa: E731
    for opt in (fused, sgd_momentum):
        r = _compare(0, 1, 0, "bf16", {"optimizer": "disk"}, opt, 0.5, str(tmp_path))
        assert r["steps_equal"] and r["state_equal"], opt


def _two_rank_offload(rank: int, world: int, tmp: str) -> dict:
    out, reference = {}, {}
    for stage, mode, offload in ((1, "bf16", {"optimizer": "disk"}), (2, "fp32", {"optimizer": "disk"}),
                                 (2, "bf16", {"optimizer": "cpu"}), (3, "fp32", {"optimizer": "disk"}),
                                 (3, "bf16", {"optimizer": "disk"}), (3, "bf16", {"optimizer": "disk", "params": "disk"}),
                                 (3, "fp32", {"optimizer": "cpu", "params": "disk"})):
        key = (stage, offload.get("params", "none"), offload["optimizer"], mode)
        out[key] = _compare(rank, world, stage, mode, offload, adamw, 1.0, tmp, reference)
    # stage 3 with small units kept gathered (persistent): published like stages 1/2
    out["persistent"] = _compare(rank, world, 3, "bf16", {"optimizer": "disk"}, adamw, 1.0, tmp, None, 20000)
    from tests.persistence.test_persistence_streaming import two_rank_checks
    out["streamed"] = two_rank_checks(rank, world, tmp)  # in this job: no second process start-up
    return out


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory):
    return run_distributed(_two_rank_offload, 2, str(tmp_path_factory.mktemp("offload")), timeout=300)


@pytest.mark.multirank
def test_offloaded_state_is_bit_identical_at_stages_1_to_3_on_two_ranks(two_rank):
    for results in two_rank:
        for key, r in results.items():
            if key != "streamed":
                assert r["steps_equal"] and r["state_equal"], key


@pytest.mark.multirank
def test_two_rank_offloaded_checkpoint_and_export_stream_exactly(two_rank):
    for results in two_rank:  # see tests/persistence/test_persistence_streaming.py: two_rank_checks
        assert all(results["streamed"].values()), results["streamed"]


@pytest.mark.multirank
def test_offloaded_bytes_are_reported_apart_and_leave_the_resident_count(two_rank):
    r = two_rank[0][(3, "disk", "disk", "bf16")]
    assert r["offloaded"]["disk"] > 0 and r["live"]["master"] == 0 and r["live"]["optimizer"] == 0
    assert r["bytes"]["master"] == 0 and r["bytes"]["grads"] == 0 and r["bytes"]["offload"] > 0
    assert (r["folders"], r["folders_after_close"]) == (1, 0)  # one folder per live engine and rank
    r = two_rank[0][(3, "none", "disk", "bf16")]
    assert r["bytes"]["params"] > 0  # the bf16 parameter shards stay resident


def _verify_offloaded(rank: int, world: int, data_path: str, tmp: str) -> dict:
    from mct.verify.compare import run_verify
    from tests.verify.test_verify import _cfg
    out = {}
    for stage, offload in ((1, {"optimizer": "disk"}), (2, {"optimizer": "disk"}),
                           (3, {"optimizer": "disk", "params": "disk"})):
        cfg = _cfg(data_path, stage, "fp32")
        cfg.offload.optimizer, cfg.offload.params, cfg.offload.dir = offload["optimizer"], offload.get("params", "none"), tmp
        out[stage] = run_verify(cfg, 3)
    return out


@pytest.mark.multirank
def test_verify_with_offload_passes_at_fp32_tolerance_at_stages_1_to_3(tmp_path):
    """``mct verify`` against the fp32 reference trainer, 2 ranks, 2 micro-batches:
    offloaded state passes at the fp32 tolerance at every stage."""
    from tests.verify.test_verify import _write_corpus
    reports = run_distributed(_verify_offloaded, 2, _write_corpus(tmp_path / "c.txt"), str(tmp_path),
                              timeout=300)[0]
    for stage, report in reports.items():
        assert report.passed, (stage, report.table())


# ---- no full model at initialization ----
class _Odd(torch.nn.Module):
    """Initialization the GPT does not exercise: a parameter computed from a random
    factory, an initializer on a view, a buffer, a tied weight, a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.scale = torch.nn.Parameter(torch.randn(8) * 0.5 + 1.0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        for b in self.blocks:
            torch.nn.init.normal_(b.weight[:4], std=0.3)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight
        self.frozen = torch.nn.Parameter(torch.rand(4), requires_grad=False)
        self.register_buffer("mask", torch.ones(8, 8).tril())


@pytest.mark.parametrize("model_fn", [lambda: GPT(tiny_config(model={"dropout": 0.1}).model), _Odd])
def test_meta_init_materializes_unit_by_unit_exactly_as_normal_construction(model_fn):
    from mct.offload import record_init
    torch.manual_seed(7)
    ref, ref_next = model_fn(), torch.rand(5)
    torch.manual_seed(7)
    model, program = record_init(model_fn)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert torch.equal(torch.rand(5), ref_next)  # the generator moved as a normal construction moves it
    for block in reversed(list(model.blocks)):  # any order, a block at a time
        program.materialize(list(block.parameters()))
        assert any(p.is_meta for p in model.parameters())
    program.materialize([*model.parameters(), *model.buffers()])
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert model.head.weight is model.emb.weight if hasattr(model, "emb") else True


def test_engine_built_from_meta_trains_bit_identically_and_holds_one_unit_at_a_time(tmp_path):
    from mct.offload import record_init
    cfg = tiny_config(zero={"stage": 3}, precision={"mode": "bf16"}, model={"n_layer": 4},
                      offload={"optimizer": "disk", "params": "disk", "dir": str(tmp_path)})
    ref_steps, ref_state, _ = _run(tiny_config(zero={"stage": 3}, precision={"mode": "bf16"}, model={"n_layer": 4}),
                                   0, 2)
    torch.manual_seed(cfg.seed)
    model, program = record_init(lambda: GPT(cfg.model))
    held, whole = [], []
    materialize, chunks = program.materialize, program.chunks

    def counting(p):  # storages holding data while a parameter is read: none (views are set after)
        held.append(len({q.untyped_storage().data_ptr() for q in model.parameters()
                         if not q.is_meta and q.untyped_storage().nbytes() > 0}))
        yield from chunks(p)

    def replaying(params, device="cpu"):
        whole.append(len(params))
        materialize(params, device)
    program.materialize, program.chunks = replaying, counting
    engine = Engine(model, adamw, cfg, param_groups=optimizer_groups(model, 0.1), init_program=program)
    steps = [engine.train_step(batches(s, 0, 2), gpt_loss) for s in range(2)]
    assert [(o.loss, o.grad_norm, o.skipped) for o in steps] == ref_steps
    assert _same_bits(engine.full_state_dict(), ref_state)
    # only the buffers replayed whole; each parameter read a chunk at a time as its unit is packed,
    # and no parameter holds data while one is read (no unit stays resident)
    n_params = len({id(p) for p in model.parameters()})
    assert whole == [len(list(model.buffers()))] and len(held) == n_params and max(held) == 0
    engine.close()


# ---- checkpoints ----
@pytest.mark.parametrize("save_offload, load_offload", [("disk", "none"), ("none", "disk"), ("disk", "cpu")])
def test_checkpoints_move_between_offloaded_and_resident_engines_exactly(save_offload, load_offload, tmp_path):
    """Train 2 steps, save, load into a fresh engine (other offload setting), train 1
    more: the same bits as 3 uninterrupted steps without offload."""
    def cfg(tier: str) -> EngineConfig:
        off = {} if tier == "none" else {"offload": {"optimizer": tier, "dir": str(tmp_path), "chunk_mb": 0.002}}
        return tiny_config(zero={"stage": 2}, precision={"mode": "bf16"}, train={"grad_clip": 1.0}, **off)
    ref_steps, ref_state, _ = _run(cfg("none"), 0, 3)

    def engine_for(tier: str) -> Engine:
        torch.manual_seed(cfg(tier).seed)
        model = GPT(cfg(tier).model)
        return Engine(model, adamw, cfg(tier), param_groups=optimizer_groups(model, 0.1))
    first = engine_for(save_offload)
    for s in range(2):
        first.train_step(batches(s, 0, 2), gpt_loss)
    first.save(str(tmp_path / "ckpt"))
    second = engine_for(load_offload)
    second.load(str(tmp_path / "ckpt"))
    out = second.train_step(batches(2, 0, 2), gpt_loss)
    assert (out.loss, out.grad_norm, out.skipped) == ref_steps[2]
    assert _same_bits(second.full_state_dict(), ref_state)
    first.close()
    second.close()


# ---- CUDA (skipped on CPU; run by benchmarks/gpu_check.sh) ----
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_cuda_offload_tiers_are_bit_identical_with_pinned_buffers_and_a_side_stream(tier, tmp_path):
    """The cpu tier on CUDA keeps state in pinned host memory and copies on a side
    stream; the disk tier bounces through pinned staging buffers. Both must give the
    bits of the engine without offload, fused AdamW included."""
    from mct.dist import DistContext
    ctx = DistContext(device=torch.device("cuda", 0))
    fused = lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, fused=True)  # noqa: E731

    def run(offload: dict):
        cfg = tiny_config(zero={"stage": 3}, precision={"mode": "bf16"}, train={"grad_clip": 1.0}, **offload)
        torch.manual_seed(cfg.seed)
        model = GPT(cfg.model)
        engine = Engine(model, fused, cfg, param_groups=optimizer_groups(model, 0.1), ctx=ctx)
        outs = [engine.train_step([(x.cuda(), y.cuda()) for x, y in batches(s, 0, 2)], gpt_loss) for s in range(3)]
        return [(o.loss, o.grad_norm) for o in outs], engine.full_state_dict(), engine
    ref_steps, ref_state, _ = run({})
    steps, state, engine = run({"offload": {"optimizer": tier, "params": tier, "dir": str(tmp_path),
                                            "chunk_mb": 0.002}})
    assert steps == ref_steps and _same_bits(state, ref_state)
    if tier == "cpu":
        assert engine.offload.store._tensors and all(t.is_pinned() for t in engine.offload.store._tensors.values())
    engine.close()


# ---- mct train ----
@pytest.mark.slow
def test_mct_train_with_disk_offload_ends_with_the_same_weights_and_losses(tmp_path):
    """The whole loop (meta construction, evaluation at stage 3, checkpoint, export):
    offloading changes no bit of the final weights or of any logged loss."""
    import json

    from safetensors.torch import load_file

    from mct.run.trainer import train
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"f{i}.txt").write_text(f"file {i}: " + "the quick brown fox jumps over the lazy dog. " * 30)
    base = {"seed": 5, "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16},
            "data": {"path": str(corpus), "micro_batch_size": 2, "grad_accum": 2}, "zero": {"stage": 3},
            "precision": {"mode": "bf16"},
            "train": {"steps": 3, "warmup_steps": 1, "eval_every": 2, "eval_batches": 1, "checkpoint_every": 2}}
    runs = {}
    for name, extra in (("none", {}), ("disk", {"offload": {"optimizer": "disk", "params": "disk",
                                                             "dir": str(tmp_path)}})):
        train(EngineConfig.from_dict({**base, **extra}), tmp_path / name, progress=False)
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = ([(r["loss"], r.get("val_loss"), r["grad_norm"]) for r in rows],
                      load_file(str(tmp_path / name / "model.safetensors")), rows[-1])
    assert runs["disk"][0] == runs["none"][0]
    assert _same_bits(runs["disk"][1], runs["none"][1])
    assert runs["disk"][2]["offloaded_bytes"]["disk"] > 0


def test_resident_state_shows_and_takes_back_the_state_of_a_resident_engine(tmp_path):
    """Inside ``resident_state`` an offloaded engine's masters and optimizer.state are
    those of the engine without offload; changes made there (write_back) are stored."""
    def engine(offload: dict) -> Engine:
        cfg = tiny_config(zero={"stage": 3}, precision={"mode": "bf16"}, **offload)
        torch.manual_seed(cfg.seed)
        model = GPT(cfg.model)
        e = Engine(model, adamw, cfg, param_groups=optimizer_groups(model, 0.1))
        for s in range(2):
            e.train_step(batches(s, 0), gpt_loss)
        return e
    plain = engine({})
    off = engine({"offload": {"optimizer": "disk", "dir": str(tmp_path), "chunk_mb": 0.002}})
    with off.offload.resident_state(off.optimizer, write_back=True):
        for u, v in zip(off.sharded.units, plain.sharded.units):
            assert torch.equal(u.master, v.master)
            a, b = off.optimizer.state[u.master], plain.optimizer.state[v.master]
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            for e, m in ((off, u.master), (plain, v.master)):
                e.optimizer.state[m]["exp_avg"].mul_(2)
    assert len(off.optimizer.state) == 0
    outs = [e.train_step(batches(2, 0), gpt_loss) for e in (off, plain)]
    assert outs[0].loss == outs[1].loss and _same_bits(off.full_state_dict(), plain.full_state_dict())
    off.close()


# ---- planning ----
PLANNED = [(2, "none", "bf16", {"optimizer": "disk"}), (3, "all", "bf16", {"optimizer": "disk", "params": "disk"}),
           (1, "selective", "fp32", {"optimizer": "disk"})]


def _planned_cfg(stage: int, policy: str, precision: str, offload: dict, tmp: str) -> EngineConfig:
    return tiny_config(zero={"stage": stage}, checkpointing={"policy": policy}, precision={"mode": precision},
                       offload={**offload, "dir": tmp})


def _measure_offloaded(rank: int, world: int, tmp: str) -> list[dict]:
    from tests.planner_models import random_batch, tied_frozen_reused
    from tests.storage_count import measure
    from mct.planner import token_loss
    return [measure(tied_frozen_reused, token_loss, lambda s, r: random_batch(s, r, 3), _planned_cfg(*c, tmp), rank)
            for c in PLANNED]


@pytest.mark.multirank
def test_dry_run_with_offload_predicts_resident_peak_and_offloaded_bytes_of_a_real_run(tmp_path):
    """A model it was not tuned for (tied, frozen, re-used parameters), 2 ranks: the
    planner's steady-state, first-step and init peaks are within 5% of every live
    storage counted independently, and the bytes it says are on disk are the run's."""
    from mct.planner import dry_run, token_loss
    from tests.planner_models import random_batch, tied_frozen_reused
    real = run_distributed(_measure_offloaded, 2, str(tmp_path))[0]
    for c, got in zip(PLANNED, real):
        run = dry_run(tied_frozen_reused, token_loss, random_batch(0, 0, 3), _planned_cfg(*c, str(tmp_path)), 2)
        for name, pred, meas in (("steady", run.peak, got["steps"][1]), ("first", run.first_step_peak, got["steps"][0]),
                                 ("init", run.init_peak, got["init"])):
            assert abs(pred - meas) <= 0.05 * meas, (c, name, pred, meas)
        assert run.offloaded == got["offloaded"] and run.offloaded["disk"] > 0, c
        assert run.phases[run.phase]["master"] == 0 and run.phases[run.phase]["optimizer"] == 0


@pytest.mark.slow
def test_auto_plans_offload_only_when_nothing_fits_without_it(monkeypatch):
    """zero.stage = auto: a budget that stage 3 meets keeps offload off; one only offload
    meets turns it on (disk on a CPU device, host memory for CUDA), with the prediction
    and the offloaded bytes in the choice; plan rows say what each keeps off the device."""
    import importlib

    from mct.planner import Grid, make_plan, resolve_auto
    from mct.task import gpt_task as planning_workload
    plan_module = importlib.import_module("mct.planner.plan")  # the package's plan() shadows the name
    runs: dict = {}
    real_predict = plan_module.predict

    def predict(work, cfg, world):  # each configuration dry-run once in this test (the suite's time)
        key = (world, cfg.zero.stage, cfg.offload.optimizer, cfg.offload.params, cfg.data.micro_batch_size)
        if key not in runs:
            runs[key] = real_predict(work, cfg, world)
        return runs[key]
    monkeypatch.setattr(plan_module, "predict", predict)
    base = tiny_config(zero={"stage": "auto"}, checkpointing={"policy": "all"}, precision={"mode": "bf16"},
                       model={"n_layer": 2, "d_model": 64, "n_head": 2, "vocab_size": 2048},
                       offload={"chunk_mb": 0.01})  # a pool far smaller than the state it streams
    work = planning_workload(base)
    plain = make_plan(work, EngineConfig.from_dict({**base.to_dict(), "zero": {"stage": 0}}), 2, None,
                      Grid(stages=(0, 1, 2, 3), policies=("all",), precisions=("bf16",),
                           offloads=("none", "optimizer=disk", "optimizer+params=disk")))
    rows = {(r["stage"], r["offload"]): r for r in plain.rows}
    assert (2, "optimizer+params=disk") not in rows  # parameter offload is stage 3's
    no_offload = min(r["peak"] for r in plain.rows if r["offload"] == "none")
    with_offload = min(r["peak"] for r in plain.rows if r["offload"] != "none")
    assert with_offload < no_offload
    assert rows[(3, "optimizer+params=disk")]["offloaded"]["disk"] > rows[(3, "optimizer=disk")]["offloaded"]["disk"] > 0
    assert rows[(3, "none")]["offloaded"] == {"cpu": 0, "disk": 0}

    def auto(budget: int, device: str = "cpu"):
        cfg = EngineConfig.from_dict({**base.to_dict(), "memory": {"budget": f"{budget}B",
                                                                     "budget_counts": "tensors"}})
        return resolve_auto(cfg, 2, work, device=device)
    cfg, choice = auto(no_offload)
    assert choice["offload"] == "none" and cfg.offload.optimizer == "none"
    cfg, choice = auto((with_offload + no_offload) // 2)
    assert choice["offload"].endswith("=disk") and cfg.offload.optimizer == "disk"
    assert choice["predicted_peak_bytes"] <= (with_offload + no_offload) // 2
    assert choice["predicted_offloaded_bytes"]["disk"] > 0
    assert plan_module.auto_offloads("cuda") == ("optimizer=cpu", "optimizer+params=cpu")  # host memory
    monkeypatch.setattr(plan_module, "_what_would_fit", lambda *a: "")  # its search is tested in test_planner
    with pytest.raises(ValueError, match="nothing fits .* offload.optimizer=disk"):
        auto(with_offload // 2)


@pytest.mark.slow
def test_mct_plan_compares_offload_choices_and_rejects_a_bad_one(capsys):
    from mct.cli import main
    args = ["plan", "--world-size", "2", "--stages", "3", "--policies", "all", "--precisions", "bf16",
            "--set", "model.n_layer=2", "--set", "model.d_model=32", "--set", "model.n_head=2",
            "--set", "model.seq_len=16"]
    assert main([*args, "--offloads", "none,optimizer=disk,optimizer+params=disk", "--json"]) == 0
    import json
    plan = json.loads(capsys.readouterr().out)
    assert [r["offload"] for r in plan["rows"]] == ["none", "optimizer=disk", "optimizer+params=disk"]
    assert plan["rows"][0]["offloaded"]["disk"] == 0 < plan["rows"][1]["offloaded"]["disk"]
    assert main([*args, "--offloads", "none,optimizer=cpu", "--wide"]) == 0
    out = capsys.readouterr().out
    assert "offload" in out.splitlines()[1] and "optimizer=cpu" in out
    assert main([*args, "--offloads", "optimizer=nvme"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "optimizer=nvme" in err and "optimizer+params=cpu|disk" in err


@pytest.mark.slow
def test_resume_moves_a_run_between_offloaded_and_resident_state_exactly(tmp_path):
    """`mct train` with disk offload, checkpoint after step 2; resumed to step 4 without
    offload (and a resident run resumed with it): the bytes of an uninterrupted
    offloaded run. No offload folder outlives a run."""
    from mct.persistence.resume import resume_config
    from mct.run.trainer import train
    from tests.persistence.test_resume import _write_corpus, tiny_run
    corpus = _write_corpus(tmp_path / "corpus")
    off = {"optimizer": "disk", "params": "disk", "dir": str(tmp_path / "off"), "chunk_mb": 0.002}
    (tmp_path / "off").mkdir()

    def run_cfg(steps: int, offload: dict) -> EngineConfig:
        d = tiny_run(corpus, steps=steps)
        return EngineConfig.from_dict({**d, "zero": {"stage": 3}, "precision": {"mode": "bf16"}, "offload": offload})
    train(run_cfg(4, off), tmp_path / "full", progress=False)
    want = (tmp_path / "full" / "model.safetensors").read_bytes()
    losses = [json.loads(x)["loss"] for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    for name, first, then in (("to_resident", off, ["offload.optimizer=none", "offload.params=none"]),
                              ("to_offloaded", {}, [f"offload.{k}={v}" for k, v in off.items()])):
        run = tmp_path / name
        train(run_cfg(2, first), run, progress=False)
        train(resume_config(run, ["train.steps=4", *then], 1), run, progress=False, resume=True)
        assert (run / "model.safetensors").read_bytes() == want, name
        assert [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()] == losses
    assert list((tmp_path / "off").iterdir()) == []


# ---- the host allocator ----
def test_host_malloc_auto_is_lean_only_for_offload_on_a_cpu_device(monkeypatch):
    from mct.memory import host
    for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"):
        monkeypatch.delenv(k, raising=False)
    assert host.resolve("auto", offload=True, device="cpu") == "lean"
    assert host.resolve("auto", offload=False, device="cpu") == "default"
    assert host.resolve("auto", offload=True, device="cuda") == "default"
    assert host.resolve("frugal", offload=False, device="cuda") == "frugal"
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert host.resolve("auto", offload=True, device="cpu") == "default"  # the user's setting wins
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")
    assert host.resolve("auto", offload=True, device="cpu") == "default"  # in glibc's tunables too
    with pytest.raises(ValueError, match="memory.host_malloc = 'tcmalloc'"):
        EngineConfig.from_dict({"memory": {"host_malloc": "tcmalloc"}})


_RSS_PROBE = r"""
import sys, torch
from mct.memory import host
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]) * 1024
mode = sys.argv[1]
if not host.for_building(mode):
    print("no-glibc"); sys.exit(0)
if mode == "lean":
    host.for_training(mode)
for _ in range(3):                       # freed large blocks raise glibc's default threshold
    torch.ones(16 * 2**18).add_(1)       # 16 MiB, touched
keep = torch.ones(1024)                  # a small block above the freed ones in the heap
host.trim()                              # their pages, resident or not (timing), given back first
before = rss()
big = torch.ones(16 * 2**18)
grown = rss() - before
del big
host.trim()
print(grown, rss() - before)
"""


@pytest.mark.parametrize("mode", ["frugal", "lean"])
def test_host_malloc_gives_freed_blocks_back_to_the_os(mode):
    """A 16 MiB block, freed, leaves the process's resident memory (frugal: it was its
    own mapping; lean: it came from the heap and the trim returns its pages)."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _RSS_PROBE, mode], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(["src", os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "no-glibc":
        pytest.skip("not glibc: memory.host_malloc is a no-op")
    grown, left = map(int, out.stdout.split())
    assert grown >= 15 * 2**20 and left < 2 * 2**20, (grown, left)


_FAULT_PROBE = r"""
import resource, sys, torch
from mct.memory import host
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
mode = sys.argv[1]
if host._libc() is None:
    print("no-glibc"); sys.exit(0)
host.for_building(mode)
host.for_training(mode)
keep = torch.ones(1024)
per_step = []
for step in range(10):                  # a step's temporaries: touched, then freed; 64 MiB is above
    f0 = faults()                        # glibc's 32 MiB dynamic ceiling
    a = torch.ones(16 * 2**18).add_(1)
    b = torch.ones(64 * 2**18).add_(1)
    c = torch.ones(4 * 2**18).add_(1)
    small = [torch.ones(256) for _ in range(50)]  # small blocks in between, as a step has
    del a, b, c, small
    per_step.append(faults() - f0)
print(*per_step)
"""


@pytest.mark.parametrize("mode", ["cache", "default"])
def test_host_malloc_cache_reuses_freed_pages_without_faults(mode):
    """'cache': once the heap has reached its steady state (the first steps), a step's
    freed temporaries are handed out again from pages already mapped: the later steps take
    (almost) no page faults. glibc's default maps the 64 MiB block afresh each step (every
    page faults again): the control that shows the probe can fail. Not zero in every step:
    ``posix_memalign`` asks a little more than a freed block of the same size holds, so a
    freed block the next one cannot use is possible, in a late step too; the real steps
    measured 11-525 faults against 33-308 thousand (benchmarks/host_malloc.py)."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _FAULT_PROBE, mode], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(["src", os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "no-glibc":
        pytest.skip("not glibc: memory.host_malloc is a no-op")
    per_step = list(map(int, out.stdout.split()))
    pages = 84 * 2**20 // 4096  # what a step touches
    if mode == "cache":
        # steady state (the last 5 of 10 steps): the typical step under 5% of its pages, all five
        # together under one step's worth (a stranded block re-faults one temporary now and then:
        # a fresh clone's run measured [21480, 15360, 0, 0, 0, 0, 0, 4096, 0, 0])
        last = per_step[-5:]
        assert sorted(last)[2] < pages // 20 and sum(last) < pages, per_step
    else:
        assert min(per_step[-3:]) > 64 * 2**20 // 4096 // 2, per_step


def test_host_malloc_cache_is_not_trimmed_after_steps():
    from mct.memory import host
    assert host.trims_steps("lean") and host.trims_steps("frugal")
    assert not host.trims_steps("cache") and not host.trims_steps("default")
    assert EngineConfig.from_dict({"memory": {"host_malloc": "cache"}}).memory.host_malloc == "cache"


def test_engine_counts_the_steps_page_faults():
    """``page_faults``: this process's minor faults during the step, an integer where the
    platform counts them; a step that maps fresh memory counts its pages."""
    import torch.nn as nn
    from mct import Engine
    from mct.memory import host
    if host.minor_faults() is None:
        pytest.skip("the platform counts no page faults")
    engine = Engine(nn.Linear(1024, 1024), None, EngineConfig.from_dict({"memory": {"host_malloc": "default"}}))

    def loss(model, x):
        big = torch.ones(48 * 2**18)  # 48 MiB, above glibc's mmap ceiling: a fresh mapping, every page touched
        return model(x).square().mean() + big[0] * 0
    out = engine.train_step(torch.randn(8, 1024), loss)
    assert isinstance(out.metrics["page_faults"], int) and out.metrics["page_faults"] >= 48 * 2**20 // 4096 // 2
