"""The time model (mct.planner.steptime): the seconds its formula gives for handmade
counts and a handmade profile, the dry run's counts (recompute adds ops, stage 3 adds
collectives), depth extrapolation of the time, and plan rows carrying step_s and
tokens_per_s (also in `mct plan --json`)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from mct.cli import main
from mct.config import EngineConfig
from mct.machine import MachineProfile
from mct.models.gpt import GPT, gpt_loss
from mct.planner import dry_run
from mct.planner.grid import Grid
from mct.planner.depth import Prepared, extrapolated, shape_for
from mct.planner.grid import prepare_work
from mct.planner.plan import make_plan, predict
from mct.planner.steptime import PARALLEL_BYTES, Rates, rates_for, step_time
from mct.planner.work import StepWork, op_key
from mct.task.build import builds_on_meta
from mct.task.spec import Task
from tests.helpers import FakeWatch

L, D, S, V, B = 5, 32, 16, 96, 2


def _cfg(stage: int = 0, policy: str = "none", layers: int = L, **extra) -> EngineConfig:
    return EngineConfig.from_dict({"model": {"n_layer": layers, "n_head": 2, "d_model": D, "seq_len": S,
                                             "vocab_size": V, "dropout": 0.0},
                                   "zero": {"stage": stage}, "checkpointing": {"policy": policy}, **extra})


def _task(cfg: EngineConfig) -> Task:
    batch = (torch.zeros(B, S, dtype=torch.long), torch.zeros(B, S, dtype=torch.long))
    return Task(lambda: GPT(cfg.model), gpt_loss, batch)


def _profile(**extra) -> MachineProfile:
    """A handmade 4-core profile: fp32 one thread 1e9 FLOP/s for matmuls 16 wide, 8e9 from
    256 wide; 4 cores 3x as fast on large matmuls."""
    base = {"matmul_by_dim": {"fp32": [[16, 1e9], [64, 4e9], [256, 8e9]]},
            "elementwise_curve": [[1e5, 4e9], [1e7, 1e9]], "copy_all_bytes_per_s": 2e9,
            "op_overhead_s": {"1": 1e-5, "4": 2e-5},
            "collectives": {"gloo:2": {"all_reduce": [1e-4, 1e9], "reduce_scatter": [2e-4, 5e8],
                                       "all_gather": [3e-4, 2.5e8]}},
            "disk_bytes_per_s": 1e8, "random_elements_per_s": 1e8}
    return MachineProfile(device="cpu", name="handmade", flags=("avx2",), torch_version="x", threads=4,
                          matmul_one={"fp32": 1e10}, matmul_all={"fp32": 3e10}, matmul_size={"fp32": 1024},
                          memcpy_bytes_per_s=1e9, extra={**base, **extra})


RATES = Rates(matmul={"fp32": ((16.0, 1e9), (256.0, 4e9))}, speedup={"fp32": 1.0},
              elementwise=((1e5, 4e9), (1e7, 1e9)), op_s=1e-5,
              collectives={"all_reduce": (1e-4, 1e9), "reduce_scatter": (2e-4, 5e8)}, tiers={"disk": 1e8})


def test_handmade_counts_and_rates_give_exactly_the_formulas_seconds():
    """Each op on its roofline, the overhead per op, each collective's latency per bucket
    plus bytes over bandwidth, offload bytes over the tier's rate."""
    work = StepWork(ops={("fp32", 10 ** 6, 10 ** 5, 16): 3,    # matmul-bound: 1e6 / 1e9 s each
                         ("fp32", 10 ** 6, 10 ** 5, 256): 1,   # the same FLOPs, wide: 1e6 / 4e9 s
                         ("fp32", 10 ** 4, 10 ** 7, 64): 2,    # memory-bound: 1e7 / 1e9 s each
                         ("", 0, 0, 0): 5},                    # views: overhead only
                    comm={("all_reduce", 10 ** 6, 2): 1, ("reduce_scatter", 5 * 10 ** 5, 1): 4, ("object", 0, 1): 1},
                    offload={"disk": 10 ** 6, "cpu": 10 ** 6})  # 'cpu' has no rate here: counted in the ops
    t = step_time(work, RATES)
    assert math.isclose(t.compute_s, 3 * 1e-3 + 2.5e-4 + 2 * 1e-2, rel_tol=1e-12)
    assert math.isclose(t.overhead_s, 11 * 1e-5, rel_tol=1e-12)
    assert math.isclose(t.comm_s, (2 * 1e-4 + 1e-3) + 4 * (2e-4 + 1e-3) + 2 * 1e-4, rel_tol=1e-12)
    assert math.isclose(t.offload_s, 1e-2, rel_tol=1e-12)
    assert math.isclose(t.total, t.compute_s + t.overhead_s + t.comm_s + t.offload_s)
    # between measured dimensions: the rate interpolated in log-log; beyond them, the end's
    assert math.isclose(RATES.matmul_s("fp32", 1e6, 64), 1e6 / 2e9, rel_tol=1e-12)
    assert RATES.matmul_s("fp32", 1e6, 8) == 1e6 / 1e9 and RATES.matmul_s("fp32", 1e6, 4096) == 1e6 / 4e9
    mid = math.exp((math.log(4e9) + math.log(1e9)) / 2)  # halfway between 1e5 and 1e7 bytes
    assert math.isclose(RATES.memory_s(1e6), 1e6 / mid, rel_tol=1e-12)


def test_rates_from_a_handmade_profile_share_threads_and_bandwidth():
    """Large matmuls speed up by the measured every-core factor, small ones not; large
    elementwise ops run on every thread, the largest at most the every-core copy rate
    shared by the ranks on the machine; collectives and overhead as measured."""
    one, four = rates_for(_profile(), 1, 1, ranks_here=1), rates_for(_profile(), 1, 4, ranks_here=1)
    assert one.matmul_s("fp32", 1e9, 256) == pytest.approx(1e9 / 8e9)
    assert four.matmul_s("fp32", 2e9, 256) == pytest.approx(2e9 / 8e9 / 3)  # past the blend: the full 3x
    assert four.matmul_s("fp32", 1e4, 256) == pytest.approx(1e4 / 8e9)  # small: one thread's
    assert one.matmul_s("fp32", 1e6, 256) / 3 < four.matmul_s("fp32", 1e6, 256) < one.matmul_s("fp32", 1e6, 256)
    assert four.elementwise[0] == (1e5, 4e9)  # small: one thread
    assert four.elementwise[-1] == (1e7, min(4 * 1e9, 2 * 2e9))  # large: every thread, at most the copy rate
    assert one.op_s == 1e-5 and four.op_s == 2e-5
    two = rates_for(_profile(), 2, 1, ranks_here=2)  # two 1-thread ranks: each half the every-core copy rate
    assert two.elementwise[-1] == (1e7, min(1e9, 2 * 2e9 / 2))
    assert two.collectives["reduce_scatter"] == (2e-4, 5e8)
    bare = rates_for(_profile(op_overhead_s={}, collectives={}), 2, 1)
    assert bare.op_s == 0.0 and not bare.collectives and len(bare.notes) == 2


def test_threads_gain_what_the_profile_measured_at_each_size_not_the_thread_count():
    """Where the profile measured what every core gains over one by size
    (``elementwise_speedup``, ``matmul_speedup``), a rank's threads gain that: an
    elementwise op of 1e6 bytes on 4 threads 1.5x (not 4x), the part of it for 2 of the 4
    cores; a matmul the measured share of the large matmuls' 3x at its FLOPs, linear in log
    FLOPs between sizes, the full 3x from the large size on."""
    measured = _profile(elementwise_speedup=[[1e6, 1.5], [1e7, 3.5]], matmul_speedup=[[1e6, 2.0], [1e8, 2.5]],
                        elementwise_curve=[[1e5, 4e9], [1e6, 3e9], [1e7, 1e9]], copy_all_bytes_per_s=1e11)
    four, two = rates_for(measured, 1, 4, ranks_here=1), rates_for(measured, 1, 2, ranks_here=1)
    assert four.elementwise == ((1e5, 4e9), (1e6, 3e9 * 1.5), (1e7, 1e9 * 3.5))
    assert two.elementwise[1] == (1e6, pytest.approx(3e9 * (1 + 0.5 / 3)))
    assert four.matmul_s("fp32", 1e6, 256) == pytest.approx(1e6 / 8e9 / 2.0)  # 1 + (3 - 1) x 0.5
    assert four.matmul_s("fp32", 1e7, 256) == pytest.approx(1e7 / 8e9 / (1 + 2 * (0.5 + 0.25 / 2)))
    assert four.matmul_s("fp32", 2 * 1024 ** 3, 256) == pytest.approx(2 * 1024 ** 3 / 8e9 / 3)
    assert four.matmul_s("fp32", 1e4, 256) == pytest.approx(1e4 / 8e9 / 2.0)  # below: the smallest size's
    one = rates_for(measured, 1, 1, ranks_here=1)
    assert one.elementwise[1] == (1e6, 3e9) and one.matmul_s("fp32", 1e6, 256) == pytest.approx(1e6 / 8e9)


def test_more_recompute_never_predicts_faster_and_stage3_communicates_more():
    """Same model and stage: recomputing no block < two blocks whole (per_block) < every
    block whole, in FLOPs, ops and seconds; selective recomputes no matmul (fewer FLOPs
    than all) but more than none; its ops may outnumber all's (it replays the cheap ops
    and keeps the matmuls' outputs), and so, on a small model, may its time, as measured
    in benchmarks/time_model.py.
    At 2 ranks stage 3 gathers the parameters again in backward: more collective bytes
    and seconds than stage 2 when it gathers by messages; on one host (the dry run of a gloo
    run, ``distributed.shared_memory``) those gathers are copies, not collectives."""
    rates = rates_for(_profile(), 2, 1, ranks_here=2)
    task = _task(_cfg(layers=3))
    cfgs = {p: _cfg(3, p, layers=3) for p in ("none", "selective", "all")}
    cfgs["per_block"] = _cfg(3, "per_block", layers=3, checkpointing={"policy": "per_block", "per_block": {"all": 2}})
    work = {p: dry_run(task.model_fn, task.loss_fn, task.batch, c, 2).work for p, c in cfgs.items()}
    order = ("none", "per_block", "all")
    for key in (lambda w: w.flops, lambda w: w.n_ops, lambda w: step_time(w, rates).total):
        assert key(work["none"]) < key(work["per_block"]) < key(work["all"]), [key(work[p]) for p in order]
    assert work["none"].flops <= work["selective"].flops < work["all"].flops  # it keeps the matmuls' outputs
    assert step_time(work["none"], rates).total < step_time(work["selective"], rates).total
    msgs = {"distributed": {"shared_memory": False}}
    two = dry_run(task.model_fn, task.loss_fn, task.batch, _cfg(2, layers=3, **msgs), 2).work
    three = dry_run(task.model_fn, task.loss_fn, task.batch, _cfg(3, layers=3, **msgs), 2).work
    assert three.comm_bytes > two.comm_bytes
    assert step_time(three, rates).comm_s > step_time(two, rates).comm_s
    assert {k for k, _, _ in three.comm} >= {"reduce_scatter", "all_gather"}
    shared = work["none"]  # the default: the gathers read the peer's masters from shared memory
    gathers = sum(b * n for (k, b, _), n in three.comm.items() if k == "all_gather")
    assert not any(k == "all_gather" for k, _, _ in shared.comm) and gathers > 0
    assert shared.bytes_moved - three.bytes_moved >= gathers  # the peer's half read and written
    assert step_time(shared, rates).comm_s < step_time(three, rates).comm_s


def test_a_dry_runs_shared_memory_gathers_cost_the_same_ops_at_any_world():
    """The dry run stands in for the peers' shared-memory reads with at most two copies per
    gather, whatever the world: one per peer made `auto`'s search up to 4096 ranks (a budget
    nothing fits) take 85 s on a two-layer model instead of 8."""
    task = _task(_cfg(3, "none", layers=3))
    ops = {w: dry_run(task.model_fn, task.loss_fn, task.batch, _cfg(3, "none", layers=3), w).work.n_ops
           for w in (8, 256)}
    assert ops[256] < 1.2 * ops[8], ops


def test_one_rank_moves_nothing_between_ranks():
    task = _task(_cfg(3, "none"))
    work = dry_run(task.model_fn, task.loss_fn, task.batch, _cfg(3, "none"), 1).work
    assert work is not None and not work.comm and work.flops > 0


@pytest.mark.parametrize("stage,policy", [(0, "none"), (3, "all")])
def test_extrapolated_time_equals_the_full_dry_runs(stage, policy):
    """Depth extrapolation extends the counts linearly (signed: an op whose size grows
    with the depth has a key per depth): the same ops, FLOPs and collective bytes as a dry
    run of every block, and the same seconds within 0.1% (such an op's seconds are
    extended linearly from the copies' sizes, while its rate depends on its size)."""
    cfg = _cfg(stage, policy)
    task = _task(cfg)
    rates = rates_for(_profile(), 2, 1, ranks_here=2)
    prepared = prepare_work(task, cfg)
    assert isinstance(prepared, Prepared)
    shape = shape_for(prepared.stack, cfg, cheaper_only=False)  # 5 blocks: copies of 3 and 4, m = 2
    ext = extrapolated(prepared, cfg, 2, task.batch, meta_init=builds_on_meta(cfg), shape=shape)
    full = predict(task, cfg, 2)
    assert ext.peak == full.peak  # extrapolated indeed, to the byte
    assert ext.work.n_ops == full.work.n_ops and ext.work.flops == full.work.flops
    assert ext.work.comm_bytes == full.work.comm_bytes
    assert step_time(ext.work, rates).total == pytest.approx(step_time(full.work, rates).total, rel=1e-3)


def test_op_key_counts_flops_bytes_and_views():
    a, b = torch.ones(4, 8), torch.ones(8, 3)
    assert op_key(torch.ops.aten.mm.default, (a, b), {}, a @ b) == ("fp32", 2 * 4 * 8 * 3, 4 * (32 + 24 + 12), 3, "")
    assert op_key(torch.ops.aten.view.default, (a, [32]), {}, a.view(32)) == ("", 0, 0, 0, "")
    alias = torch.ops.aten._unsafe_view.default(a, [32])  # a view autograd does not track: moves nothing
    assert alias.data_ptr() == a.data_ptr()
    assert op_key(torch.ops.aten._unsafe_view.default, (a, [32]), {}, alias) == ("", 0, 0, 0, "")
    assert op_key(torch.ops.aten.add.Tensor, (a, a), {}, a + a) == ("fp32", 0, 4 * 32 * 2, 0, "light")
    soft = torch.ops.aten._softmax.default
    assert op_key(soft, (a, -1, False), {}, soft(a, -1, False)) == ("fp32", 0, 4 * 32 * 2, 0, "softmax")
    gelu = torch.ops.aten.gelu.default
    assert op_key(gelu, (a,), {}, gelu(a))[4] == ""  # the usual mix


def test_plan_rows_carry_step_s_and_tokens_per_s(capsys):
    """make_plan's rows and `mct plan --json` (the seeded profile of the test session)."""
    cfg = _cfg()
    plan = make_plan(_task(cfg), cfg, 2, None, Grid(stages=(0, 3), policies=("none",), precisions=("fp32",)),
                     rates=RATES, advise=False)
    for r in plan.rows:
        assert r["step_s"] > 0 and r["tokens_per_s"] == pytest.approx(B * S * 2 / r["step_s"])
        assert r["step_s"] == pytest.approx(sum(r["time"].values()))
    assert main(["plan", "--json", "--world-size", "2", "--stages", "0", "--policies", "none", "--precisions",
                 "fp32", "--set", "model.n_layer=2", "--set", "model.d_model=32", "--set", "model.n_head=2",
                 "--set", "model.seq_len=16", "--set", "model.vocab_size=96"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert row["step_s"] > 0 and row["tokens_per_s"] > 0 and row["time"]["comm_s"] > 0


def test_random_draws_and_collective_waits_are_timed_at_their_measured_rates():
    """Elements a random op draws (dropout's masks: ~50x an add's bytes on a CPU) over the
    measured random-number rate, on top of their op's bytes; a rank's measured wait for the
    slower rank once per collective call."""
    rates = dataclasses.replace(RATES, random_per_s=1e8, wait_s=1e-3)
    work = StepWork(ops={("fp32", 0, 4 * 10 ** 4, 0): 3}, comm={("all_reduce", 10 ** 6, 2): 1, ("object", 0, 1): 1},
                    random={10 ** 4: 3})
    t, bare = step_time(work, rates), step_time(work, RATES)
    assert math.isclose(t.compute_s - bare.compute_s, 3 * 10 ** 4 / 1e8, rel_tol=1e-12)
    assert math.isclose(t.comm_s - bare.comm_s, 2 * 1e-3, rel_tol=1e-12)


def test_dropout_is_counted_as_random_draws_and_extrapolated_with_depth():
    """The dry run counts every element dropout draws (forward, and again where a block is
    recomputed); none without dropout; depth extrapolation extends them as the ops."""
    def work(policy: str, dropout: float, layers: int = L):
        cfg = _cfg(0, policy, layers=layers)
        cfg = EngineConfig.from_dict({**cfg.to_dict(), "model": {**cfg.to_dict()["model"], "dropout": dropout}})
        task = _task(cfg)
        return dry_run(task.model_fn, task.loss_fn, task.batch, cfg, 1).work

    def drawn(w):
        return sum(e * n for e, n in w.random.items())
    assert not work("none", 0.0).random
    none, every = work("none", 0.1), work("all", 0.1)
    assert drawn(none) >= L * B * S * D and drawn(every) > drawn(none)
    a, b = work("none", 0.1, 3), work("none", 0.1, 4)
    assert drawn(a.extend([(b, 2)])) == drawn(none)


def test_overhead_and_wait_of_ranks_at_once_are_read_by_world_or_fall_back():
    """A world's rates read the per-op overhead and wait measured with that many ranks
    stepping at once; without them, one process alone's overhead, named in the notes."""
    prof = _profile(op_overhead_s={"1": 1e-5, "1x2": 3e-5}, collective_wait_s={"1x2": 2e-3})
    two = rates_for(prof, 2, 1, ranks_here=2)
    assert two.op_s == 3e-5 and two.wait_s == 2e-3 and two.random_per_s == 1e8
    alone = rates_for(_profile(), 2, 1, ranks_here=2)
    assert alone.op_s == 1e-5 and alone.wait_s == 0.0 and any("alone" in n for n in alone.notes)
    assert rates_for(prof, 1, 1, ranks_here=1).wait_s == 0.0


def test_fused_attention_is_counted_apart_and_timed_at_its_own_rate():
    """The CPU's fused attention kernels (forward and backward) are counted apart from the
    other ops (still in n_ops and flops) and timed at their measured curve by head width
    (bf16's backward runs ~10x below a bf16 matmul of its FLOPs), a matmul's without one."""
    task = _task(_cfg())
    work = dry_run(task.model_fn, task.loss_fn, task.batch, _cfg(), 1).work
    phases = {k[0] for k in work.attention}
    assert phases == {"forward", "backward"} and all(k[1] == "fp32" and k[4] == D // 2 for k in work.attention)
    assert work.n_ops == sum(work.ops.values()) + sum(work.attention.values())
    one = StepWork(attention={("backward", "fp32", 10 ** 6, 10, 16): 2})
    timed = dataclasses.replace(RATES, attention={"fp32": {"backward": ((16.0, 1e8), (64.0, 4e8))}})
    assert math.isclose(step_time(one, timed).compute_s, 2 * 1e6 / 1e8, rel_tol=1e-12)
    assert math.isclose(step_time(one, RATES).compute_s, 2 * RATES.matmul_s("fp32", 1e6, 16), rel_tol=1e-12)
    assert set(rates_for(_profile(attention_by_dim={"fp32": {"forward": [[16, 1e9]]}}), 1, 1).attention["fp32"]) == {
        "forward"}


def test_an_elementwise_op_is_timed_at_its_dtypes_curve():
    """A CPU's bf16 elementwise kernels convert to fp32 and back: per byte they run at about
    half fp32's rate (measured per dtype, ``extra['elementwise_by_dtype']``). An op of a
    dtype with its own curve is timed on it; one without, on fp32's."""
    from mct.planner.steptime import Rates
    fp32, bf16 = ((2.0**16, 10e9), (2.0**22, 10e9)), ((2.0**16, 5e9), (2.0**22, 5e9))
    rates = Rates({"fp32": ((1.0, 1e11),)}, {"fp32": 1.0}, fp32, 0.0, elementwise_by={"bf16": bf16})
    n = 2.0**20
    assert rates.memory_s(n, "bf16") == pytest.approx(2 * rates.memory_s(n, "fp32"))
    assert rates.memory_s(n, "fp16") == rates.memory_s(n) == pytest.approx(n / 10e9)


def test_an_elementwise_op_of_a_measured_kind_is_timed_at_its_kinds_curve():
    """Arithmetic runs several times the usual mix's rate and a safe softmax several times
    slower (``extra['elementwise_by_kind']``): an op of a kind measured in its dtype is timed
    on that curve, threaded as the mix's; any other on the mix's; a key built by hand
    without a kind is the mix's."""
    fp32 = ((2.0**16, 10e9), (2.0**22, 10e9))
    light = {"fp32": ((2.0**16, 40e9), (2.0**22, 40e9))}
    rates = Rates({"fp32": ((1.0, 1e11),)}, {"fp32": 1.0}, fp32, 0.0, elementwise_kinds={"light": light})
    n = 2.0**20
    assert rates.memory_s(n, "fp32", "light") == pytest.approx(n / 40e9)
    assert rates.memory_s(n, "fp32", "softmax") == rates.memory_s(n, "bf16", "light") == pytest.approx(n / 10e9)
    work = StepWork(ops={("fp32", 0, 2 ** 20, 0, "light"): 2, ("fp32", 0, 2 ** 20, 0): 1})
    assert step_time(work, rates).compute_s == pytest.approx(2 * n / 40e9 + n / 10e9)
    prof = _profile(elementwise_curve=[[2.0**16, 10e9], [2.0**22, 10e9]],
                    elementwise_by_kind={"light": {"fp32": [[2.0**16, 40e9], [2.0**22, 40e9]]}})
    two = rates_for(prof, 1, 2)
    assert two.memory_s(2.0**16, "fp32", "light") / two.memory_s(2.0**16, "fp32") == pytest.approx(0.25)
    assert two.memory_s(2.0**23, "fp32", "light") == two.memory_s(2.0**23, "fp32")  # both at the copy share


def test_the_per_byte_cost_is_overhead_on_every_byte_moved_and_is_read_by_world():
    """A real step's kernels run slower than the profile's microbenchmarks time them (inputs
    out of the caches, fresh allocations): the measured cost per byte the ops move is added
    to the overhead term, nothing else; a world reads its ranks' cost, else one process
    alone's, else none."""
    work = StepWork(ops={("fp32", 10 ** 6, 4 * 10 ** 4, 64): 3, ("", 0, 0, 0): 2},
                    comm={("all_reduce", 10 ** 6, 1): 1}, attention={("forward", "fp32", 10 ** 6, 10 ** 3, 16): 1})
    assert work.bytes_moved == 3 * 4 * 10 ** 4 + 10 ** 3
    bare, slow = step_time(work, RATES), step_time(work, dataclasses.replace(RATES, byte_s=1e-10))
    assert math.isclose(slow.overhead_s - bare.overhead_s, work.bytes_moved * 1e-10, rel_tol=1e-12)
    assert (slow.compute_s, slow.comm_s, slow.offload_s) == (bare.compute_s, bare.comm_s, bare.offload_s)
    big = StepWork(ops={("fp32", 0, PARALLEL_BYTES, 0): 1, ("fp32", 0, PARALLEL_BYTES - 1, 0): 1})
    two = step_time(big, dataclasses.replace(RATES, byte_s=1e-10, threads=2)).overhead_s - step_time(big, RATES).overhead_s
    assert math.isclose(two, (PARALLEL_BYTES / 2 + PARALLEL_BYTES - 1) * 1e-10, rel_tol=1e-12)  # split over threads as the kernel
    prof = _profile(byte_overhead_s={"1": 1e-10, "1x2": 3e-10})
    assert rates_for(prof, 2, 1, ranks_here=2).byte_s == 3e-10
    assert rates_for(prof, 1, 1).byte_s == 1e-10
    assert rates_for(_profile(byte_overhead_s={"1": 1e-10}), 2, 1, ranks_here=2).byte_s == 1e-10
    assert rates_for(_profile(), 1, 1).byte_s == 0.0


def test_the_overhead_fit_separates_per_op_cost_from_the_per_byte_cost():
    """The tiny model's ops move almost nothing (their rest beyond the compute is dispatch),
    the sized model's move what a small model's do: steps made of a known per-op and
    per-byte cost give both back; a per-byte cost the steps put below 0 is 0 and the per-op
    overhead is the tiny steps' rest."""
    from mct.planner.overhead import fit_overhead, quantile

    def steps(ops: int, nbytes: int, op_s: float, byte_s: float) -> tuple[float, int, int]:
        return ops * op_s + nbytes * byte_s, ops, nbytes
    tiny = [steps(382, 2 * 10 ** 6, 25e-6, 8e-11), steps(510, 3 * 10 ** 6, 25e-6, 8e-11)]
    sized = [steps(380, 10 ** 8, 25e-6, 8e-11), steps(520, 1.5 * 10 ** 8, 25e-6, 8e-11)]
    op_s, byte_s = fit_overhead(tiny, sized)
    assert op_s == pytest.approx(25e-6) and byte_s == pytest.approx(8e-11)
    fast = [steps(380, 10 ** 8, 10e-6, 0.0), steps(520, 1.5 * 10 ** 8, 10e-6, 0.0)]
    op_s, byte_s = fit_overhead(tiny, fast)
    assert byte_s == 0.0 and op_s == pytest.approx(sum(t[0] for t in tiny) / 892)
    assert quantile([3.0, 1.0, 2.0], 0.0) == 1.0 and quantile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.5


def test_the_wait_per_call_is_the_slope_from_stage_0_to_stage_3_not_a_per_step_skew_divided():
    """A skew a rank waits once a step (here 8 ms) is in the stage-0 and the stage-3 steps
    alike and cancels; what each call more costs (1 ms) is the wait. Dividing stage 0's
    time beyond the prediction by its 4 calls would have said 3 ms."""
    from mct.planner.overhead import wait_per_call
    few = [(0.008 + 4 * 1e-3, 4), (0.008 + 4 * 1e-3, 4)]
    many = [(0.008 + 11 * 1e-3, 11), (0.008 + 13 * 1e-3, 13)]
    assert wait_per_call(few, many) == pytest.approx(1e-3)
    assert wait_per_call(few, []) == 0.0 and wait_per_call(many, few) == 0.0  # fewer calls or none: 0


def test_measured_overhead_and_per_byte_cost_come_from_real_steps_of_both_models():
    """One process's calibration steps: a positive per-op overhead, a per-byte cost of at
    least 0, no wait without ranks. The rates are a machine faster than any (1e14 FLOP/s and
    bytes/s): the predicted compute is then below any real step's, whatever this CPU is (the
    handmade profile's 1-8 GFLOP/s is slower than a CPU with fast matmuls, whose steps then
    leave nothing beyond the prediction to fit)."""
    from mct.planner.overhead import measure_op_overhead
    fast = 1e14
    fastest = MachineProfile(device="cpu", name="fast", flags=("avx2",), torch_version="x", threads=1,
                             matmul_one={"fp32": fast}, matmul_all={"fp32": fast}, matmul_size={"fp32": 1024},
                             memcpy_bytes_per_s=fast,
                             extra={"matmul_by_dim": {"fp32": [[16, fast], [256, fast]]},
                                    "elementwise_curve": [[1e5, fast], [1e7, fast]], "copy_all_bytes_per_s": fast,
                                    "random_elements_per_s": fast})
    op_s, wait_s, byte_s = measure_op_overhead(rates_for(fastest, 1, 1), 1, steps=1)
    assert 0 < op_s < 1e-2 and wait_s == 0.0 and 0.0 <= byte_s < 1e-8


def test_ops_through_mcts_python_dispatch_mode_are_counted_as_a_real_step_runs_them_and_charged():
    """bf16 matmuls on fp32 kernels (``precision.cpu_matmul = "fp32"``, as ``auto`` on a CPU
    without native bf16) run every forward and backward op through a Python dispatch mode:
    the dry run counts them as a real step dispatches them (a fake tensor's device queries
    not among them), none in fp32; depth extrapolation extends them; each costs the
    profile's measured ``python_mode_op_s`` in the overhead term, nothing else."""
    from mct.engine import Engine
    from mct.precision.cpu_matmul import UpcastMatmul

    def cfg(mode: str, layers: int = L) -> EngineConfig:
        return EngineConfig.from_dict({**_cfg(0, "all", layers=layers).to_dict(),
                                       "precision": {"mode": mode, "cpu_matmul": "fp32"}})

    def work(mode: str, layers: int = L) -> StepWork:
        task = _task(cfg(mode, layers))
        return dry_run(task.model_fn, task.loss_fn, task.batch, cfg(mode, layers), 1).work

    assert work("fp32").modes == {}
    counted = work("bf16").modes["upcast_matmul"]
    torch.manual_seed(0)
    engine = Engine(GPT(cfg("bf16").model), None, cfg("bf16"))
    batch = _task(cfg("bf16")).batch
    engine.train_step(batch, gpt_loss)
    before = UpcastMatmul.dispatched
    engine.train_step(batch, gpt_loss)
    real = UpcastMatmul.dispatched - before
    engine.close()
    assert counted > 0 and abs(counted - real) <= 0.05 * real, (counted, real)
    a, b = work("bf16", 3), work("bf16", 4)
    assert a.extend([(b, 2)]).modes == {"upcast_matmul": counted}
    one = StepWork(ops={("bf16", 0, 10 ** 4, 0): 3}, modes={"upcast_matmul": 100})
    plain, moded = step_time(one, RATES), step_time(one, dataclasses.replace(RATES, mode_op_s=1e-5))
    assert math.isclose(moded.overhead_s - plain.overhead_s, 100 * 1e-5, rel_tol=1e-12)
    assert (moded.compute_s, moded.comm_s) == (plain.compute_s, plain.comm_s)
    assert rates_for(_profile(python_mode_op_s=7e-6), 1, 1).mode_op_s == 7e-6
    assert rates_for(_profile(), 1, 1).mode_op_s == 0.0


def test_ops_through_selective_checkpointing_modes_are_counted_as_a_real_step_runs_them_and_charged():
    """A 'selective' region runs its forward and its recompute through torch's
    selective-checkpoint dispatch modes (a Python call per op, 15-30 us here): the dry run
    counts those ops as a real step dispatches them, none under 'all' or 'none', only the
    selective blocks of a mixed stack; each costs the profile's ``selective_mode_op_s``,
    not the upcast mode's cost."""
    from mct.checkpointing.policies import SelectiveDispatch
    from mct.engine import Engine

    def work(cfg: EngineConfig) -> StepWork:
        return dry_run(_task(cfg).model_fn, _task(cfg).loss_fn, _task(cfg).batch, cfg, 1).work

    assert work(_cfg(0, "all")).modes == {} and work(_cfg(0, "none")).modes == {}
    selective = _cfg(0, "selective")
    counted = work(selective).modes["selective_checkpoint"]
    torch.manual_seed(0)
    engine = Engine(GPT(selective.model), None, selective)
    engine.train_step(_task(selective).batch, gpt_loss)
    before = SelectiveDispatch.dispatched
    engine.train_step(_task(selective).batch, gpt_loss)
    real = SelectiveDispatch.dispatched - before
    engine.close()
    assert counted > 0 and abs(counted - real) <= 0.05 * real, (counted, real)
    half = work(EngineConfig.from_dict({**_cfg(0).to_dict(), "checkpointing": {
        "policy": "per_block", "per_block": ["selective"] + ["none"] * (L - 1)}}))
    assert 0 < half.modes["selective_checkpoint"] * L <= 1.05 * counted, (half.modes, counted)
    one = StepWork(ops={("fp32", 0, 10 ** 4, 0): 3}, modes={"selective_checkpoint": 100, "upcast_matmul": 10})
    rates = dataclasses.replace(RATES, mode_op_s=1e-5, mode_op_by={"selective_checkpoint": 3e-5})
    assert math.isclose(step_time(one, rates).overhead_s - step_time(one, RATES).overhead_s,
                        100 * 3e-5 + 10 * 1e-5, rel_tol=1e-12)
    assert rates_for(_profile(selective_mode_op_s=2e-5), 1, 1).mode_op_by == {"selective_checkpoint": 2e-5}


def test_the_memory_trackers_cost_is_charged_only_to_a_step_that_tracks(monkeypatch):
    """The per-op overhead is measured on steps without the memory tracker (most of `mct
    train`'s steps: it tracks only its logged ones); a tracked step costs the profile's
    ``tracker_op_s`` more per op, nothing else; on CUDA nothing (its counters cost no op).
    A run's own prediction is of a tracked step only when it tracks every one."""
    from mct.planner import overhead
    from mct.run.utilization import predict_step_s, tracks_every_step

    work = StepWork(ops={("fp32", 0, 10 ** 4, 0): 3, ("fp32", 10 ** 6, 10 ** 5, 16): 2})
    rates = dataclasses.replace(RATES, tracker_op_s=4e-6)
    plain, tracked = step_time(work, rates), step_time(work, rates, tracked=True)
    assert math.isclose(tracked.overhead_s - plain.overhead_s, 5 * 4e-6, rel_tol=1e-12)
    assert (tracked.compute_s, tracked.comm_s) == (plain.compute_s, plain.comm_s)
    assert step_time(work, RATES, tracked=True) == step_time(work, RATES)
    assert rates_for(_profile(tracker_op_s=3e-6), 1, 1).tracker_op_s == 3e-6
    cuda = dataclasses.replace(_profile(tracker_op_s=3e-6), device="cuda")
    assert rates_for(cuda, 1, 1).tracker_op_s == 0.0
    seen = []
    real = overhead.Engine.train_step

    def spy(self, batch, loss_fn, **kw):
        seen.append(kw.get("track_memory", True))
        return real(self, batch, loss_fn, **kw)

    monkeypatch.setattr(overhead.Engine, "train_step", spy)
    overhead.measure_op_overhead(rates_for(_profile(), 1, 1), 1, steps=1)
    assert seen[-4 * 3:] == [False] * 12  # the 4 engines' 3 real steps each (after their dry runs): untracked
    monkeypatch.setattr("mct.run.utilization.machine_rates",
                        lambda *a, **k: (rates_for(_profile(tracker_op_s=1e-3), 1, 1), []))
    cfg = _cfg(0, "none")
    steps = {every: predict_step_s(_task(c), c, 1, "cpu", 1) for every, c in
             ((10, cfg), (1, EngineConfig.from_dict({**cfg.to_dict(), "train": {"log_every": 1}})))}
    assert steps[1] > steps[10] + 0.05, steps  # hundreds of ops x 1 ms each
    enforced = EngineConfig.from_dict({**cfg.to_dict(), "memory": {"budget": "1GiB", "enforce": True}})
    assert tracks_every_step(enforced, "cpu") and not tracks_every_step(enforced, "cuda")
    assert not tracks_every_step(cfg, "cpu")


def test_overhead_is_measured_at_the_ranks_own_threads(monkeypatch):
    """One process's per-op overhead is measured at the threads a rank of the planned world
    runs (a 2-thread step waits at OpenMP's barriers, a 1-thread one does not), and read
    back at them; a world's ranks at theirs."""
    import mct.planner.overhead as st
    asked = []

    def fake(rates, threads, steps=st.OVERHEAD_STEPS, ranks=1):
        asked.append((threads, ranks))
        return 1e-5 * threads, 1e-3, 1e-10

    profile = _profile(op_overhead_s={}, collectives={})
    monkeypatch.setattr(st, "calibrate", lambda device="cpu": type("C", (), {"profile": profile, "warning": None})())
    monkeypatch.setattr(st, "remember", lambda p, key, value: (dataclasses.replace(
        p, extra={**p.extra, key: {**p.extra.get(key, {}), **value}}), None))
    monkeypatch.setattr(st, "measure_op_overhead", fake)
    monkeypatch.setattr(st, "LoadWatch", FakeWatch([0.0]))  # quiet: measured once, whatever else runs
    rates, _ = st.machine_rates(1, threads=2, spawn=False)
    assert asked == [(2, 1)] and rates.op_s == 2e-5


@pytest.mark.parametrize("stage,policy,act", [(0, "none", "none"), (2, "selective", "none"), (3, "all", "disk")])
def test_a_step_of_many_micro_batches_counts_every_one_though_the_plan_steps_three(stage, policy, act, tmp_path):
    """``mct.plan`` steps at most 3 of ``data.grad_accum`` micro-batches (the peaks need 2) and
    counts each one it did not step as its middle one: the ops, FLOPs, collectives and parked
    activations of a dry run of all 6, to the count, with and without depth extrapolation."""
    extra = {"data": {"grad_accum": 6}}
    if act != "none":
        extra.update(checkpointing={"policy": policy, "offload": act}, offload={"dir": str(tmp_path)})
    cfg = _cfg(stage, policy, **extra)
    task = _task(cfg)
    every = dry_run(task.model_fn, task.loss_fn, [task.batch] * 6, cfg, 2).work
    for planned in (predict(task, cfg, 2), predict(prepare_work(task, cfg), cfg, 2)):
        work = planned.work
        assert work.n_ops == every.n_ops and work.flops == every.flops and work.bytes_moved == every.bytes_moved
        assert work.comm == every.comm and work.offload == every.offload
        assert work.modes == every.modes
    two = dry_run(task.model_fn, task.loss_fn, [task.batch] * 2, cfg, 2).work
    assert every.flops > 2.5 * two.flops  # the old count stepped two and stopped there
    if act != "none":
        assert every.offload["disk"] == 3 * two.offload["disk"] > 0


@pytest.mark.parametrize("bad", [0, -3, 2.5, "4", True])
def test_dry_run_hooks_refuse_a_micro_batch_count_that_is_not_a_whole_number_from_1(bad):
    from mct.planner import DryRunHooks
    with pytest.raises(ValueError, match=r"DryRunHooks.micro_batches = .*whole number of micro-batches >= 1"):
        DryRunHooks(micro_batches=bad)
