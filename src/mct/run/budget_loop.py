"""The budget feedback loop: an ``auto`` run that overruns its enforced budget at run
time moves to the planner's next, more memory-frugal configuration.

Signal: ``MemoryBudgetExceeded`` from a training step (raised before the optimizer
modifies anything, so the state is that of the last completed step). Action: the
trainer checkpoints that state, rebuilds the engine with the cheapest configuration of
the same plan whose predicted peak is below the one that failed (and not tried yet;
first, where ``auto`` kept the stage-3 root gathered into backward, the same configuration
with the root freed after forward, when that is predicted below),
loads the checkpoint into it (checkpoints reshard across ZeRO stages) and goes on.
Recorded in ``metadata.json`` (``config_changes``) and ``events.jsonl``
(``budget_fallback``). Stop: no such configuration is left: ValueError (exit 2, one line).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mct.config import EngineConfig, with_values
from mct.memory.tracker import format_bytes
from mct.persistence.files import read_json, write_json
from mct.planner.grid import Grid
from mct.planner.plan import make_plan, predict, with_choice
from mct.task import Task


def _key(cfg: EngineConfig) -> tuple[int, str]:
    return int(cfg.zero.stage), str(cfg.checkpointing.policy)


def _root_kept_by_auto(auto_cfg: EngineConfig, current: EngineConfig) -> bool:
    """Did ``auto`` keep the root gathered into backward (``zero.reshard_root_after_forward``
    false at stage 3, where the user's config left it at its default, true)?"""
    return (int(current.zero.stage) == 3 and not current.zero.reshard_root_after_forward
            and auto_cfg.zero.reshard_root_after_forward)


def _root_resharded(cfg: EngineConfig) -> EngineConfig:
    return with_values(cfg, {"zero.reshard_root_after_forward": True})


@dataclass
class BudgetLoop:
    """The ``auto`` config as the user gave it, and the configurations already tried."""

    auto_cfg: EngineConfig
    world: int
    work: Task
    """What the planner dry-runs: the run's model, loss and example batch."""
    peak: int = 0
    """Predicted peak of the configuration in use."""
    tried: set[tuple[int, str]] = field(default_factory=set)

    @classmethod
    def maybe(cls, auto_cfg: EngineConfig, choice: dict[str, Any] | None, world: int,
              work: Task) -> "BudgetLoop | None":
        """A loop for runs whose stage or policy was ``auto`` under an enforced budget; else None."""
        if choice is None or not auto_cfg.memory.enforce:
            return None
        return cls(auto_cfg, world, work, int(choice["predicted_peak_bytes"]),
                   {(int(choice["zero.stage"]), str(choice["checkpointing.policy"]))})

    def next_config(self, current: EngineConfig, error: str) -> tuple[EngineConfig, dict[str, Any]]:
        """The next configuration to try and the change record (FORMATS: step added by
        the caller). Only the stage and policy change (and, first, a stage-3 root ``auto``
        kept gathered into backward is freed after forward): the candidates are planned with
        ``current``'s other keys, what ``auto`` chose included (activation offload, loss
        chunking, state offload, micro-batch x accumulation), as the next engine will run
        them; a per-block pick moves to a uniform policy. Raises ValueError
        when nothing more frugal is left."""
        a = self.auto_cfg
        if _root_kept_by_auto(a, current):  # the cheapest step down: free the root after forward again
            freed = _root_resharded(current)
            peak = predict(self.work, freed, self.world).peak
            if peak < self.peak:
                stage, policy = _key(current)
                same = {"zero.stage": stage, "checkpointing.policy": policy}
                change = {"from": {**same, "zero.reshard_root_after_forward": False, "predicted_peak_bytes": self.peak},
                          "to": {**same, "zero.reshard_root_after_forward": True, "predicted_peak_bytes": peak},
                          "reason": f"memory budget exceeded at run time ({format_bytes(a.memory.budget)})"}
                self.peak = peak
                return freed, change
            current = freed  # the rows below are planned with the root resharded
        stages = (0, 1, 2, 3) if a.zero.stage == "auto" else (int(a.zero.stage),)
        policies = ("none", "all", "sqrt") if a.checkpointing.policy == "auto" else (a.checkpointing.policy,)
        grid = Grid(stages, policies, (a.precision.mode,))
        # the grid's other axes default to current's own (rows with policy 'none' have no
        # regions to offload: planned only when checkpointing.offload is 'none')
        plan = make_plan(self.work, current, self.world, a.memory.budget, grid, advise=False)  # only the rows
        rows = [r for r in plan.rows if (r.stage, r.policy) not in self.tried and r.peak < self.peak]
        if not rows:
            stage, policy = _key(current)
            raise ValueError(f"memory budget exceeded at run time with zero.stage={stage} checkpointing.policy="
                             f"{policy}, and no configuration predicted to need less is left to try ({error.split('.')[0]}); "
                             f"raise memory.budget, lower data.micro_batch_size or use more ranks")
        best = min(rows, key=lambda r: (r.cost, r.peak, r.stage))
        self.tried.add((best.stage, best.policy))
        before, self.peak = self.peak, best.peak
        stage, policy = _key(current)
        change = {"from": {"zero.stage": stage, "checkpointing.policy": policy, "predicted_peak_bytes": before},
                  "to": {"zero.stage": best.stage, "checkpointing.policy": best.policy,
                         "predicted_peak_bytes": best.peak},
                  "reason": f"memory budget exceeded at run time ({format_bytes(a.memory.budget)})"}
        return with_choice(current, best.stage, best.policy), change  # a per_block pick's blocks go with it


def record_config_change(run_dir: str | Path, change: dict[str, Any]) -> None:
    """Append ``change`` to metadata.json's ``config_changes`` (rank 0 calls it)."""
    path = Path(run_dir) / "metadata.json"
    meta = read_json(path)
    meta.setdefault("config_changes", []).append(change)
    write_json(path, meta)
