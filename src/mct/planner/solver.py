"""The solver: the fastest predicted configuration whose predicted peaks fit a per-rank
budget, searched with real dry runs (``mct plan --solve``; ``auto``, mct.auto).

What it varies (a ``Space``): the ZeRO stage, how many blocks recompute (fully and/or
selectively: ``checkpointing.per_block`` counts), activation offload, loss chunking, state
offload tiers and micro-batch x accumulation (their product, the batch per rank, kept).
Precision and the optimizer's state dtype change values: never searched.

How (docs/md, "The solver"):
1. the cheapest check first: the space's most frugal configuration; when it does not
   fit, nothing does (one dry run, then the planner's one-line advice);
2. every branch (stage x activation offload x loss chunk x state offload x micro-batch)
   gets its uniform rows (none, selective, all) dry-run, on every worker;
3. branches in order of their fastest row (no recompute), each searched unless it cannot
   be faster than the best found (time grows with the blocks recomputed) or its uniform rows
   are each no faster and no smaller than a searched branch's: the fewest blocks recomputed
   that fit, along the path the uniform rows say saves bytes for the least time (selective
   blocks first, then converted to all; or all blocks only), bracketed from the uniform
   rows and narrowed by interpolated guesses, each a real dry run (extrapolated in depth).
4. with ``zero.stage = 'auto'`` and a stage-3 pick: the pick with its root unit kept
   gathered from the forward into the backward (``zero.reshard_root_after_forward =
   false``, one all-gather fewer per micro-batch), one more dry run; taken when it fits
   and is predicted faster.
Fit means the steady-state, first-step and init peaks are all <= the budget. The pick is
the fastest predicted (``predicted_seconds``), ties to the larger micro-batch, then the
lower peak, then the lower stage.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any

from mct.checkpointing import find_blocks
from mct.config import EngineConfig, PrecisionMode
from mct.machine.cache import say_line
from mct.memory.tracker import format_bytes
from mct.planner.choice import Choice, OffloadChoice, PlanRow, apply, need_of
from mct.planner.plan import _per_block_of, budget_counts, dry_run_cost, offload_choice, predicted_seconds
from mct.planner.plan import row as plan_row
from mct.planner.depth import Prepared
from mct.planner.dry_run import meta_model
from mct.planner.grid import map_task, prepare_work, resized_batch, task_of
from mct.planner.pool import run_jobs
from mct.planner.resident import ProcessModel, process_model
from mct.planner.overhead import device_rates
from mct.planner.steptime import tokens_per_step
from mct.task.spec import with_loss_chunk

UNIFORM = ("none", "selective", "all")
_PLAN = importlib.import_module("mct.planner.plan")  # predict looked up per call; plan() shadows the name


need = need_of
"""The bytes a row needs of a budget (``mct.planner.choice.need_of``)."""


@dataclass(frozen=True)
class Space:
    """What the solver varies. ``search_policy``: per-block recompute is searched (else
    the config's own policy stays); the others: the values each lever may take."""

    stages: tuple[int, ...]
    search_policy: bool
    acts: tuple[str, ...]
    chunks: tuple[int, ...]
    offloads: tuple[OffloadChoice, ...]
    micro_batches: tuple[int, ...]
    contexts: tuple[int | None, ...] = (None,)
    """parallel.context degrees (None: the config's own; the global batch kept: ``choice.apply``)."""

    def __post_init__(self) -> None:  # offload labels ('optimizer=disk') are parsed once, here
        object.__setattr__(self, "offloads", tuple(offload_choice(o) for o in self.offloads))


@dataclass(frozen=True)
class Candidate:
    """One configuration: ``per_block`` counts as sorted (name, count) pairs for policy 'per_block'."""

    stage: int
    policy: str
    per_block: tuple[tuple[str, int], ...]
    act: str
    chunk: int
    offload: OffloadChoice
    micro_batch: int
    context: int | None = None
    """parallel.context (None: the config's own)."""
    keep_root: bool = False
    """Stage 3: the root unit stays gathered into the backward (zero.reshard_root_after_forward = false)."""

    @property
    def branch(self) -> tuple:
        return (self.stage, self.act, self.chunk, self.offload, self.micro_batch, self.context)


@dataclass
class Solution:
    """Plain data: every candidate dry-run (``rows``, plan rows with ``micro_batch_size``,
    ``grad_accum`` and ``fits`` = all three peaks fit), the non-dominated ones (``frontier``,
    by ``need`` and predicted time), the ``pick`` (None: nothing fits) and ``why``, one line."""

    rows: list[PlanRow]
    budget: int
    world: int
    n_params: int
    precision: PrecisionMode
    n_blocks: int
    pick: PlanRow | None = None
    why: str = ""
    frontier: list[PlanRow] = field(default_factory=list)
    budget_counts: str = "tensors"
    """What the budget is compared with ('process' | 'tensors'; each row's ``need``)."""
    process: ProcessModel | None = None
    """The process model the rows used (None: none known); not serialized."""

    def to_dict(self) -> dict[str, Any]:
        return {"budget": self.budget, "budget_counts": self.budget_counts, "world": self.world, "n_params": self.n_params, "precision": self.precision,
                "n_blocks": self.n_blocks, "pick": self.pick.to_dict() if self.pick is not None else None,
                "why": self.why, "frontier": [r.to_dict() for r in self.frontier],
                "rows": [r.to_dict() for r in self.rows]}


def configure(cfg: EngineConfig, stage: int, policy: str, per_block: dict[str, int] | list | None, act: str,
              chunk: int, offload: OffloadChoice, micro_batch: int, mlp_tile: int | None = None,
              reshard_root: bool | None = None, context: int | None = None) -> EngineConfig:
    """``apply(cfg, Choice(...))`` of a candidate's keys: checkpointing.per_block (a uniform
    policy drops it), data.micro_batch_size x data.grad_accum (their product kept), and unless
    None zero.reshard_root_after_forward. Raises ValueError when the micro-batch does not
    divide that product."""
    return apply(cfg, Choice(stage, policy, None, offload, act, chunk, mlp_tile, per_block or [], micro_batch,
                             reshard_root, context))


def configure_row(cfg: EngineConfig, row: PlanRow) -> EngineConfig:
    """``cfg`` as a solver row says (``apply`` of its choice)."""
    return apply(cfg, dataclasses.replace(row.choice, precision=None))


def timing(work: Any, cfg: EngineConfig, world: int, device: str = "cpu", *, measure: bool = True) -> dict[str, Any]:
    """The keywords that give every solver row its predicted seconds (``plan.row``'s ``rates``
    and ``tokens``): this machine's rates (``measure=False``: the cached profile only, as a
    training rank reads it; no rates: rows ranked by their relative cost)."""
    rates, warnings = device_rates(world, device, measure=measure)
    if not measure and int(os.environ.get("RANK", "0")) == 0:  # every rank of a run resolves `auto`; one says it
        for warning in warnings:
            say_line(f"warning: {warning}")
    # a budget counting the process cannot be solved without its baseline: measured where missing
    process, why = process_model(task_of(work), cfg, device, measure=measure or cfg.memory.counts_process)
    counts = budget_counts(cfg, process, why)  # a solve always has a budget
    return {"rates": rates, "tokens": tokens_per_step(task_of(work).batch, cfg.data.grad_accum,
                                       world // cfg.parallel.context),
            "process": process, "counts": counts}


class Evaluator:
    """Dry-runs candidates (each once, on up to ``workers`` processes) into solver rows."""

    def __init__(self, work: Any, cfg: EngineConfig, world: int, budget: int, workers: int,
                 row_kw: dict[str, Any] | None) -> None:
        self.cfg, self.world, self.budget, self.workers = cfg, world, budget, workers
        self.work = prepare_work(work, cfg)
        self.row_kw = timing(work, cfg, world) if row_kw is None else row_kw
        self.n = self.work.stack.n if isinstance(self.work, Prepared) else \
            len(find_blocks(meta_model(task_of(work).model_fn), cfg.checkpointing.blocks))
        self.done: dict[Candidate, PlanRow] = {}
        self._works: dict[tuple[int, int], Any] = {}

    def _work(self, chunk: int, mb: int) -> Any:
        if (chunk, mb) not in self._works:
            w = map_task(self.work, with_loss_chunk, chunk)
            if mb != self.cfg.data.micro_batch_size:
                w = map_task(w, dataclasses.replace, batch=resized_batch(task_of(w).batch, mb))
            self._works[chunk, mb] = w
        return self._works[chunk, mb]

    def config(self, c: Candidate) -> EngineConfig:
        """The candidate's config; policy 'per_block' without counts: the config's own per_block."""
        pb = dict(c.per_block) if c.per_block else (self.cfg.checkpointing.per_block or None)
        return configure(self.cfg, c.stage, c.policy, pb, c.act, c.chunk, c.offload, c.micro_batch,
                         reshard_root=False if c.keep_root else None, context=c.context)

    def rows(self, cands: list[Candidate]) -> list[PlanRow]:
        """The rows of ``cands``, dry-running those not seen yet in one batch of jobs."""
        todo = list(dict.fromkeys(c for c in cands if c not in self.done))
        configs = [self.config(c) for c in todo]
        runs = run_jobs(lambda i: _PLAN.predict(self._work(todo[i].chunk, todo[i].micro_batch), configs[i],
                                                  self.world),
                        len(todo), workers=self.workers, cost=[dry_run_cost(self.work, c) for c in configs])
        for c, run, config in zip(todo, runs, configs):
            mixed = _per_block_of(self.work, config) if c.policy == "per_block" else {}
            choice = Choice(c.stage, c.policy, self.cfg.precision.mode, c.offload, c.act, c.chunk,
                            config.checkpointing.mlp_tile_tokens, mixed.get("per_block"))
            r = plan_row(run, choice, self.world, self.budget, recomputed=mixed.get("recomputed"), **self.row_kw)
            r = dataclasses.replace(r, micro_batch_size=c.micro_batch, grad_accum=config.data.grad_accum,
                                    context=config.parallel.context,
                                    n_params=run.n_params,
                                    reshard_root_after_forward=config.zero.reshard_root_after_forward)
            self.done[c] = dataclasses.replace(r, fits=r.need <= self.budget)
        return [self.done[c] for c in cands]

    def candidate(self, branch: tuple, blocks: dict[str, int]) -> Candidate:
        """The candidate of ``branch`` with ``blocks`` recomputing (counts; the rest none); one
        choice for every block is that uniform policy."""
        stage, act, chunk, offload, mb, context = branch
        counts = {k: v for k, v in blocks.items() if v}
        uniform = [k for k, v in counts.items() if v == self.n]
        policy = uniform[0] if uniform else ("none" if not counts else "per_block")
        pb = tuple(sorted(counts.items())) if policy == "per_block" else ()
        return Candidate(stage, policy, pb, "none" if policy == "none" else act, chunk, offload, mb, context)


def _position(path: str, j: int, n: int) -> dict[str, int]:
    """Block counts at step ``j`` of a path: 'all': j blocks all; 'selective': j blocks
    selective up to n, then j - n of them converted to all."""
    if path == "all":
        return {"all": j}
    return {"selective": j} if j <= n else {"all": j - n, "selective": 2 * n - j}


def _path(none: PlanRow, sel: PlanRow | None, full: PlanRow) -> str:
    """The path that saves bytes for the least time: selective first when its seconds per
    byte saved are fewer than all's (a linear program's vertex, per block), else all only."""
    if sel is None:
        return "all"
    saved_sel, saved_all = need(none) - need(sel), need(none) - need(full)
    if saved_sel <= 0 or saved_all <= 0:
        return "all"
    t0 = predicted_seconds(none)
    return "selective" if (predicted_seconds(sel) - t0) / saved_sel < (predicted_seconds(full) - t0) / saved_all \
        else "all"


class Search:
    """One solve: the evaluator, the best row so far, the branches searched."""

    def __init__(self, ev: Evaluator, space: Space) -> None:
        self.ev, self.space = ev, space
        self.best: PlanRow | None = None
        self.searched: list[tuple] = []
        self.skipped: set[tuple] = set()  # dominated branches: their activation offload is not searched either

    def consider(self, rows: list[PlanRow]) -> None:
        for r in rows:
            if r.fits and (self.best is None or rank(r) < rank(self.best)):
                self.best = r

    def beaten(self, t: float) -> bool:
        return self.best is not None and t >= predicted_seconds(self.best)

    def seed(self, branch: tuple, policy: str) -> Candidate:
        """The uniform ``policy`` of ``branch``."""
        return self.ev.candidate(branch, {policy: self.ev.n} if policy != "none" else {})

    def seeds(self, branch: tuple, lazy: bool = False) -> dict[str, PlanRow]:
        """The uniform rows of ``branch`` dry-run so far (all of them unless ``lazy``)."""
        cands = {p: self.seed(branch, p) for p in UNIFORM}
        return {p: self.ev.done[c] for p, c in cands.items() if not lazy or c in self.ev.done}

    def order(self, branch: tuple) -> tuple:
        """Branches by their fastest row, then by the time a straight line from their none
        row to their all row puts at the budget (activation offload after the branch without)."""
        seeds = self.seeds(branch, lazy=True)
        t0 = predicted_seconds(seeds["none"])
        base = self.seeds(branch[:1] + ("none",) + branch[2:], lazy=True)
        if "all" not in base:
            return t0, math.inf, branch[1] != "none"
        over, span = need(base["none"]) - self.ev.budget, need(base["none"]) - need(base["all"])
        frac = min(max(over / span, 0.0), 1.0) if span > 0 else 1.0
        return t0, t0 + frac * (predicted_seconds(base["all"]) - t0), branch[1] != "none"

    def dominated(self, branch: tuple) -> bool:
        """Are ``branch``'s none and all rows each no faster and no smaller than a searched
        branch's? Its mixes are then taken to be dominated by that branch's too."""
        mine = self.seeds(branch, lazy=True)
        for other in self.searched:
            theirs = self.seeds(other)
            if all(predicted_seconds(mine[p]) >= predicted_seconds(theirs[p]) and need(mine[p]) >= need(theirs[p])
                   for p in ("none", "all")):
                return True
        return False

    def branch(self, branch: tuple) -> None:
        """The fewest blocks recomputed that fit in ``branch`` (the module docstring, step 3)."""
        ev, n = self.ev, self.ev.n
        seeds = self.seeds(branch, lazy=True)
        if seeds["none"].fits or not seeds["all"].fits:
            return
        if self.dominated(branch):
            self.skipped.add(branch)
            return
        self.consider(ev.rows([self.seed(branch, "selective")]))
        seeds = self.seeds(branch)
        self.searched.append(branch)
        path = _path(seeds["none"], seeds.get("selective"), seeds["all"])
        length = n if path == "all" else 2 * n
        known = {0: seeds["none"], length: seeds["all"]}
        if path == "selective":
            known[n] = seeds["selective"]
        lo = max(j for j, r in known.items() if not r.fits)
        hi = min(j for j, r in known.items() if r.fits and j > lo)
        if self.best is not None:  # the most blocks it may recompute and still be faster (time along the path)
            t0, t1 = predicted_seconds(known[0]), predicted_seconds(known[length])
            cap = max((j for j in range(lo + 1, hi) if t0 + (t1 - t0) * j / length < predicted_seconds(self.best)),
                      default=None)
            if cap is None:
                return
            if cap >= _guess(known, lo, hi, ev.budget):
                cap = None
        if self.best is not None and cap is not None:  # likely too slow: one dry run says whether it can fit
            row = ev.rows([ev.candidate(branch, _position(path, cap, n))])[0]
            known[cap] = row
            if not row.fits:
                return
            hi = cap
        rounds = 0
        while hi - lo > 1 and not self.beaten(predicted_seconds(known[lo])):
            guess = _guess(known, lo, hi, ev.budget)
            points = {guess, guess - 1} if ev.workers > 1 else {guess}
            if rounds % 2 or ev.workers > 2:  # an interpolation that stalls on one side: bisect too
                points.add((lo + hi) // 2)
            points = sorted(p for p in points if lo < p < hi)
            rows = ev.rows([ev.candidate(branch, _position(path, j, n)) for j in points])
            known.update(zip(points, rows))
            hi = min(j for j, r in known.items() if r.fits and j > lo)
            lo = max(j for j, r in known.items() if not r.fits and j < hi)
            rounds += 1
        self.consider([known[hi]])


def _guess(known: dict[int, PlanRow], lo: int, hi: int, budget: int) -> int:
    """Where a straight line between the bracket's rows meets the budget (a step strictly inside)."""
    excess_lo, excess_hi = need(known[lo]) - budget, need(known[hi]) - budget
    guess = lo + math.ceil((hi - lo) * excess_lo / max(excess_lo - excess_hi, 1))
    return min(max(guess, lo + 1), hi - 1)


def rank(row: Mapping[str, Any]) -> tuple:
    """The order of the pick (a ``PlanRow``, or its ``to_dict``): fastest, then the larger
    micro-batch, the lower need, the lower stage."""
    return predicted_seconds(row), -row["micro_batch_size"], need(row), row["stage"]


def branches(space: Space) -> list[tuple]:
    return [(s, a, c, o, m, d) for d in space.contexts for m in space.micro_batches for o in space.offloads
            for c in space.chunks for a in space.acts for s in space.stages if o.params == "none" or s == 3]


def frugal(space: Space, policy: str) -> Candidate:
    """The space's configuration with the lowest peaks (every lever at its most frugal)."""
    offload = space.offloads[-1] if 3 in space.stages else next(
        (o for o in reversed(space.offloads) if o.params == "none"), OffloadChoice())
    act = space.acts[-1] if policy != "none" else "none"
    pb = ()
    contexts = [d for d in space.contexts if d is not None]
    return Candidate(max(space.stages), policy, pb, act, max(space.chunks), offload, min(space.micro_batches),
                     max(contexts) if contexts else None)


def solve(work: Any, cfg: EngineConfig, world: int, budget: int, space: Space, *, workers: int = 1,
          row_kw: dict[str, Any] | None = None) -> Solution:
    """The fastest predicted configuration of ``space`` whose peaks fit ``budget`` (module
    docstring), for ``work`` (a Task or ``Prepared``) on ``world`` ranks, the other keys as in
    ``cfg``. ``row_kw``: keywords every ``plan.row`` gets. Returns the Solution (``pick`` None
    when nothing fits). Raises ValueError as ``plan.make_plan``."""
    ev = Evaluator(work, cfg, world, budget, workers, row_kw)
    policy = ("all" if ev.n else "none") if space.search_policy else cfg.checkpointing.policy
    first = ev.rows([frugal(space, policy)])[0]
    sol = Solution([], budget, world, first.n_params, cfg.precision.mode, ev.n,
                   budget_counts=ev.row_kw.get("counts", "tensors"), process=ev.row_kw.get("process"))
    if not first.fits:
        sol.rows = list(ev.done.values())
        return sol
    search = Search(ev, space)
    all_branches = branches(space)
    if not (space.search_policy and ev.n):
        search.consider(ev.rows([Candidate(b[0], policy, (), b[1] if policy != "none" else "none", *b[2:])
                                 for b in all_branches]))
    else:  # uniform rows: every branch's none, and selective and all without activation offload
        search.consider(ev.rows([search.seed(b, p) for b in all_branches for p in ("none", "all")
                                 if p == "none" or b[1] == "none"]))
        for b in sorted(all_branches, key=search.order):
            base = b[:1] + ("none",) + b[2:]
            if search.beaten(predicted_seconds(search.seeds(b, lazy=True)["none"])) or base in search.skipped:
                continue
            search.consider(ev.rows([search.seed(b, p) for p in ("none", "all")]))
            search.branch(b)
    if search.best is not None and search.best.stage == 3 and cfg.zero.stage == "auto" \
            and cfg.zero.reshard_root_after_forward:
        picked = next(c for c, r in ev.done.items() if r is search.best)
        search.consider(ev.rows([dataclasses.replace(picked, keep_root=True)]))
    sol.rows = list(ev.done.values())
    sol.pick = search.best
    sol.frontier = frontier(sol.rows)
    sol.why = why(sol, ev) if sol.pick is not None else ""
    return sol


def frontier(rows: list[Any]) -> list[Any]:
    """The rows no other row beats in both need and predicted time, by need."""
    out: list[PlanRow] = []
    for r in sorted(rows, key=lambda r: (need(r), predicted_seconds(r))):
        if not out or predicted_seconds(r) < predicted_seconds(out[-1]):
            out.append(r)
    return out


def recompute_label(row: PlanRow, n: int) -> str:
    """What a row recomputes, in words: 'no blocks', 'every block (all)', '9 of 32 blocks (all 9)'."""
    if row.policy == "none":
        return "no blocks"
    if row.policy != "per_block":
        return f"every block ({row.policy})"
    pb = row.per_block or {}
    if isinstance(pb, list):  # the config's own list: one choice per block
        pb = {c: pb.count(c) for c in ("all", "selective")}
    parts = [f"{k} {v}" for k, v in sorted(pb.items()) if v]
    return f"{sum(pb.values())} of {n} blocks ({', '.join(parts)})"


def why(sol: Solution, ev: Evaluator) -> str:
    """One line: what the pick recomputes, its time against its branch's no-recompute row,
    and the fastest fitting uniform row's."""
    p = sol.pick
    assert p is not None
    picked = next(c for c, r in ev.done.items() if r is p)
    base_c = dataclasses.replace(picked, policy="none", per_block=(), act="none", keep_root=False)
    base = ev.done.get(base_c)  # the pick's branch without recompute (searched policies only)
    t0 = predicted_seconds(base) if base is not None else min(predicted_seconds(r) for r in sol.rows)
    than = "the no-recompute time" if base is not None else "the fastest row's time"
    tried = [r for r in sol.rows if r.policy != "per_block" and r.reshard_root_after_forward is not False]
    uniform = [r for r in tried if r.fits]
    fastest = min(uniform, key=rank) if uniform else None
    other = ("no uniform policy was dry-run" if not tried else "no uniform policy fits" if fastest is None else
             f"the fastest uniform that fits (zero.stage={fastest.stage} {fastest.policy}"
             f"{'' if fastest.act_offload == 'none' else ' act ' + fastest.act_offload}) would be "
             f"{predicted_seconds(fastest) / t0:.2f}x")
    unit = f", {p.step_s:.3g} s/step" if p.step_s is not None else ""
    if picked.context is not None:
        unit += f", parallel.context={p.context}"
    if p.reshard_root_after_forward is False:
        unit += ", zero.reshard_root_after_forward=false (one root all-gather fewer)"
    return (f"fastest that fits {format_bytes(sol.budget)}: zero.stage={p.stage}, recomputes "
            f"{recompute_label(p, sol.n_blocks)}, {predicted_seconds(p) / t0:.2f}x {than}{unit}; "
            f"{other} ({len(sol.rows)} dry runs)")
