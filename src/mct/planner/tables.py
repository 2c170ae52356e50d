"""A plan as text (``mct plan``'s table)."""

from __future__ import annotations

from mct.checkpointing import policy_label
from mct.config import CheckpointingConfig
from mct.memory.tracker import CATEGORIES, format_bytes
from mct.planner.plan import Plan


def format_plan(plan: Plan) -> str:
    """The plan as a table: one row per configuration (steady-state peak, bytes per
    category at that peak, the phase it is in, first-step and init peaks, fits, cost,
    predicted seconds per step and tokens per second),
    the recommended row marked '*', then the advice line."""
    cols = ["stage", "policy", "prec", "offload", "act", "loss_chunk", "mlp_tile", "peak", *CATEGORIES, "at", "first",
            "init", "host", "disk", "fits", "cost", "s/step", "tokens/s"]
    table = []
    for r in plan.rows:
        mark = "*" if r is plan.recommended else ""
        policy = (policy_label(CheckpointingConfig(policy="per_block", per_block=r.per_block))
                  if r.per_block else r.policy)
        table.append([f"{r.stage}{mark}", policy, r.precision, r.offload.label, r.act_offload,
                      str(r.loss_chunk_tokens or "off"), str(r.mlp_tile_tokens or "off"), format_bytes(r.peak),
                      *(format_bytes(r.breakdown[c]) for c in CATEGORIES), r.phase,
                      format_bytes(r.first_step_peak), format_bytes(r.init_peak),
                      format_bytes(r.offloaded["cpu"]), format_bytes(r.offloaded["disk"]),
                      "yes" if r.fits else "no", f"{r.cost:.2f}", seconds_text(r.step_s),
                      f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "-"])
    widths = [max([10, len(c)] + [len(row[i]) for row in table]) for i, c in enumerate(cols)]
    lines = [f"model: {plan.n_params:,} parameters; {plan.world} rank(s); budget per rank: "
             f"{format_bytes(plan.budget) if plan.budget else 'none'}",
             "  ".join(f"{c:>{w}}" for c, w in zip(cols, widths))]
    lines += ["  ".join(f"{v:>{w}}" for v, w in zip(row, widths)) for row in table]
    lines += [f"step time: {note}" for note in plan.time_notes]
    lines.append(plan.advice)
    return "\n".join(lines)


def seconds_text(s: float | None) -> str:
    """Predicted seconds per step, 3 significant digits; '-' when not predicted."""
    return "-" if s is None else f"{s:.3g}"
