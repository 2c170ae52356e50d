"""The plan: every ZeRO stage x checkpointing policy x precision, predicted, costed,
and the cheapest configuration that fits a per-rank budget (``mct plan``, ``auto``).

Relative step cost (1.0 = stage 0, no recomputation, one rank) is a documented model,
not a measurement (docs/planner.md):
  compute  1 + recomputed_fraction / 3   (forward ~ 1/3 of forward + backward; 'all'
           and 'sqrt' recompute every block's forward once)
  comm     COMM_SHARE x volume / (2 psi), volume per rank per step in parameters:
           2 psi at stages 0-2 (all-reduce = reduce-scatter + all-gather), 3 psi at
           stage 3 (parameters gathered in forward and again in backward); 0 on one rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mct.config import EngineConfig
from mct.memory.planner import BREAKDOWN, ModelLayout, ModelSource, Prediction, meta_layout, predict
from mct.memory.tracker import format_bytes

STAGES = (0, 1, 2, 3)
POLICIES = ("none", "all", "sqrt")
PRECISIONS = ("fp32", "bf16")
COMM_SHARE = 0.25
"""Assumed share of a data-parallel step spent communicating 2 psi (a mid-size cluster)."""
RECOMPUTED = {"none": 0.0, "all": 1.0, "sqrt": 1.0, "every_k": 0.5, "selective": 0.5}


def step_cost(stage: int, policy: str, world: int) -> float:
    """Relative step cost of a configuration (see the module docstring)."""
    compute = 1.0 + RECOMPUTED.get(policy, 1.0) / 3
    volume = 0.0 if world == 1 else (3.0 if stage == 3 else 2.0)
    return round(compute + COMM_SHARE * volume / 2, 4)


@dataclass
class Row:
    pred: Prediction
    fits: bool
    cost: float


@dataclass
class Plan:
    rows: list[Row]
    budget: int | None
    world: int
    n_params: int
    precision: str
    best: Row | None
    advice: str

    def to_dict(self) -> dict:
        return {"budget": self.budget, "world": self.world, "n_params": self.n_params,
                "precision": self.precision, "advice": self.advice,
                "recommended": _row_dict(self.best) if self.best else None,
                "rows": [_row_dict(r) for r in self.rows]}


def _row_dict(r: Row) -> dict:
    return {**dataclasses.asdict(r.pred), "fits": r.fits, "cost": r.cost}


def make_plan(cfg: EngineConfig, world: int, budget: int | None, *, factory: str | None = None,
              stages: tuple = STAGES, policies: tuple = POLICIES, precisions: tuple = PRECISIONS,
              device: str = "cpu") -> Plan:
    """Predict every configuration of the grid for ``cfg``'s model and micro-batch on
    ``world`` ranks; recommend the cheapest that fits ``budget`` in ``cfg``'s precision
    (ties: the lower peak). Raises ValueError for a bad world size or model factory."""
    if world < 1:
        raise ValueError(f"--world-size must be >= 1, got {world}")
    source = ModelSource.from_config(cfg, factory)
    layout = meta_layout(source, world)
    B, T = cfg.data.micro_batch_size, cfg.model.seq_len
    rows, memo = [], {}  # memo: fake runs shared by every configuration
    for precision in precisions:
        for policy in policies:
            for stage in stages:
                p = predict(layout, source, stage=stage, policy=policy, precision=precision, batch=B, seq=T,
                            reduce_dtype=cfg.precision.reduce_dtype, persistent_numel=cfg.zero.persistent_numel,
                            device=device, memo=memo)
                rows.append(Row(p, budget is None or p.peak <= budget, step_cost(stage, policy, world)))
    mine = [r for r in rows if r.pred.precision == cfg.precision.mode]
    fitting = sorted((r for r in mine if r.fits), key=lambda r: (r.cost, r.pred.peak, r.pred.stage))
    best = fitting[0] if fitting and budget is not None else None
    plan = Plan(rows, budget, world, layout.n_params, cfg.precision.mode, best, "")
    plan.advice = _advice(plan, cfg, source, layout, device)
    return plan


def _advice(plan: Plan, cfg: EngineConfig, source: ModelSource, layout: ModelLayout, device: str) -> str:
    if plan.budget is None:
        return "no budget given: pass --budget (e.g. 24GiB) to get a recommendation"
    if plan.best is not None:
        p = plan.best.pred
        return (f"recommended: zero.stage={p.stage} checkpointing.policy={p.policy} precision.mode={p.precision}"
                f" (predicted peak {format_bytes(p.peak)} per rank of {format_bytes(plan.budget)}, cost {plan.best.cost:.2f})")
    mine = [r for r in plan.rows if r.pred.precision == plan.precision]
    low = min(mine, key=lambda r: r.pred.peak).pred
    msg = (f"nothing fits {format_bytes(plan.budget)} per rank in {plan.precision}: the smallest, zero.stage={low.stage} "
           f"checkpointing.policy={low.policy}, needs {format_bytes(low.peak)} (misses by {format_bytes(low.peak - plan.budget)})")
    return msg + _what_would_fit(plan, cfg, source, low, device)


def _what_would_fit(plan: Plan, cfg: EngineConfig, source: ModelSource, low: Prediction, device: str) -> str:
    """Fewer bytes per rank: more ranks (stage 3 shards everything), or a smaller micro-batch."""
    B, T = cfg.data.micro_batch_size, cfg.model.seq_len
    hints = []
    for b in sorted({max(1, B // d) for d in (2, 4, 8, 16, 32, 64)}, reverse=True):
        if b >= B:
            continue
        lay = meta_layout(source, plan.world)
        p = predict(lay, source, stage=3 if plan.world > 1 else low.stage, policy=low.policy, precision=low.precision,
                    batch=b, seq=T, reduce_dtype=cfg.precision.reduce_dtype, device=device)
        if p.peak <= plan.budget:
            hints.append(f"data.micro_batch_size={b} (x{B // b} data.grad_accum keeps the batch)")
            break
    memo: dict = {}
    for w in (2 ** k for k in range(1, 13)):
        if w <= plan.world:
            continue
        lay = meta_layout(source, w)
        p = predict(lay, source, stage=3, policy=low.policy, precision=low.precision, batch=B, seq=T,
                    reduce_dtype=cfg.precision.reduce_dtype, device=device, memo=memo)
        if p.peak <= plan.budget:
            hints.append(f"{w} ranks at zero.stage=3")
            break
    if not hints:
        return "; neither up to 4096 ranks nor a smaller micro-batch alone makes it fit: raise the budget"
    return "; it would fit with " + " or ".join(hints)


def format_table(plan: Plan) -> str:
    """One row per configuration: peak, breakdown, fits, cost; then the advice line."""
    cols = ["stage", "policy", "prec", "peak", *BREAKDOWN, "at", "fits", "cost"]
    lines = [f"model: {plan.n_params:,} parameters; {plan.world} rank(s); budget per rank: "
             f"{format_bytes(plan.budget) if plan.budget else 'none'}",
             "  ".join(f"{c:>10}" for c in cols)]
    for r in plan.rows:
        p = r.pred
        mark = "*" if r is plan.best else ""
        vals = [f"{p.stage}{mark}", p.policy, p.precision, format_bytes(p.peak),
                *(format_bytes(p.breakdown[k]) for k in BREAKDOWN), p.stage_name,
                "yes" if r.fits else "no", f"{r.cost:.2f}"]
        lines.append("  ".join(f"{v:>10}" for v in vals))
    lines.append(plan.advice)
    return "\n".join(lines)


def resolve_auto(cfg: EngineConfig, world: int, factory: str | None = None,
                 device: str = "cpu") -> tuple[EngineConfig, dict | None]:
    """Replace ``zero.stage = 'auto'`` and/or ``checkpointing.policy = 'auto'`` by the
    cheapest configuration predicted to fit ``memory.budget`` (the other keys as set).
    Returns (resolved config, the choice and its prediction; None when nothing was
    'auto'). Raises ValueError when 'auto' has no budget, or when nothing fits (one
    line: by how much the smallest configuration misses and what would make it fit)."""
    auto = [k for k, v in (("zero.stage", cfg.zero.stage), ("checkpointing.policy", cfg.checkpointing.policy))
            if v == "auto"]
    if not auto:
        return cfg, None
    budget = cfg.memory.budget_bytes
    if budget is None:
        raise ValueError(f"{' and '.join(auto)} = 'auto' needs a per-rank budget to plan for: set memory.budget, "
                         f"e.g. --set memory.budget=2GiB (or choose the value yourself; `mct plan` helps)")
    stages = STAGES if cfg.zero.stage == "auto" else (int(cfg.zero.stage),)
    policies = POLICIES if cfg.checkpointing.policy == "auto" else (cfg.checkpointing.policy,)
    plan = make_plan(cfg, world, budget, factory=factory, stages=stages, policies=policies,
                     precisions=(cfg.precision.mode,), device=device)
    if plan.best is None:
        raise ValueError(plan.advice)
    p = plan.best.pred
    d = cfg.to_dict()
    d["zero"]["stage"], d["checkpointing"]["policy"] = p.stage, p.policy
    choice = {"auto": auto, "zero.stage": p.stage, "checkpointing.policy": p.policy, "budget_bytes": budget,
              "predicted_peak_bytes": p.peak, "predicted_peak_stage": p.stage_name,
              "predicted_breakdown": p.breakdown, "predicted_stages": p.stages, "cost": plan.best.cost,
              "world_size": world}
    return EngineConfig.from_dict(d), choice


def peak_check(measured: int, predicted: int, tolerance: float = 0.10) -> str | None:
    """A warning line when the measured peak exceeds the prediction by more than
    ``tolerance``; None otherwise."""
    if predicted > 0 and measured > predicted * (1 + tolerance):
        return (f"measured peak {format_bytes(measured)} per rank exceeds the planner's prediction "
                f"{format_bytes(predicted)} by {100 * (measured / predicted - 1):.1f}% (> {100 * tolerance:.0f}%)")
    return None


def cmd_plan(cfg: EngineConfig, *, world: int, budget: str | None, factory: str | None, as_json: bool,
             plot: str | None = None) -> int:
    """``mct plan``: print the table (or JSON); ``plot``: also draw it (``mct.plots``).
    Returns 0 when a configuration fits (or no budget was given); raises ValueError
    (exit 2, one line) when nothing fits."""
    from mct.config import parse_bytes
    limit = parse_bytes(budget, "--budget") if budget else cfg.memory.budget_bytes
    plan = make_plan(cfg, world, limit, factory=factory)
    if as_json:
        import json
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(format_table(plan))
    if plot:
        from mct.plots import plot_plan
        plot_plan(plan.to_dict(), plot)
    if limit is not None and plan.best is None:
        raise ValueError(plan.advice)
    return 0
