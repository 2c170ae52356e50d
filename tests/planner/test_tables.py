"""``mct plan``'s text: the answer first, a table within 100 columns, the full grid behind --wide."""

from __future__ import annotations

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


def test_wide_plan_keeps_every_category():
    text = format_plan(_plan())
    assert "params" in text.splitlines()[1] and "init" in text.splitlines()[1]
