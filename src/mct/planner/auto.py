"""What ``auto`` and ``mct plan --solve`` ask of the solver (``mct.planner.solver``): the
space a config leaves open, the levers that change numerics only when allowed
(``memory.solver_allow``), the old cascade for the rest (loss chunking, then state offload,
only when nothing fits without them), the resolved config and its record, and the text.

Levers and numerics (docs/planner.md, "The solver"): the ZeRO stage, per-block recompute
(every random op replayed) and activation offload train bit-identically: always searched.
Loss chunking changes the order of the loss's sums, micro-batch x accumulation the order of
the gradient sums (and which dropout seed a sample gets): searched only when allowed
('loss_chunk', 'micro_batch'); chunking is still tried when nothing fits without it, as
``auto`` always did. State offload ('offload') changes no numerics, but moves the state to
host memory or disk: tried when nothing fits without it unless allowed. The context degree
('context') changes the order of the attention's and the gradients' sums: searched only when
allowed, the global batch kept. Precision and the optimizer's state dtype are never changed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mct.config import SOLVER_LEVERS, EngineConfig
from mct.memory.tracker import format_bytes
from mct.planner.grid import batch_size, prepare_work, task_of
from mct.planner.choice import OffloadChoice, PlanRow, counts_text
from mct.planner.plan import (AUTO_LOSS_CHUNK, AUTO_MLP_TILE, STAGES, Plan, _advice, _chunk_setting, for_device,
                              _offload_settings, _policy_settings, _tiling_may_fit, auto_act_offload, auto_offloads)
from mct.planner.solver import (Solution, Space, configure_row, recompute_label, solve,
                                timing)


def check_allow(allow: Any, key: str = "memory.solver_allow") -> tuple[str, ...]:
    """``allow`` (a list, or a comma-separated string) as a tuple of levers. Raises ValueError
    (one line, naming the value and the choices) for anything else."""
    items = [v.strip() for v in allow.split(",") if v.strip()] if isinstance(allow, str) else list(allow)
    bad = [v for v in items if v not in SOLVER_LEVERS]
    if bad:
        raise ValueError(f"{key} {allow!r}: {bad[0]!r} is not a lever the solver may be allowed; choose from "
                         f"{', '.join(SOLVER_LEVERS)} (comma-separated)")
    return tuple(items)


def settings(row: PlanRow) -> str:
    """A solver row as --set arguments."""
    out = [f"zero.stage={row.stage}", _policy_settings(row)]
    if row.act_offload != "none":
        out.append(f"checkpointing.offload={row.act_offload}")
    out.append(_offload_settings(row).strip())
    out.append(_chunk_setting(row).strip())
    out.append(f"data.micro_batch_size={row.micro_batch_size} data.grad_accum={row.grad_accum}")
    if row.context is not None and row.context > 1:
        out.append(f"parallel.context={row.context}")
    return " ".join(o for o in out if o)


def space_for(work: Any, cfg: EngineConfig, allow: tuple[str, ...] | list[str], device: str = "cpu", *,
              stages: tuple[int, ...] | None = None, search_policy: bool | None = None,
              world: int = 1) -> Space:
    """The space ``auto`` searches for ``cfg`` (stages and policy where they are 'auto'; or as
    given) with the levers ``allow`` names ('micro_batch', 'loss_chunk', 'offload'; the last two
    as a free choice, not only when nothing fits; 'context': ``context_degrees`` on ``world``
    ranks). Activation offload is searched when the config leaves it off."""
    if stages is None:
        stages = STAGES if cfg.zero.stage == "auto" else (int(cfg.zero.stage),)
    if search_policy is None:
        search_policy = cfg.checkpointing.policy == "auto"
    own_act = cfg.checkpointing.offload
    acts = ("none", auto_act_offload(device)) if own_act == "none" and (
        search_policy or cfg.checkpointing.policy != "none") else (own_act,)
    own_chunk = cfg.train.loss_chunk_tokens
    chunks = (0, AUTO_LOSS_CHUNK) if "loss_chunk" in allow and chunkable(work, cfg) else (own_chunk,)
    offloads = ("none", *auto_offloads(device)) if "offload" in allow and not cfg.offload.enabled \
        else (OffloadChoice.of(cfg),)
    per_rank = cfg.data.micro_batch_size * cfg.data.grad_accum
    mbs = (cfg.data.micro_batch_size,)
    if "micro_batch" in allow and batch_size(task_of(work).batch) == cfg.data.micro_batch_size:
        mbs = tuple(b for b in range(per_rank, 0, -1) if per_rank % b == 0)
    contexts = context_degrees(cfg, world) if "context" in allow else (None,)
    return Space(tuple(stages), search_policy, acts, chunks, offloads, mbs, contexts)


def context_degrees(cfg: EngineConfig, world: int) -> tuple[int, ...]:
    """The parallel.context degrees the solver may choose on ``world`` ranks: each divides the
    world, has model.seq_len a multiple of 2 x it, and keeps the global batch a whole number of
    windows per rank (``choice.apply``)."""
    per_rank, own = cfg.data.micro_batch_size * cfg.data.grad_accum, cfg.parallel.context
    return tuple(d for d in range(1, world + 1) if world % d == 0 and cfg.model.seq_len % (2 * d) == 0
                 and (per_rank * d) % own == 0 and (per_rank * d // own) % cfg.data.micro_batch_size == 0
                 or d == own)


def chunkable(work: Any, cfg: EngineConfig) -> bool:
    """Can the solver turn loss chunking on: the config leaves it off and the loss is a model source's default."""
    return cfg.train.loss_chunk_tokens == 0 and task_of(work).loss_for_chunk is not None


def solve_auto(work: Any, cfg: EngineConfig, world: int, budget: int, allow: tuple[str, ...] | list[str],
               device: str = "cpu", *, workers: int = 1, row_kw: dict[str, Any] | None = None,
               space: Space | None = None) -> Solution:
    """``solve`` over ``space`` (default ``space_for``), then, when nothing fits, with loss
    chunking (``AUTO_LOSS_CHUNK`` tokens, where ``chunkable``), then MLP tiling
    (``AUTO_MLP_TILE`` tokens, when the config leaves it off and the blocks have an MLP), and
    then state offload (``auto_offloads(device)``, where the config sets none), as ``auto``
    has always tried them; each keeps the ones before. ``row_kw``: default ``timing``."""
    cfg = for_device(cfg, device)  # the dry runs' config; resolve_auto configures the user's own
    space = space or space_for(work, cfg, allow, device, world=world)
    work = prepare_work(work, cfg)
    row_kw = timing(work, cfg, world, device) if row_kw is None else row_kw  # once for every solve below
    sol = solve(work, cfg, world, budget, space, workers=workers, row_kw=row_kw)
    if sol.pick is None and "loss_chunk" not in allow and chunkable(work, cfg):
        space = dataclasses.replace(space, chunks=(AUTO_LOSS_CHUNK,))
        sol = _more(sol, solve(work, cfg, world, budget, space, workers=workers, row_kw=row_kw))
    if sol.pick is None and _tiling_may_fit(cfg, work):
        # same numerics up to the weight gradients' sums
        cfg = dataclasses.replace(cfg, checkpointing=dataclasses.replace(cfg.checkpointing,
                                                                         mlp_tile_tokens=AUTO_MLP_TILE))
        sol = _more(sol, solve(work, cfg, world, budget, space, workers=workers, row_kw=row_kw))
    if sol.pick is None and "offload" not in allow and not cfg.offload.enabled:
        space = dataclasses.replace(space, offloads=auto_offloads(device))
        sol = _more(sol, solve(work, cfg, world, budget, space, workers=workers, row_kw=row_kw))
    return sol


def _more(before: Solution, after: Solution) -> Solution:
    """``after`` with ``before``'s rows too (the advice names the smallest of all)."""
    seen = {id(r) for r in after.rows}
    after.rows = [*after.rows, *(r for r in before.rows if id(r) not in seen)] if after.pick is None else after.rows
    return after


def nothing_fits(sol: Solution, work: Any, cfg: EngineConfig) -> str:
    """The planner's one-line 'nothing fits' advice for a solution without a pick."""
    plan = Plan(sol.rows, sol.budget, sol.world, sol.n_params, sol.precision, None, "",
                budget_counts=sol.budget_counts, process=sol.process)
    return _advice(plan, work, cfg)


def resolve_auto(cfg: EngineConfig, world: int, work: Any, *,
                 device: str = "cpu") -> tuple[EngineConfig, dict | None]:
    """Replace ``zero.stage = 'auto'`` and/or ``checkpointing.policy = 'auto'`` by the
    fastest predicted configuration whose peaks fit ``memory.budget`` (``solve_auto``: the
    stage and/or per-block recompute, activation offload, and the levers
    ``memory.solver_allow`` names; loss chunking and state offload when nothing fits
    without them). The other keys stay as set. Returns (resolved config, the choice and
    its prediction; None when nothing was 'auto'). Raises ValueError when 'auto' has no
    budget, or when nothing fits (one line: by how much the smallest misses and what would
    make it fit)."""
    auto = [k for k, v in (("zero.stage", cfg.zero.stage), ("checkpointing.policy", cfg.checkpointing.policy))
            if v == "auto"]
    if not auto:
        return cfg, None
    budget = cfg.memory.budget
    if budget is None:
        raise ValueError(f"{' and '.join(auto)} = 'auto' needs a per-rank budget to plan for: set memory.budget, "
                         f"e.g. --set memory.budget=2GiB (or choose the value yourself; `mct plan` helps)")
    sol = solve_auto(work, cfg, world, budget, tuple(cfg.memory.solver_allow), device,
                     row_kw=timing(work, cfg, world, device, measure=False))  # a training rank measures nothing
    best = sol.pick
    if best is None:
        raise ValueError(nothing_fits(sol, work, cfg))
    return configure_row(cfg, best), choice_record(best, sol, auto, budget, world, cfg)


def choice_record(best: PlanRow, sol: Solution, auto: list[str], budget: int, world: int,
                  cfg: EngineConfig) -> dict[str, Any]:
    """What ``auto`` chose, for metadata.json's ``plan`` (its keys are the record's format):
    the keys set, the prediction, the solver's why and frontier."""
    return {"auto": auto, "zero.stage": best.stage, "checkpointing.policy": best.policy,
            "checkpointing.per_block": best.per_block,
            "offload": best.offload.label, "checkpointing.offload": best.act_offload,
            "train.loss_chunk_tokens": best.loss_chunk_tokens,
            "checkpointing.mlp_tile_tokens": best.mlp_tile_tokens,
            "data.micro_batch_size": best.micro_batch_size, "data.grad_accum": best.grad_accum,
            "zero.reshard_root_after_forward": best.reshard_root_after_forward,
            "parallel.context": best.context,
            "predicted_offloaded_bytes": best.offloaded,
            "budget_bytes": budget, "budget_counts": sol.budget_counts,
            "predicted_process_peak_bytes": best.process_peak, "predicted_peak_bytes": best.peak,
            "predicted_peak_phase": best.phase,
            "predicted_breakdown": best.breakdown, "predicted_phases": best.phases,
            "predicted_first_step_peak_bytes": best.first_step_peak,
            "predicted_init_peak_bytes": best.init_peak, "cost": best.cost,
            "predicted_step_s": best.step_s, "predicted_tokens_per_s": best.tokens_per_s,
            "world_size": world,
            "solver": {"why": sol.why, "dry_runs": len(sol.rows), "allow": list(cfg.memory.solver_allow),
                       "frontier": [_brief(r) for r in sol.frontier]}}


def _brief(r: PlanRow) -> dict[str, Any]:
    """A frontier row for metadata.json: its configuration, need and predicted time."""
    keys = ("stage", "policy", "per_block", "act_offload", "loss_chunk_tokens", "mlp_tile_tokens", "offload",
            "micro_batch_size", "reshard_root_after_forward",
            "grad_accum", "peak", "first_step_peak", "init_peak", "cost", "step_s", "fits")
    d = r.to_dict()
    return {k: d.get(k) for k in keys}


def format_solution(sol: Solution) -> str:
    """The solution as text: what was searched, the frontier (need vs predicted time, the
    pick starred), the pick as --set arguments and why, one line each."""
    timed = all(r.step_s is not None for r in sol.rows)
    head = ["need", "steady", "first", "init", "s/step" if timed else "cost", "stage", "recompute", "act",
            "loss_chunk", "offload", "micro x accum", "fits"]
    table = [[format_bytes(r.need) + ("*" if r is sol.pick else ""), format_bytes(r.peak),
              format_bytes(r.first_step_peak), format_bytes(r.init_peak), f"{r.seconds:.4g}",
              str(r.stage), recompute_label(r, sol.n_blocks), r.act_offload,
              str(r.loss_chunk_tokens or "off"), r.offload.label, f"{r.micro_batch_size} x {r.grad_accum}",
              "yes" if r.fits else "no"] for r in sol.frontier]
    if any(r.context is not None for r in sol.rows):  # the solver chose the degree too
        head.append("context")
        table = [[*t, str(r.context)] for t, r in zip(table, sol.frontier)]
    widths = [max([len(h)] + [len(t[i]) for t in table]) for i, h in enumerate(head)]
    process = sol.budget_counts == "process"
    lines = [f"model: {sol.n_params:,} parameters, {sol.n_blocks} blocks; {sol.world} rank(s); budget per rank: "
             f"{format_bytes(sol.budget)} ({counts_text(sol.budget_counts)}); {sol.precision}; "
             f"{len(sol.rows)} configurations dry-run",
             "frontier (need = the largest of the steady, first-step and init peaks"
             + (" + the runtime baseline, allocator overhead and rollback snapshots: the process peak" if process else "")
             + "; no other configuration dry-run needs less and is faster):",
             "  ".join(f"{h:>{w}}" for h, w in zip(head, widths))]
    lines += ["  ".join(f"{v:>{w}}" for v, w in zip(t, widths)) for t in table]
    if sol.pick is not None:
        lines += [f"pick: {settings(sol.pick)}", f"why: {sol.why}"]
    return "\n".join(lines)
