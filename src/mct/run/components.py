"""The run's small components. Each owns its state (``state_dict`` /
``load_state_dict`` where it has any) and decides for itself when it acts
(``should_*``), so the loop in ``trainer.py`` only calls them in order."""

from __future__ import annotations

import math
import statistics
import sys
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from mct.config import EngineConfig, TrainConfig
from mct.data.sampler import BatchSampler
from mct.planner import peak_check
from mct.reporting.metrics import flatten_peaks


@dataclass
class LoopCounters:
    """Where the loop is; saved in every checkpoint (key ``loop``) and restored with a
    rollback snapshot."""

    step: int = 0
    """Steps completed (skipped ones included), = the next step to run."""
    opt_step: int = 0
    """Optimizer updates applied: the LR schedule's position."""
    skipped: int = 0
    first_val: float | None = None
    last_val: float | None = None

    def state_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for k in asdict(self):
            if k in sd:
                setattr(self, k, sd[k])

    def validated(self, loss: float) -> None:
        self.last_val = loss
        self.first_val = loss if self.first_val is None else self.first_val


class Validator:
    """Validation loss every ``train.eval_every`` steps and after the last one: the mean
    over ``train.eval_batches`` fixed batches of the validation split (no state change),
    the same batches on any world size. When the ranks divide the batches, rank r takes
    batches r, r + W, ...; otherwise every rank evaluates every batch (the same mean,
    W times the work)."""

    def __init__(self, tcfg: TrainConfig, sampler: BatchSampler, loss_fn: Callable) -> None:
        self.tcfg, self.sampler, self.loss_fn = tcfg, sampler, loss_fn

    def should_validate(self, step: int, last: bool) -> bool:
        every = self.tcfg.eval_every
        return bool(every) and (step % every == 0 or last)

    def run(self, engine: Any, rank: int, world: int) -> float:
        """The validation loss (collective: ``eval_loss`` averages over ranks)."""
        n = self.tcfg.eval_batches
        mine = range(rank, n, world) if n % world == 0 else range(n)
        losses = [engine.eval_loss(self.sampler.val_batch(i, rank), self.loss_fn) for i in mine]
        return sum(losses) / len(losses)


class StepLog:
    """The metrics row of a step (keys in docs/metrics.md): written every
    ``train.log_every`` steps, after the last one and whenever validation ran; its
    memory peaks are those of that step, counted by the tracker in full (the steps in
    between run uncounted: nothing reads their peaks). Warns
    once when the measured peak strays from the planner's prediction. With a
    ``utilization`` every row carries the model FLOPs, achieved FLOP/s and MFU of its step."""

    def __init__(self, cfg: EngineConfig, world_size: int, rank: int, predicted: int | None,
                 utilization: Any = None) -> None:
        self.tcfg, self.rank, self.predicted = cfg.train, rank, predicted
        self.tokens_per_step = cfg.data.micro_batch_size * cfg.model.seq_len * cfg.data.grad_accum * world_size
        self.utilization = utilization
        self.warned = False
        self.mfu_warned = False
        self.peaks: dict[str, dict[str, int]] = {}
        """Peak bytes by phase and category of the last logged step."""
        self.first_step_time: float | None = None
        """This process's first passed step's seconds (warm-up: kept apart)."""
        self.step_times: deque[float] = deque(maxlen=100)
        """The latest passed steps' seconds after the first."""
        self.faults: deque[int] = deque(maxlen=100)
        """The latest passed steps' page faults after the first (``page_faults``)."""

    def median_step_time(self) -> float | None:
        """The median of the latest 100 passed steps' seconds, not counting this
        process's first (warm-up) step unless it is the only one; None before any step."""
        if self.step_times:
            return statistics.median(self.step_times)
        return self.first_step_time

    def median_faults(self) -> int | None:
        """The median page faults of the latest 100 passed steps after this process's
        first; None before any (or where the platform does not count them)."""
        return int(statistics.median(self.faults)) if self.faults else None

    def should_log(self, step: int, last: bool, validated: bool) -> bool:
        """Is the row of ``step`` written (every ``log_every`` steps, the last, a validated one)?
        Known before the step runs: the memory tracker counts only the steps it is true of."""
        return step % self.tcfg.log_every == 0 or last or validated

    def record(self, step: int, out: Any, lr: float, t_data: float, step_time: float, rollbacks: int) -> dict:
        if self.first_step_time is None:
            self.first_step_time = step_time
        else:
            self.step_times.append(step_time)
            if out.metrics.get("page_faults") is not None:
                self.faults.append(out.metrics["page_faults"])
        row = {"step": step, "loss": out.loss, "lr": lr, "step_time_s": step_time,
               "tokens_per_s": self.tokens_per_step / step_time, "peak_bytes": out.metrics["peak_bytes"],
               "grad_norm": out.grad_norm, "skipped": out.skipped, "loss_scale": out.loss_scale,
               "time_data_s": t_data, "rollbacks": rollbacks}
        if self.utilization is not None:
            row.update(self.utilization.row(step_time))
            warning = row.pop("mfu_over_peak", None)
            if warning and not self.mfu_warned:  # once: every later step would say the same
                self.mfu_warned = True
                row["mfu_warning"] = warning
                print(f"mct: warning (rank {self.rank}): {warning}", file=sys.stderr)
        return row

    def complete(self, record: dict[str, Any], out: Any, errors: dict[str, int]) -> None:
        """Add the engine's per-step metrics, the peaks and the error counters."""
        m = dict(out.metrics)
        self.peaks = m.pop("peaks")
        m.pop("live")
        record.update(m)
        record.update(flatten_peaks(self.peaks))
        record["memory"] = self.peaks
        if self.predicted is not None:
            record["predicted_peak_bytes"] = self.predicted
            warning = peak_check(out.metrics["peak_bytes"], self.predicted)
            if warning and record["step"] > 0 and not self.warned:  # step 0 has no optimizer state yet
                self.warned = True
                record["peak_warning"] = warning
                print(f"mct: warning (rank {self.rank}): {warning}", file=sys.stderr)
        record["errors"] = {**errors, "nonfinite_loss": int(not math.isfinite(out.loss))}


class Progress:
    """The tqdm bar on rank 0 (nothing elsewhere, or with ``enabled`` False)."""

    def __init__(self, enabled: bool, total: int, initial: int) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm  # only a rank that draws a bar loads it
            self.bar = tqdm(total=total, initial=min(initial, total), desc="train", unit="step", dynamic_ncols=True)

    def advance(self, loss: float, val: float | None) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix({"loss": f"{loss:.3f}", **({"val": f"{val:.3f}"} if val is not None else {})})

    def jump(self, step: int) -> None:
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def worst_verdict(code: int, signum: int, comm: Any, device: torch.device) -> tuple[int, int]:
    """The largest verdict code and stop signal of any rank (one MAX all-reduce per
    step, cheaper than ``mct.dist.agree``'s object gather): all ranks act alike."""
    flags = torch.tensor([code, signum], dtype=torch.float64, device=device)
    comm.all_reduce_(flags, "max")
    return int(flags[0]), int(flags[1])
