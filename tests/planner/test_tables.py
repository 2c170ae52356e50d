"""``mct plan``'s text: the answer first, a table within 100 columns, the full grid behind --wide."""

from __future__ import annotations

import dataclasses

from mct.config import EngineConfig, PrecisionMode
from mct.memory.tracker import CATEGORIES
from mct.planner.choice import OffloadChoice, PlanRow
from mct.planner.plan import Plan
from mct.planner.tables import BRIEF_WIDTH, format_plan, format_plan_brief


def _row(stage: int, policy: str, peak: int, offload: str = "none", step_s: float | None = 0.5) -> PlanRow:
    return PlanRow(stage=stage, policy=policy, per_block=None, precision=PrecisionMode.bf16,
                   offload=OffloadChoice.parse(offload), act_offload="none", loss_chunk_tokens=0, mlp_tile_tokens=0,
                   world=2, peak=peak, phase="backward", breakdown={c: peak if c == "params" else 0 for c in CATEGORIES}, phases={"backward": peak},
                   first_step_peak=peak, init_peak=peak // 2, offloaded={"cpu": 0, "disk": 0}, fits=peak <= 2**30,
                   cost=1.0, step_s=step_s, tokens_per_s=4096 / step_s if step_s else None)


def _plan() -> Plan:
    rows = [_row(s, p, (4 - s) * 2**29, o) for s in range(4) for p in ("none", "all")
            for o in ("none", "optimizer+params=disk") if o == "none" or s == 3]
    best = rows[-1]
    return Plan(rows, 2**30, 2, 123_456_789, PrecisionMode.bf16, best, "recommended: zero.stage=3 ...")


def test_brief_plan_answers_first_and_fits_100_columns():
    cfg = EngineConfig.from_dict({"model": {"seq_len": 512}, "data": {"micro_batch_size": 2, "grad_accum": 4},
                                  "train": {"steps": 1000}})
    text = format_plan_brief(_plan(), cfg)
    lines = text.splitlines()
    assert lines[1] == "step: window 512 tokens x micro-batch 2 x accumulation 4 x 2 rank(s) = 8,192 tokens"
    assert lines[2].startswith("recommended:") and "8 min for train.steps = 1,000" in lines[3]
    table = lines[lines.index(next(x for x in lines if x.startswith("stage"))):]
    assert all(len(x) <= BRIEF_WIDTH for x in table), max(table, key=len)
    assert "every row: act none, loss_chunk off, mlp_tile off" in text  # said once, not a column each
    assert "optimizer+params=disk" in text and any(x.lstrip().startswith("3*") for x in table)


def test_brief_plan_shows_the_process_peak_beside_the_tensor_peak_and_says_what_each_counts():
    rows = [dataclasses.replace(r, process_peak=r.peak + 400 * 2**20, runtime_baseline=300 * 2**20,
                                allocator_overhead=100 * 2**20, process_counts="resident (VmHWM), host_malloc default")
            for r in _plan().rows]
    plan = Plan(rows, 2**30, 2, 1, PrecisionMode.bf16, rows[-1], "recommended: ...")
    lines = format_plan_brief(plan, EngineConfig.from_dict({})).splitlines()
    head = next(x for x in lines if x.startswith("stage"))
    assert head.split().index("process") == head.split().index("peak") + 1
    first = lines[lines.index(head) + 1].split()
    assert first[head.split().index("process") + 1] == "2.39"  # 2 GiB tensor peak + 400 MiB, in GiB
    assert any(x.startswith("peak: ") and "tensor bytes" in x for x in lines)
    assert any(x.startswith("process: ") and "resident (VmHWM)" in x for x in lines)
    assert all(len(x) <= BRIEF_WIDTH for x in lines[lines.index(head):])
    wide = format_plan(plan).splitlines()
    assert {"process", "baseline", "allocator"} <= set(wide[1].split()) and "300.00 MiB" in wide[2]
    unknown = format_plan_brief(_plan(), EngineConfig.from_dict({}))  # no baseline: a dash, not a guess
    assert "process" in unknown and "process: each" not in unknown


def test_wide_plan_keeps_every_category():
    text = format_plan(_plan())
    assert "params" in text.splitlines()[1] and "init" in text.splitlines()[1]
