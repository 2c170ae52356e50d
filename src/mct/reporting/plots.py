"""Pictures of a run and of a plan, drawn with matplotlib's headless Agg backend.

Both functions take plain data (rows decoded from ``metrics.jsonl``, the events of
``events.jsonl``, ``metadata.json`` as a dict; ``Plan.to_dict()``), never live engine
or planner objects, so they keep working whatever produces the data.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mct.outputs import Owned, check_file_output, write_file

PLOTTED_CATEGORIES = ("params", "master", "grads", "optimizer", "activations", "other")
STEP_PHASES = ("forward", "backward", "optimizer")
COLORS = {"params": "#4c72b0", "master": "#8172b3", "grads": "#dd8452", "optimizer": "#55a868",
          "activations": "#c44e52", "other": "#937860", "buffers": "#937860", "gathered": "#da8bc3",
          "data": "#8c8c8c", "forward": "#4c72b0", "backward": "#dd8452", "recompute": "#c44e52",
          "step": "#55a868", "communication": "#64b5cd"}
MIB = 2**20


PLOT_FORMATS = ("png", "svg", "pdf", "jpg", "jpeg")


def check_plot_path(path: str | Path, force: bool = False, owned: Owned | None = None) -> Path:
    """Validate ``--plot`` before any work is done (``mct.outputs``: a new file, or with
    ``force`` an existing regular file; never a link, FIFO, directory or, through ``owned``,
    a run's own file). Returns it as a Path. Raises ValueError (one line, the value and
    the fix) for those or an unknown image format."""
    p = Path(path)
    fmt = p.suffix.lower().lstrip(".")
    if fmt not in PLOT_FORMATS and not p.is_dir():
        raise ValueError(f"--plot {str(p)!r}: unknown image format {p.suffix or '(no suffix)'!r}; "
                         "end the name in .png, .svg, .pdf or .jpg")
    return check_file_output(p, "--plot", force=force, example="plot.png", owned=owned)


def _pyplot():
    # matplotlib takes about a second to import: loaded by the commands that draw only
    import matplotlib
    matplotlib.use("Agg", force=True)  # headless: no display, same pixels everywhere
    import matplotlib.pyplot as plt
    return plt


def _num(v: Any) -> float:
    """A row value as a float; missing, None or non-numeric -> nan."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def _save(fig: Any, path: Path) -> None:
    """Write to a temporary beside ``path`` then rename (``mct.outputs.write_file``), so a
    failure leaves no half image and the old file, if any, as it was."""
    try:
        write_file(path, lambda tmp: fig.savefig(tmp, dpi=110, bbox_inches="tight"))
    except OSError as e:
        raise ValueError(f"--plot {str(path)!r} could not be written ({e.strerror or e})") from None


def _finish(plt: Any, fig: Any, path: Path) -> Path:
    """Lay out, write (``_save``) and close ``fig``; returns ``path``."""
    fig.tight_layout()
    try:
        _save(fig, path)
    finally:
        plt.close(fig)
    return path


def _markers(rows: list[dict], events: list[dict], meta: dict | None) -> dict[str, list[int]]:
    """Steps to mark: skipped (overflow) steps, rollbacks, resumes, non-finite losses."""
    skipped, rollbacks, nonfinite = [], set(), []
    last_skips, last_rb = 0, 0
    for r in rows:
        step = r.get("step")
        if not isinstance(step, int):
            continue
        cum = (r.get("errors") or {}).get("skipped_steps", r.get("skipped_steps", 0)) or 0
        if r.get("skipped") is True or cum > last_skips:
            skipped.append(step)
        last_skips = max(last_skips, cum if isinstance(cum, int) else 0)
        rb = r.get("rollbacks")
        if isinstance(rb, int) and rb > last_rb:
            rollbacks.add(step)
            last_rb = rb
        if not math.isfinite(_num(r.get("loss"))):
            nonfinite.append(step)
    rollbacks.update(e["step"] for e in events if e.get("kind") == "rollback" and isinstance(e.get("step"), int))
    resumes = [x["from_step"] for x in (meta or {}).get("resumes") or []
               if isinstance(x, dict) and isinstance(x.get("from_step"), int)]
    return {"skipped": skipped, "rollbacks": sorted(rollbacks), "resumes": resumes, "nonfinite": nonfinite}


def _loss_panel(ax: Any, rows: list[dict], marks: dict[str, list[int]]) -> None:
    steps = [r["step"] for r in rows]
    ax.plot(steps, [_num(r.get("loss")) for r in rows], color="#4c72b0", lw=1.4, label="train loss")
    val = [(r["step"], _num(r["val_loss"])) for r in rows if "val_loss" in r]
    if val:
        ax.plot(*zip(*val), color="#dd8452", marker="o", ms=4, lw=1.4, label="validation loss")
    trans = ax.get_xaxis_transform()  # x in data, y in axes fraction
    if marks["skipped"]:
        ax.scatter(marks["skipped"], [0.03] * len(marks["skipped"]), transform=trans, marker="x",
                   color="#c44e52", s=28, label="skipped step", zorder=3)
    if marks["nonfinite"]:
        ax.scatter(marks["nonfinite"], [0.97] * len(marks["nonfinite"]), transform=trans, marker="v",
                   color="#c44e52", s=36, label="non-finite loss", zorder=3)
    for i, s in enumerate(marks["rollbacks"]):
        ax.axvline(s, color="#8172b3", ls="--", lw=1.2, label="rollback" if i == 0 else None)
    for i, s in enumerate(marks["resumes"]):
        ax.axvline(s, color="#55a868", ls=":", lw=1.8, label="resume" if i == 0 else None)
    every = steps + [s for v in marks.values() for s in v]
    pad = max(1.0, 0.02 * (max(every) - min(every)))
    ax.set_xlim(min(every) - pad, max(every) + pad)  # nan losses do not widen the axis by themselves
    ax.set(xlabel="step", ylabel="loss (nats/token)", title="Loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right", bbox_to_anchor=(1.0, 0.92))  # top strip: non-finite marks


def _lr_axis(ax: Any, rows: list[dict]) -> Any:
    """The learning rate of each logged row (``lr``) against step on a right-hand axis
    of ``ax`` (the loss panel). Returns that axis, or None when no row carries an lr."""
    pts = [(r["step"], _num(r.get("lr"))) for r in rows]
    pts = [p for p in pts if math.isfinite(p[1])]
    if not pts:
        return None
    lr_ax = ax.twinx()
    lr_ax.plot(*zip(*pts), color="#8c8c8c", lw=1.1, ls="-.", label="learning rate")
    lr_ax.set_ylabel("learning rate", color="#555555")
    lr_ax.set_ylim(0, 1.08 * max(v for _, v in pts) or 1.0)
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    lr_ax.legend(fontsize=8, loc="upper right", bbox_to_anchor=(1.0, 0.70))
    return lr_ax


def _throughput_panel(ax: Any, rows: list[dict]) -> None:
    pts = [(r["step"], _num(r.get("tokens_per_s"))) for r in rows]
    pts = [p for p in pts if math.isfinite(p[1])]
    if pts:
        ax.plot(*zip(*pts), color="#55a868", marker=".", lw=1.2)
        later = sorted(v for s, v in pts[1:]) or [pts[0][1]]  # step 0 includes warm-up
        med = later[len(later) // 2]
        ax.axhline(med, color="#555555", ls="--", lw=1)
        ax.text(0.99, 0.04, f"median {med:,.0f} tokens/s (after step 0)", transform=ax.transAxes,
                ha="right", fontsize=8)
    ax.set(xlabel="step", ylabel="tokens / s", title="Throughput")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)


def _time_panel(ax: Any, rows: list[dict]) -> None:
    """Mean seconds per logged step: disjoint wall-clock parts stacked in one bar,
    communication beside it (it runs inside backward and the optimizer step)."""
    def mean(key: str) -> float:
        vals = [_num(r.get(key)) for r in rows[1:] or rows]
        vals = [v for v in vals if math.isfinite(v)]
        return sum(vals) / len(vals) if vals else 0.0
    # runs logged before the rename carry the recompute time as ckpt_recompute_time_s
    recompute = mean("recompute_time_s") or mean("ckpt_recompute_time_s")
    parts = {"data": mean("time_data_s"), "forward": mean("time_forward_s"),
             "backward": max(0.0, mean("time_backward_s") - recompute), "recompute": recompute,
             "step": mean("time_step_s")}
    left = 0.0
    for name, v in parts.items():
        label = {"step": "optimizer step", "backward": "backward (excl. recompute)"}.get(name, name)
        ax.barh(1, v, left=left, color=COLORS[name], label=f"{label}: {1e3 * v:.0f} ms")
        left += v
    comm = mean("time_comm_s")
    if comm > 0:
        ax.barh(0, comm, color=COLORS["communication"], hatch="//", label=f"communication: {1e3 * comm:.0f} ms")
        ax.set_yticks([1, 0], ["step", "comm"])
    else:
        ax.set_yticks([1], ["step"])
        ax.text(0.01, 0.08, "no communication (one rank)", transform=ax.transAxes, fontsize=8, color="#555555")
    ax.set_ylim(-0.6 if comm > 0 else 0.3, 1.6)
    ax.set(xlabel="seconds per step (mean of logged steps after the first)", title="Time per phase")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3, frameon=False)
    ax.grid(axis="x", alpha=0.3)


def _memory_panel(ax: Any, rows: list[dict], budget: int | None) -> None:
    mem = next((r["memory"] for r in reversed(rows) if isinstance(r.get("memory"), dict)), {})
    phases = [s for s in STEP_PHASES if s in mem] + [s for s in mem if s not in STEP_PHASES]
    bottom = [0.0] * len(phases)
    for cat in PLOTTED_CATEGORIES:
        vals = [_num(mem[s].get(cat, 0)) / MIB for s in phases]
        vals = [v if math.isfinite(v) else 0.0 for v in vals]
        if any(vals):
            ax.bar(phases, vals, bottom=bottom, color=COLORS[cat], label=cat, width=0.6)
            bottom = [b + v for b, v in zip(bottom, vals)]
    for x, top in enumerate(bottom):
        ax.text(x, top, f"{top:.1f} MiB", ha="center", va="bottom", fontsize=8)
    if budget:
        ax.axhline(budget / MIB, color="#c44e52", ls="--", lw=1.5, label=f"budget {budget / MIB:,.1f} MiB")
    ax.set(ylabel="MiB (this rank)", title="Peak memory per phase (last logged step)")
    if not phases:
        ax.text(0.5, 0.5, "no memory recorded", ha="center", transform=ax.transAxes)
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(axis="y", alpha=0.3)


def plot_run(rows: list[dict], events: list[dict], meta: dict | None, path: str | Path,
             budget: int | None = None, title: str = "") -> Path:
    """One figure of a run: loss (skipped steps, rollbacks, resumes marked) with the
    learning rate, tokens/s, time per phase, peak memory per phase by category with the
    budget line. ``rows``:
    decoded metrics rows with an int ``step``. Writes ``path``; returns it. Raises
    ValueError when there is nothing to draw or the file cannot be written."""
    rows = [r for r in rows if isinstance(r.get("step"), int)]
    if not rows:
        raise ValueError("no metrics row with a step to draw")
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    marks = _markers(rows, events, meta)
    _loss_panel(axes[0, 0], rows, marks)
    _lr_axis(axes[0, 0], rows)
    _throughput_panel(axes[0, 1], rows)
    _time_panel(axes[1, 0], rows)
    _memory_panel(axes[1, 1], rows, budget)
    fig.suptitle(title, fontsize=11)
    return _finish(plt, fig, Path(path))


def plot_plan(plan: dict[str, Any], path: str | Path) -> Path:
    """Predicted per-rank peak of each configuration of ``plan`` (``Plan.to_dict()``:
    rows with stage, policy, precision, peak, breakdown, fits) as stacked bars by kind,
    with the budget as a line and the recommended configuration starred. Writes
    ``path``; returns it. Raises ValueError when the plan has no rows or the file
    cannot be written."""
    rows = plan.get("rows") or []
    if not rows:
        raise ValueError("the plan has no configuration to draw")
    kinds = list(dict.fromkeys(k for r in rows for k in r.get("breakdown", {})))
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(8.0, 0.45 * len(rows) + 3), 5.5))
    x = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for kind in kinds:
        vals = [r["breakdown"].get(kind, 0) / MIB for r in rows]
        if any(vals):
            ax.bar(x, vals, bottom=bottom, color=COLORS.get(kind, None), label=kind, width=0.75,
                   edgecolor="white", linewidth=0.3)
            bottom = [b + v for b, v in zip(bottom, vals)]
    rec = plan.get("recommended")
    for i, r in enumerate(rows):
        peak = r["peak"] / MIB
        if not r.get("fits", True):
            ax.bar(i, peak, width=0.75, fill=False, hatch="//", edgecolor=(1, 1, 1, 0.6), linewidth=0)
        if rec and all(r.get(k) == rec.get(k) for k in ("stage", "policy", "precision", "offload")):
            ax.annotate("*", (i, peak), ha="center", va="bottom", fontsize=20, color="#c44e52", weight="bold")
    budget = plan.get("budget")
    if budget:
        ax.axhline(budget / MIB, color="#c44e52", ls="--", lw=1.5, label=f"budget {budget / MIB:,.1f} MiB")
    ax.set_xticks(x, [f"z{r['stage']}\n{r['policy']}\n{r['precision']}"
                      + ("" if r.get("offload", "none") == "none" else "\n" + r["offload"].replace("=", "\n"))
                      for r in rows], fontsize=8)
    ax.set_ylim(0, 1.15 * max([r["peak"] / MIB for r in rows] + [(budget or 0) / MIB]))
    ax.set_ylabel("predicted peak per rank (MiB)")
    n = plan.get("n_params")
    ax.set_title(f"Planner: predicted peak per configuration ({n:,} parameters, {plan.get('world', 1)} rank(s))"
                 + ("; * recommended, hatched = over budget" if budget else ""), fontsize=10)
    ax.legend(fontsize=8, ncol=4, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    return _finish(plt, fig, Path(path))


def plot_frontier(solution: dict[str, Any], path: str | Path) -> Path:
    """The solver's candidates (``Solution.to_dict()``: rows with peak, first_step_peak,
    init_peak, cost or step_s, fits) as predicted time against need (the largest of the
    three peaks), the frontier as a line, the budget as a vertical line and the pick
    starred. Writes ``path``; returns it. Raises ValueError when there is no row."""
    rows = solution.get("rows") or []
    if not rows:
        raise ValueError("the solution has no configuration to draw")

    def need(r: dict[str, Any]) -> float:
        return max(r["peak"], r.get("first_step_peak", 0), r.get("init_peak", 0)) / MIB

    timed = all(r.get("step_s") is not None for r in rows)
    def time_of(r: dict[str, Any]) -> float:
        return _num(r.get("step_s") if timed else r.get("cost"))

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 5.5))
    for fits, color, label in ((True, "#55a868", "fits"), (False, "#8c8c8c", "over budget")):
        sel = [r for r in rows if bool(r.get("fits")) == fits]
        if sel:
            ax.scatter([need(r) for r in sel], [time_of(r) for r in sel], s=22, color=color, label=label, zorder=2)
    front = solution.get("frontier") or []
    if front:
        ax.step([need(r) for r in front], [time_of(r) for r in front], where="post", color="#4c72b0", lw=1.2,
                label="frontier", zorder=1)
    pick = solution.get("pick")
    if pick:
        ax.scatter([need(pick)], [time_of(pick)], marker="*", s=260, color="#c44e52", label="pick", zorder=3)
    budget = solution.get("budget")
    if budget:
        ax.axvline(budget / MIB, color="#c44e52", ls="--", lw=1.2, label=f"budget {budget / MIB:,.1f} MiB")
    ax.set_xlabel("predicted need per rank (MiB): the largest of the steady, first-step and init peaks")
    ax.set_ylabel("predicted seconds per step" if timed else "relative step cost (plan.step_cost)")
    ax.set_title(f"Solver: {len(rows)} configurations dry-run ({solution.get('n_params', 0):,} parameters, "
                 f"{solution.get('world', 1)} rank(s))", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _finish(plt, fig, Path(path))
