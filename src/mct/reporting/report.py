"""``mct report RUN_DIR [--plot FILE.png]``: what a run directory holds, read defensively.

A crashed or diverged run leaves truncated lines, non-finite values and missing keys;
the report keeps every row it can read, names the file and line of each one it
skipped, and prints what is there.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mct.checkpointing.policies import policy_label
from mct.config import CheckpointingConfig, MemoryConfig
from mct.machine import MachineProfile, format_flops, format_rate
from mct.machine.passes import measured_line
from mct.machine.trust import STATED_ERROR, disagreement
from mct.memory import host
from mct.memory.tracker import format_bytes
from mct.reporting.metrics import read_jsonl


@dataclass
class RunData:
    """Everything readable in a run directory. ``warnings``: one line per skipped
    line or unreadable file, naming it."""

    run_dir: Path
    rows: list[dict[str, Any]]
    events: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def budget(self) -> int | None:
        """memory.budget of the run's resolved config, in bytes (None when unset or unreadable)."""
        written = (((self.meta or {}).get("config") or {}).get("memory") or {}).get("budget")
        try:  # bytes in a run's record; a size ('2GiB') in older ones
            return MemoryConfig(budget=written).budget
        except (ValueError, TypeError):
            return None


def load_run(run_dir: str | Path) -> RunData:
    """Read metrics.jsonl (required), events.jsonl and metadata.json (optional).
    Raises ValueError (one line, naming the path and the fix) when ``run_dir`` is not
    a directory, has no readable metrics.jsonl, or that file has no readable row."""
    d = Path(run_dir)
    if not d.exists():
        raise ValueError(f"run directory {str(d)!r} does not exist; pass a directory made by `mct train`")
    if not d.is_dir():
        raise ValueError(f"{str(d)!r} is not a directory; pass the run directory that holds metrics.jsonl")
    path = d / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{str(d)!r} has no metrics.jsonl: pass a run directory made by `mct train`")
    try:
        rows, warnings = read_jsonl(path)
    except OSError as e:
        raise ValueError(f"{str(path)!r} cannot be read ({e.strerror or e}); check its permissions") from None
    stepped = [r for r in rows if isinstance(r.get("step"), int) and not isinstance(r.get("step"), bool)]
    if stepped and len(stepped) < len(rows):
        warnings.append(f"{path}: skipped {len(rows) - len(stepped)} row(s) without an integer 'step'")
    rows = stepped or rows
    bad = [r["step"] for r in stepped if any(k in r and r[k] is not None and not isinstance(r[k], (int, float))
                                             for k in ("loss", "val_loss", "tokens_per_s", "peak_bytes"))]
    if bad:
        warnings.append(f"{path}: non-numeric loss, val_loss, tokens_per_s or peak_bytes at step(s) "
                        f"{', '.join(map(str, bad[:5]))}{' ...' if len(bad) > 5 else ''}")
    if not rows:
        why = f"; {len(warnings)} damaged line(s), the first: {warnings[0]}" if warnings else ""
        raise ValueError(f"{str(path)!r} has no readable step: the run logged nothing{why}")
    run = RunData(d, rows, warnings=warnings)
    if (d / "events.jsonl").is_file():
        try:
            run.events, skipped = read_jsonl(d / "events.jsonl")
            run.warnings += skipped
        except OSError as e:
            run.warnings.append(f"{d / 'events.jsonl'}: not read ({e.strerror or e})")
    run.meta = _read_meta(d / "metadata.json", run.warnings)
    return run


def _read_meta(path: Path, warnings: list[str]) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text(errors="replace"))
    except (OSError, json.JSONDecodeError) as e:
        warnings.append(f"{path}: not read ({e}); the report goes on without it")
        return None
    if not isinstance(meta, dict):
        warnings.append(f"{path}: not a JSON object; the report goes on without it")
        return None
    return meta


def _cell(v: Any, fmt: str, width: int) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return f"{'' if v is None else str(v):>{width}}"
    if isinstance(v, float) and not math.isfinite(v):
        return f"{str(v):>{width}}"
    return f"{v:>{width}{fmt}}"


def _packing_line(rows: list[dict[str, Any]]) -> str | None:
    """'packing: documents, ...' from rows that carry ``docs_per_window`` (data.packing =
    'documents'): mean documents per window, real vs padding tokens and the share of
    targets that count (not across a boundary); None for other runs."""
    packed = [r for r in rows if all(isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)
                                      for k in ("docs_per_window", "real_tokens", "padding_tokens", "target_tokens"))]
    if not packed:
        return None
    real = sum(r["real_tokens"] for r in packed)
    pad = sum(r["padding_tokens"] for r in packed)
    counted = sum(r["target_tokens"] for r in packed)
    docs = sum(r["docs_per_window"] for r in packed) / len(packed)
    return (f"packing: documents, {docs:.2f} documents per window; tokens per logged step {real / len(packed):,.0f} "
            f"real, {pad / len(packed):,.0f} padding; targets counted {100 * counted / max(real, 1):.1f}% "
            f"(none across a document boundary)")


def report_table(run: RunData) -> str:
    """Per logged step: loss, val loss, tokens/s, peak, the measured and the predicted
    seconds of the step and their ratio; then a summary of skips, rollbacks, resumes and
    non-finite values, and the median step time beside the prediction."""
    lines = [f"{'step':>6} {'loss':>8} {'val_loss':>9} {'tokens/s':>10} {'peak':>11} {'s/step':>9} "
             f"{'predicted':>9} {'ratio':>6}"]
    for r in run.rows:
        peak = r.get("peak_bytes")
        peak_s = format_bytes(peak) if isinstance(peak, int) else ""
        lines.append(f"{_cell(r.get('step'), 'd', 6)} {_cell(r.get('loss'), '.4f', 8)} "
                     f"{_cell(r.get('val_loss'), '.4f', 9)} {_cell(r.get('tokens_per_s'), '.0f', 10)} {peak_s:>11} "
                     f"{_cell(r.get('step_time_s'), '.3g', 9)} {_cell(r.get('predicted_step_s'), '.3g', 9)} "
                     f"{_cell(_ratio(r.get('step_time_s'), r.get('predicted_step_s')), '.2f', 6)}")
    def most(*keys: str) -> int:  # counters are cumulative: the largest value seen
        vals = [v for r in run.rows for k in keys
                for v in [(r.get("errors") or {}).get(k[7:]) if k.startswith("errors.") else r.get(k)]
                if isinstance(v, int) and not isinstance(v, bool)]
        return max(vals, default=0)
    nonfinite = [r.get("step") for r in run.rows
                 if r.get("nonfinite") or any(isinstance(v, float) and not math.isfinite(v) for v in r.values())]
    skipped = max(most("errors.skipped_steps", "skipped_steps"), sum(r.get("skipped") is True for r in run.rows))
    summary = [f"skipped steps: {skipped}", f"rollbacks: {most('rollbacks')}",
               f"resumes: {len((run.meta or {}).get('resumes') or [])}", f"events: {len(run.events)}"]
    state = ((run.meta or {}).get("config") or {}).get("optimizer", {}).get("state_dtype", "fp32")
    if state != "fp32":  # Adam's moments in low precision: says why the run's numbers differ from fp32's
        summary.append(f"optimizer state: {state}")
    mixed = _per_block_label(run)
    if mixed:  # each block's own recompute choice: the run's memory and speed follow from it
        summary.append(f"checkpointing per block: {mixed}")
    lines.append("; ".join(summary))
    packed = _packing_line(run.rows)
    if packed:
        lines.append(packed)
    lines += solver_lines(run.meta)
    peaks = [r["peak_bytes"] for r in run.rows if isinstance(r.get("peak_bytes"), int)]
    lines += memory_lines(max(peaks, default=None), (run.meta or {}).get("resident"))
    timing = step_time_line(run.rows)
    if timing:
        lines.append(timing)
    profile = profile_line(run.meta)
    if profile:
        lines.append(profile)
    if nonfinite:
        lines.append(f"non-finite values at logged steps: {', '.join(map(str, nonfinite))}")
    return "\n".join(lines)


def _ratio(measured: Any, predicted: Any) -> float | None:
    ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
             for v in (measured, predicted))
    return measured / predicted if ok else None


def step_time_line(rows: list[dict[str, Any]]) -> str:
    """'step time: measured median X s (after the first logged step), predicted Y s,
    measured / predicted Z'; '' when the rows carry no prediction."""
    pred = [r["predicted_step_s"] for r in rows if _ratio(r.get("step_time_s"), r.get("predicted_step_s"))]
    meas = sorted(r["step_time_s"] for r in rows[1:] if _ratio(r.get("step_time_s"), r.get("predicted_step_s")))
    if not pred or not meas:
        return ""
    median = meas[len(meas) // 2] if len(meas) % 2 else (meas[len(meas) // 2 - 1] + meas[len(meas) // 2]) / 2
    off = disagreement(median, pred[-1]) is not None
    return (f"step time: measured median {median:.3g} s, predicted {pred[-1]:.3g} s "
            f"(measured / predicted {median / pred[-1]:.2f}"
            + (f"; outside the time model's stated {STATED_ERROR}x: the machine profile is suspect, "
               f"mct calibrate --force measures it again)" if off else ")"))


def profile_line(meta: dict[str, Any] | None) -> str:
    """'machine profile: measured T in S s, quiet (...)' of the profile the run used
    (metadata.json ``utilization.machine_profile``); '' when absent or unreadable."""
    try:
        profile = MachineProfile.from_dict(((meta or {}).get("utilization") or {}).get("machine_profile"))
    except ValueError:
        return ""
    return f"machine profile: {measured_line(profile)}"


def solver_pick(plan: dict[str, Any] | None) -> str:
    """The keys ``auto`` set in a run's choice record (metadata.json's ``plan``), as
    ``zero.stage=0 checkpointing.policy=none ...`` (ready for ``--set``), those left off
    omitted; '' for None (nothing was ``auto``)."""
    keys = ("zero.stage", "checkpointing.policy", "checkpointing.offload", "train.loss_chunk_tokens",
            "checkpointing.mlp_tile_tokens", "offload", "data.micro_batch_size", "data.grad_accum")
    off = {"checkpointing.offload": "none", "train.loss_chunk_tokens": 0, "checkpointing.mlp_tile_tokens": 0}
    plan = plan or {}
    return " ".join(f"{k}={plan[k]}" for k in keys if plan.get(k) not in (None, "", [], {}, off.get(k, "")))


def solver_lines(meta: dict[str, Any] | None) -> list[str]:
    """What the solver recorded for a run whose config used ``auto`` (metadata.json's
    ``plan.solver``): the pick as the keys it set, the frontier's size and dry runs, and
    its one-line why; [] for a run without a solver record (or an unreadable one)."""
    plan = (meta or {}).get("plan")
    solver = plan.get("solver") if isinstance(plan, dict) else None
    if not isinstance(solver, dict):
        return []
    pick = solver_pick(plan)
    frontier = solver.get("frontier")
    size = len(frontier) if isinstance(frontier, list) else "?"
    return [f"solver pick: {pick or '?'} (frontier {size} row(s), {solver.get('dry_runs', '?')} dry runs)",
            f"solver why: {solver.get('why') or '-'}"]


def _per_block_label(run: RunData) -> str:
    """The run's checkpointing.per_block as runs ('all*8,selective*8'), '' when it has none
    or it does not read as one."""
    section = ((run.meta or {}).get("config") or {}).get("checkpointing") or {}
    if section.get("policy") != "per_block" or not section.get("per_block"):
        return ""
    try:
        return policy_label(CheckpointingConfig(policy="per_block", per_block=section["per_block"]))
    except (ValueError, TypeError):
        return ""


def plot_title(run: RunData) -> str:
    meta = run.meta or {}
    cfg = meta.get("config") or {}
    bits = [str(run.run_dir)]
    if isinstance(meta.get("n_params"), int):
        bits.append(f"{meta['n_params']:,} parameters")
    for key, section, name in (("mode", "precision", "precision"), ("stage", "zero", "zero stage"),
                               ("policy", "checkpointing", "checkpointing"),
                               ("state_dtype", "optimizer", "optimizer state")):
        v = (cfg.get(section) or {}).get(key)
        if v == "per_block" and _per_block_label(run):
            v = _per_block_label(run)
        if v is not None:
            bits.append(f"{name} {v}")
    if meta.get("world_size"):
        bits.append(f"{meta['world_size']} rank(s)")
    return ", ".join(bits)


@dataclass
class TrainSummary:
    """What ``mct train`` prints at the end of a run (``summary_table``)."""

    steps: int
    final_loss: float
    final_val_loss: float | None
    first_val_loss: float | None
    tokens_per_s: float
    skipped_steps: int
    peaks: dict[str, dict[str, int]] = field(default_factory=dict)
    run_dir: str = ""
    utilization: dict[str, Any] | None = None
    """Model FLOPs per step, achieved FLOP/s, MFU and the machine (``mct.run.utilization``)."""
    page_faults: int | None = None
    """Median minor page faults per step of this process (the metrics rows' ``page_faults``)."""
    host_malloc: str = "default"
    """The run's resolved ``memory.host_malloc`` (``mct.memory.host``)."""
    recipe: str = ""
    """The training recipe in force and its values (``mct.run.recipe.recipe_line``)."""
    adapters: str = ""
    """The run's adapters and their share of the parameters (``mct.adapters.adapter_summary``); '' for none."""
    resident: dict[str, Any] | None = None
    """Each process's peak resident set (``mct.memory.process.job_resident``)."""
    auto: str = ""
    """What ``auto`` resolved to (``solver_pick`` of the run's choice record); '' when nothing was ``auto``."""


FAULTS_HINT_AT = 10_000
"""Page faults per step from which the summary names ``memory.host_malloc = "cache"`` (about
40 MiB of freshly mapped pages a step; a fault costs a few microseconds here), unless the
user tuned malloc in the environment (``mct.memory.host.user_tuned``)."""
FAULTS_HINT = "; memory.host_malloc = \"cache\" keeps freed memory mapped (faster steps, more resident memory)"


def summary_table(s: TrainSummary) -> str:
    """Human-readable end-of-run summary."""
    lines = [f"run dir       {s.run_dir}", *([f"recipe        {s.recipe}"] if s.recipe else []),
             *([f"adapters      {s.adapters}"] if s.adapters else []),
             *([f"auto          {s.auto} (solved for memory.budget at the start; mct report RUN_DIR says why)"] if s.auto else []),
             f"steps         {s.steps} ({s.skipped_steps} skipped)",
             f"train loss    {s.final_loss:.4f}"]
    if s.final_val_loss is not None:
        lines.append(f"val loss      {s.first_val_loss:.4f} (first eval) -> {s.final_val_loss:.4f} (last)")
    lines.append(f"tokens/s      {s.tokens_per_s:,.0f}")
    if s.utilization:
        lines += utilization_lines(s.utilization)
    if s.page_faults is not None:
        lines.append(f"page faults   {s.page_faults:,} per step (median, this process; host_malloc {s.host_malloc})"
                     + (FAULTS_HINT if s.host_malloc == "default" and s.page_faults >= FAULTS_HINT_AT
                        and not host.user_tuned() else ""))
    tensor_peak = max((v.get("total", 0) for v in s.peaks.values()), default=None)
    lines += memory_lines(tensor_peak, s.resident)
    if s.peaks:
        cats = sorted({c for v in s.peaks.values() for c in v if c != "total"})
        lines.append("peak memory by phase (this rank, last logged step):")
        lines.append("  " + f"{'phase':<10}" + "".join(f"{c:>13}" for c in [*cats, "total"]))
        for phase, v in s.peaks.items():
            lines.append("  " + f"{phase:<10}" + "".join(f"{format_bytes(v.get(c, 0)):>13}" for c in [*cats, "total"]))
    return "\n".join(lines)


def utilization_lines(u: dict[str, Any]) -> list[str]:
    """The summary's model FLOPs, achieved FLOP/s, MFU and machine lines."""
    model, hw = u.get("model_flops_per_step"), u.get("hardware_flops_per_step")
    recompute = f"; {format_flops(hw)} with recompute" if hw and hw != model else ""
    lines = [f"model FLOPs   {format_flops(model) + ' per step' if model else '-'} ({u['flops_method']}){recompute}"]
    if u.get("achieved_flops_per_s"):
        lines.append(f"achieved      {format_rate(u['achieved_flops_per_s'])} (model FLOPs / median step time "
                     f"{u['step_time_s']:.3g} s)")
    if u.get("predicted_step_s") and u.get("step_time_s"):
        lines.append(f"step time     {u['step_time_s']:.3g} s measured (median), {u['predicted_step_s']:.3g} s "
                     f"predicted (measured / predicted {u['step_time_s'] / u['predicted_step_s']:.2f})")
    if u.get("mfu") is not None:
        lines.append(f"MFU           {100 * u['mfu']:.3g}% of {format_rate(u['peak_flops_per_s'])} ({u['peak_note']})")
    elif u.get("mfu_over_peak"):
        lines.append(f"MFU           - ({u['mfu_over_peak']})")
    else:
        lines.append(f"MFU           - ({u['peak_note']})")
    lines.append(f"machine       {u['machine']}")
    return lines


def memory_lines(tensor_peak: int | None, resident: dict[str, Any] | None) -> list[str]:
    """The tensor peak (rank 0's tracked tensor bytes) beside each process's peak resident set
    (VmHWM: what a memory limit counts) and the job's total; [] when neither is known."""
    lines = []
    if tensor_peak:
        lines.append(f"tensor peak   {format_bytes(tensor_peak)} (tensor bytes: tracked tensors, rank 0)")
    if not isinstance(resident, dict):
        return lines
    ok = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    workers = resident.get("workers") if isinstance(resident.get("workers"), list) else []
    parts = [f"rank {r} {format_bytes(v)}" for r, v in enumerate(workers) if ok(v)]
    parts += [f"{name} {format_bytes(resident[name])}" for name in ("launcher", "agent") if ok(resident.get(name))]
    if parts:
        lines.append(f"resident      {', '.join(parts)} (resident (VmHWM): each process's peak resident set)")
    if ok(resident.get("total")) and len(parts) > 1:
        lines.append(f"job resident  {format_bytes(resident['total'])} (resident (VmHWM): workers + launcher + agent "
                     f"on rank 0's machine)")
    return lines
