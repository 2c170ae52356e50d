"""A plan as text (``mct plan``'s table)."""

from __future__ import annotations

from mct.checkpointing import policy_label
from mct.config import CheckpointingConfig, EngineConfig
from mct.memory.tracker import CATEGORIES, format_bytes
from mct.planner.choice import counts_text
from mct.planner.plan import Plan


def format_plan(plan: Plan) -> str:
    """The plan as a table: one row per configuration (steady-state peak, bytes per
    category at that peak, the phase it is in, first-step and init peaks, fits, cost,
    predicted seconds per step and tokens per second),
    the recommended row marked '*', then the advice line."""
    cols = ["stage", "policy", "prec", "offload", "act", "loss_chunk", "mlp_tile", "peak", *CATEGORIES, "at", "first",
            "init", "host", "disk", "fits", "cost", "s/step", "tokens/s", "process", "baseline", "allocator",
            "snapshots"]
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
                      f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "-",
                      *(_bytes_or_dash(v) for v in (r.process_peak, r.runtime_baseline, r.allocator_overhead,
                                                     r.rollback_snapshots))])
    widths = [max([10, len(c)] + [len(row[i]) for row in table]) for i, c in enumerate(cols)]
    lines = [f"model: {plan.n_params:,} parameters; {plan.world} rank(s) on {plan.device}; budget per rank: "
             f"{_budget_text(plan)}",
             "  ".join(f"{c:>{w}}" for c, w in zip(cols, widths))]
    lines += ["  ".join(f"{v:>{w}}" for v, w in zip(row, widths)) for row in table]
    lines += [f"step time: {note}" for note in plan.time_notes]
    lines += _legend(plan)
    lines.append(plan.advice)
    return "\n".join(lines)


def _bytes_or_dash(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def _budget_text(plan: Plan) -> str:
    """The budget and the figure it is compared with: '2.00 GiB (process peak, resident set)'."""
    text = counts_text(plan.budget_counts)
    if plan.device == "cuda" and plan.budget_counts == "process":
        text = "process peak, device memory"
    return f"{format_bytes(plan.budget)} ({text})" if plan.budget else "none"


def _legend(plan: Plan) -> list[str]:
    """What the peak and process columns count, and which of them the budget (and ``fits``)
    is compared with, in a line each (and why there is no process peak)."""
    counts = sorted({r.process_counts for r in plan.rows if r.process_counts})
    fits = "process" if plan.budget_counts == "process" else "peak"
    lines = ["peak: the steady-state step's, in tensor bytes",
             f"fits: the {fits} column <= the budget (memory.budget_counts = "
             f"{'process' if fits == 'process' else 'tensors'})" if plan.budget else
             "fits: no budget given (memory.budget counts the process peak unless memory.budget_counts = tensors)"]
    if counts:
        lines += [f"process: each rank's predicted peak, {c}" for c in counts]
        lines.append("  = CUDA context + peak + caching allocator's reserve (docs/memory.md)" if plan.device == "cuda"
                     else "  = runtime baseline + peak + allocator overhead + rollback snapshots (docs/memory.md)")
        if plan.device != "cuda" and any(r.process_at == "save" for r in plan.rows):
            lines.append("  at the checkpoint save: the state it saves instead of peak")
    elif plan.process_note:
        lines.append(f"process: {plan.process_note}")
    return lines


def seconds_text(s: float | None) -> str:
    """Predicted seconds per step, 3 significant digits; '-' when not predicted."""
    return "-" if s is None else f"{s:.3g}"


BRIEF_WIDTH = 100
"""``mct plan``'s table fits this many columns (``--wide``: every category's bytes)."""


def plan_header(plan: Plan, cfg: EngineConfig) -> str:
    """What a plan assumed, in two lines: the ranks and their device type, the budget it was asked
    about; the window, micro-batch, accumulation and the tokens of one step."""
    d, seq = cfg.data, cfg.model.seq_len
    tokens = seq * d.micro_batch_size * d.grad_accum * plan.world
    return (f"model: {plan.n_params:,} parameters; {plan.world} rank(s) on {plan.device}; budget per rank: "
            f"{_budget_text(plan)}\n"
            f"step: window {seq} tokens x micro-batch {d.micro_batch_size} x accumulation {d.grad_accum} x "
            f"{plan.world} rank(s) = {tokens:,} tokens")


def format_plan_brief(plan: Plan, cfg: EngineConfig) -> str:
    """The answer first (the recommendation, its predicted step and the whole run's time,
    or why nothing fits), then one row per configuration in at most ``BRIEF_WIDTH``
    columns: the columns every row shares are said once above the table instead."""
    lines = [plan_header(plan, cfg), plan.advice]
    r = plan.recommended
    if r is not None and r.step_s is not None:
        steps = cfg.train.steps
        lines.append(f"predicted: {r.step_s:.3g} s per step, {_duration(r.step_s * steps)} for train.steps = "
                     f"{steps:,}" + (f", {r.tokens_per_s:,.0f} tokens/s" if r.tokens_per_s else ""))
    optional = {"offload": lambda x: x.offload.label, "act": lambda x: x.act_offload,
                "loss_chunk": lambda x: str(x.loss_chunk_tokens or "off"),
                "mlp_tile": lambda x: str(x.mlp_tile_tokens or "off")}
    shared = {k: f(plan.rows[0]) for k, f in optional.items()
              if plan.rows and len({f(x) for x in plan.rows}) == 1}
    if shared:
        lines.append("every row: " + ", ".join(f"{k} {v}" for k, v in shared.items()))
    cols = ["stage", "recompute", "prec", *(k for k in optional if k not in shared), "peak", "process", "fits",
            "s/step", "tokens/s"]
    table = []
    for x in plan.rows:
        policy = (policy_label(CheckpointingConfig(policy="per_block", per_block=x.per_block))
                  if x.per_block else x.policy)
        table.append([f"{x.stage}{'*' if x is r else ''}", policy, str(x.precision),
                      *(f(x) for k, f in optional.items() if k not in shared), format_bytes(x.peak),
                      _bytes_or_dash(x.process_peak), "yes" if x.fits else "no", seconds_text(x.step_s),
                      f"{x.tokens_per_s:,.0f}" if x.tokens_per_s else "-"])
    widths = [max([len(c)] + [len(row[i]) for row in table]) for i, c in enumerate(cols)]
    lines.append("  ".join(f"{c:>{w}}" for c, w in zip(cols, widths)))
    lines += ["  ".join(f"{v:>{w}}" for v, w in zip(row, widths)) for row in table]
    lines += [f"step time: {note}" for note in plan.time_notes]
    lines += [*_legend(plan), "* recommended; --wide: each category's bytes, the first-step and init peaks, the process terms"]
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
