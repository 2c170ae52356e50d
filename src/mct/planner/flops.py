"""FLOPs of one training step, counted on fake tensors (``torch.utils.flop_counter``).

The model is built as a dry run builds it (``dry_run.fake_built_model``, else on meta
and made fake), one micro-batch of the task runs forward and backward under the run's
autocast, and ``FlopCounterMode`` adds up the matmul, convolution and attention FLOPs
(elementwise ops, norms and the optimizer count nothing, as in the MFU convention).
Nothing is computed: a count takes well under a second on small models.

- **model FLOPs**: the model's forward and backward with no recompute and the
  unchunked loss: what MFU divides by (PaLM's convention; a run that recomputes gets
  no credit for it).
- **hardware FLOPs**: the same pass with the run's activation checkpointing applied by
  ``mct.checkpointing.apply_checkpointing`` (the engine's own code) and the run's loss
  (chunked cross-entropy recomputes its logits in backward): what the machine executes.

Both are per step: one micro-batch's count x ``data.grad_accum`` x ranks. Where the
model cannot run on fake tensors the count falls back to ``6 x parameters x tokens``
(no attention term) and says so in ``method``; where the model cannot even be built on
the meta device, nothing is counted (``model`` 0, no MFU).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from mct.checkpointing import apply_checkpointing
from mct.config import EngineConfig
from mct.planner.dry_run import fake_batch, fake_built_model, materialize_fake, meta_model
from mct.planner.work import EXTRA_FORMULAS
from mct.precision import PrecisionPolicy
from mct.task.spec import LossFn, Task


COUNTED = "flop_counter"
ESTIMATED = "6NT"
UNKNOWN = "none"


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one optimizer step of the whole run (every micro-batch, every rank).

    ``model``: no recompute (the MFU numerator; 0 when nothing could be counted);
    ``hardware``: with the run's recompute and loss (None when not counted);
    ``micro_batches``: the micro-batches a step runs over all ranks; ``method``:
    'flop_counter' (counted on fake tensors), '6NT' (6 x parameters x tokens, attention
    not included) or 'none' (not even the parameters could be counted); ``note``: why a
    fallback was taken;
    ``seconds``: what counting cost."""

    model: int
    hardware: int | None
    micro_batches: int
    method: str
    note: str = ""
    seconds: float = 0.0

    def describe(self) -> str:
        """One line saying how ``model`` was found."""
        if self.method == COUNTED:
            return "counted with torch FlopCounterMode on fake tensors, no recompute"
        if self.method == ESTIMATED:
            return f"estimated as 6 x parameters x tokens, attention not counted ({self.note})"
        return f"not counted ({self.note})"


def step_flops(task: Task, cfg: EngineConfig, world_size: int) -> StepFlops:
    """The FLOPs of one step of ``task`` under ``cfg`` on ``world_size`` ranks (see the
    module docstring). Never raises for a model that cannot run on fake tensors: it
    falls back to the 6NT estimate, or to nothing (``method``), with the reason in ``note``."""
    started = time.perf_counter()
    micro = _first_micro_batch(task.batch)
    n_micro = cfg.data.grad_accum * world_size
    unchunked = task.loss_for_chunk(0) if task.loss_for_chunk is not None else task.loss_fn
    try:
        model = count_flops(task, micro, unchunked, cfg, recompute=False)
        if cfg.checkpointing.policy == "auto":
            hardware = None  # the planner has not chosen yet: what recomputes is unknown
        elif cfg.checkpointing.policy != "none" or unchunked is not task.loss_fn:
            hardware = count_flops(task, micro, task.loss_fn, cfg, recompute=True)
        else:
            hardware = model
        return StepFlops(model * n_micro, None if hardware is None else hardware * n_micro, n_micro, COUNTED,
                         seconds=time.perf_counter() - started)
    except Exception as e:  # noqa: BLE001 - any model code may fail on fake tensors; the estimate remains
        why = f"the FLOP count failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    try:
        params = sum(p.numel() for p in {id(p): p for p in meta_model(task.model_fn).parameters()}.values())
    except Exception as e:  # noqa: BLE001 - a factory that cannot build on meta: nothing to count
        why += f"; the model cannot be built on the meta device either ({type(e).__name__})"
        return StepFlops(0, None, n_micro, UNKNOWN, note=why, seconds=time.perf_counter() - started)
    return StepFlops(6 * params * _tokens(micro) * n_micro, None, n_micro, ESTIMATED, note=why,
                     seconds=time.perf_counter() - started)


def count_flops(task: Task, micro_batch: Any, loss_fn: LossFn, cfg: EngineConfig, *, recompute: bool) -> int:
    """FLOPs of ``loss_fn(model, micro_batch)`` forward and backward, the model built by
    ``task.model_fn`` on fake tensors, under ``cfg``'s autocast; with ``recompute`` the
    blocks ``cfg.checkpointing`` chooses are recomputed in backward. Raises whatever the
    model raises on fake tensors."""
    policy = PrecisionPolicy.from_config(cfg.precision)
    mode = FakeTensorMode()
    with mode:
        model = fake_built_model(task.model_fn)
        if model is None:
            model = materialize_fake(meta_model(task.model_fn))
        model.train()
        if recompute:
            # verify replays compare values (fake tensors hold none); offload moves bytes, not FLOPs
            apply_checkpointing(model, dataclasses.replace(cfg.checkpointing, verify=False, offload="none"))
        batch = fake_batch(micro_batch, mode)
        with FlopCounterMode(display=False, custom_mapping=EXTRA_FORMULAS) as counter:
            with policy.autocast("cpu"):
                loss = loss_fn(model, batch)
            loss.backward()
    return int(counter.get_total_flops())


def _first_micro_batch(batch: Any) -> Any:
    """A Task's example batch is one micro-batch or a list of them (all alike)."""
    return batch[0] if isinstance(batch, list) and batch else batch


def _tokens(micro_batch: Any) -> int:
    """Tokens of a micro-batch: the elements of its first tensor (``input_ids``)."""
    if isinstance(micro_batch, torch.Tensor):
        return micro_batch.numel()
    if isinstance(micro_batch, dict):
        micro_batch = list(micro_batch.values())
    for t in micro_batch if isinstance(micro_batch, (list, tuple)) else ():
        if isinstance(t, torch.Tensor):
            return t.numel()
    return 0

