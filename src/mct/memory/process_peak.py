"""A process's peak, predicted: what the kernel (CPU: the resident set's high-water mark,
VmHWM) or ``nvidia-smi`` (CUDA) counts, from a configuration's tensor peak.

    process_peak = runtime_baseline + tensor peak + allocator_overhead + rollback snapshots

On the CPU, ``runtime_baseline`` is ``mct.memory.baseline``'s (measured by ``mct calibrate``
for the model's library) and the allocator's overhead models glibc malloc under each
``memory.host_malloc`` mode (``mct.memory.host``; docs/memory.md has the measurements). A
process peaks either inside a step or at a checkpoint save, and the prediction is the larger
(``ProcessPeak.at``):

    step:  baseline - writer + tensor peak + STEP_FIXED + retained + the snapshots in a step
           retained = RETAINED[mode].live x transient + RETAINED[mode].freed x (churn - transient)
    save:  baseline (+ dynamo where the save is sharded) + state + SAVE_HELD (+ MIXED_SAVE in bf16/fp16)
           + the snapshot at a save

``writer`` is what the checkpoint writer's import adds to the baseline (the steps of a run
that saves only after its last step run without it; ``ProcessModel.writer``); ``state`` the
tensor bytes live across steps (``state_bytes``), which a save reads on a heap trimmed just
before it (``host.trim_between``). No step imports ``torch._dynamo``: a recomputing run does
it on mct's own checkpoint frame (``mct.checkpointing.frame``).

``transient`` is the tensor bytes live at the step's peak that it allocates and frees again
(activations and temporaries: ``transient_bytes``), ``churn`` the bytes of those one forward
allocates, live at the peak or not (the dry run's ``MemoryTracker.churn``). glibc's dynamic
mmap threshold rises to the largest freed block (up to 32 MiB) after the first step, so later
temporaries come from the heap, which keeps holes around what is live at the peak and about
half of what a forward freed before it as free chunks ('default'). A forward makes the same
allocations whether its activations are kept or recomputed (recomputation frees them sooner,
and the backward makes them again): a recomputing row's tensor peak is lower, its heap is not;
autocast's casts count too. 'lean' and 'frugal' map blocks of 32 MiB / 64 KiB and up and trim
after each step, so less stays; 'cache' never gives freed heap memory back, so its save comes
on top of the step's figure (``CACHE_SAVE``) where that is the larger.
``STEP_FIXED`` is what a training process adds beside its tensors whatever the mode (the FLOP
count's imports, the model's and the autograd graph's Python objects, the worker threads'
stacks and arenas).

The rollback snapshots (``train.snapshot_every``, ``mct.run.rollback``) are CPU copies of
each rank's fp32 master and optimizer state held beside the training state at stages 0-2
without offload (``Residency.snapshot_bytes``; stage 3 and offload keep them on disk or in
the store). A run holds the one taken before its first step (no optimizer state yet), then
the trusted one; while a new one waits for the step that trusts it, two
(``snapshots_held``). The tracker does not count them: no tensor category holds them.

On CUDA (written, not measured here): the CUDA context (``CUDA_CONTEXT``) + the tensor peak
+ what the caching allocator reserves beyond allocated bytes, modelled as its 2 MiB rounding
of every segment (``CUDA_SEGMENT``) plus ``CUDA_RETAINED`` of the transients (blocks split and
cached for reuse): what ``torch.cuda.max_memory_reserved()`` plus the context shows in
``nvidia-smi``. The rollback snapshots live in host memory there: not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

from mct.memory.host import resolve

MiB = 2**20

STEP_FIXED = 20 * MiB
"""CPU: what a training process holds beside its tensors beyond the runtime baseline,
whatever the allocator mode (measured: benchmarks/process_peak.py, docs/memory.md)."""
SAVE_HELD = 24 * MiB
"""CPU: what a process holds at a checkpoint save beyond the baseline (the writer's import
counted there) and the state the save reads: the writer's code paths run, its staging of
each piece, and the heap the steps leave after the trim before the save (measured:
benchmarks/process_peak.py, docs/memory.md; 32 MiB while it held the rollback snapshot
uncounted, 40 while the process held its corpus)."""


class Retained(NamedTuple):
    """The shares of a step's transient bytes glibc keeps resident beyond them when a later
    step peaks: ``live``, of the transients live at the peak (``transient_bytes``: the holes
    around them), and ``freed``, of those a forward makes and frees before the peak (its
    churn beyond them, ``churn_bytes``: free heap the peak does not reuse)."""

    live: float
    freed: float

    def of(self, transient: int, churn: int) -> int:
        """The bytes retained for ``transient`` live bytes and a forward's ``churn``."""
        return round(self.live * transient + self.freed * max(0, churn - transient))


RETAINED = {"default": Retained(0.25, 0.5), "lean": Retained(0.15, 0.4), "frugal": Retained(0.0, 0.1),
            "cache": Retained(0.25, 0.5)}
"""CPU: ``Retained`` per resolved ``memory.host_malloc`` mode, least squares over 4-step and
300-step runs (default: 31 runs of five models, policies none/all/sqrt/selective, fp32 and bf16;
the others: 6-8 runs of two GPTs; docs/memory.md, "The rollback snapshots and a forward's churn")."""
MIXED_SAVE = 11 * MiB
"""CPU: what a process that computes in bf16/fp16 (its fp32 masters apart from its parameters:
the dry run's 'master' bytes) holds more at a save than an fp32 one: oneDNN's cached primitives
for the low-precision kernels (6.6 MiB of it, measured with ``ONEDNN_PRIMITIVE_CACHE_CAPACITY=0``)
and the heap its casts leave (GPT a on 1 and 2 ranks, stages 0 and 3: 33-36 MiB above state and
snapshot at the save, against 18-27 for fp32; docs/memory.md)."""
CACHE_SAVE = 31 * MiB
"""CPU, 'cache': what a save adds on top of the step's peak (that mode never trims, so the save
comes on the heap the steps left: +31 MiB in each of six runs of two GPTs; docs/memory.md)."""
TRANSIENT = ("activations", "other")
"""The tensor categories a step allocates and frees again (``mct.memory.tracker.CATEGORIES``;
the rest live across steps): what ``MemoryTracker.churn`` counts."""
CUDA_CONTEXT = 500 * MiB
"""CUDA: the context (kernels, cuBLAS/cuDNN handles) as nvidia-smi shows it; not measured here
(typically 300-600 MiB with torch 2.x, larger on newer architectures)."""
CUDA_SEGMENT = 2 * MiB
"""CUDA: the caching allocator's rounding of the small-block pool (one 2 MiB segment)."""
CUDA_RETAINED = 0.1
"""CUDA: the share of a step's transients the caching allocator keeps reserved beyond allocated
bytes (split blocks, cached for reuse); not measured here."""


@dataclass(frozen=True)
class ProcessPeak:
    """A process peak and its terms, in bytes: ``baseline`` (runtime baseline, or the CUDA
    context), ``tensor_peak``, ``allocator_overhead``; ``counts`` says what the total counts."""

    baseline: int
    tensor_peak: int
    allocator_overhead: int
    counts: str
    at: str = "step"
    """Where the process peaks: 'step' (``tensor_peak`` is the step's) or 'save' (the checkpoint
    save: ``tensor_peak`` is the state it reads, ``allocator_overhead`` ``SAVE_HELD``, + ``MIXED_SAVE``
    in bf16/fp16)."""
    snapshots: int = 0
    """Host bytes of the rollback snapshots held there (``snapshots_held``)."""

    @property
    def total(self) -> int:
        return self.baseline + self.tensor_peak + self.allocator_overhead + self.snapshots


@dataclass(frozen=True)
class ProcessModel:
    """What turns a tensor peak into a process peak on one device type: ``baseline`` (the
    runtime baseline in bytes; for CUDA the host baseline is not what nvidia-smi counts, the
    context is used instead) and ``host_malloc``, the config's ``memory.host_malloc`` setting
    ('auto' resolved per row by its offload choice)."""

    baseline: int
    device: str = "cpu"
    host_malloc: str = "default"
    dynamo: int = 0
    """CPU: what importing ``torch._dynamo`` adds to ``baseline`` (measured beside it), which a
    process loads only to save sharded state (``DTensor.__init__`` is wrapped in
    ``torch._disable_dynamo``)."""
    writer: int = 0
    """CPU: what the checkpoint writer's import (``torch.distributed.checkpoint``, sympy) adds to
    ``baseline``, which counts it (measured beside it), where the steps run without it: a process
    loads it at its first save, so a run that saves only after its last step steps without it.
    0 where a save comes earlier (``train.checkpoint_every``), and for a transformers model, whose
    import loads what it needs."""
    steps: int = 0
    """The run's ``train.steps``: how many rollback snapshots it comes to hold (``snapshots_held``)."""
    snapshot_every: int = 0
    """The run's ``train.snapshot_every`` (0: no rollback snapshot in memory)."""

    def predict_run(self, run: Any, *, offload: bool, sharded_save: bool = False) -> ProcessPeak:
        """``predict`` of a dry run (``mct.planner.dry_run.DryRun``: its ``peak``, ``phases``,
        ``churn`` and ``snapshot``)."""
        return self.predict(run.peak, run.phases, offload=offload, sharded_save=sharded_save,
                            churn=run.churn, snapshot=run.snapshot)

    def predict(self, tensor_peak: int, phases: Mapping[str, Mapping[str, int]], *, offload: bool,
                sharded_save: bool = False, churn: Mapping[str, int] | None = None,
                snapshot: tuple[int, int] = (0, 0)) -> ProcessPeak:
        """The process peak of a configuration with steady-state ``tensor_peak`` and per-phase
        bytes by category (``phases``: phase -> {category: bytes}, the dry run's), its state
        offloaded or not (``offload``: 'auto' resolves to 'lean' then), saving sharded state or
        not (``sharded_save``: ZeRO stage 1 and up on several ranks), its per-phase ``churn``
        (the dry run's; None: the transients stand for it) and the host bytes of one rollback
        snapshot before the first step and in steady state (``snapshot``, the dry run's). The
        larger of its two peaks (``ProcessPeak.at``): inside a step, and at the checkpoint save
        (``save_peak``). Pure arithmetic; never fails."""
        if self.device == "cuda":
            overhead = CUDA_SEGMENT + round(CUDA_RETAINED * transient_bytes(phases))
            return ProcessPeak(CUDA_CONTEXT, tensor_peak, overhead,
                               "device memory (CUDA context + reserved; not measured here)")
        mode = resolve(self.host_malloc, offload=offload, device=self.device)
        transient = transient_bytes(phases)
        retained = RETAINED.get(mode, RETAINED["default"]).of(transient, churn_bytes(phases, churn))
        counts = f"resident (VmHWM), host_malloc {mode}"
        in_step, at_save = snapshots_held(self.snapshot_every, self.steps, *snapshot)
        step = ProcessPeak(self.baseline - self.writer, tensor_peak, STEP_FIXED + retained, counts,
                           snapshots=in_step)
        save = save_peak(self.baseline + (self.dynamo if sharded_save else 0), state_bytes(phases), counts, at_save,
                         mixed=any(int(ph.get("master", 0)) > 0 for ph in phases.values()))
        if mode == "cache":  # no trim before the save: it comes on top of what the steps left
            save = max(save, ProcessPeak(step.baseline, step.tensor_peak, step.allocator_overhead + CACHE_SAVE,
                                         save.counts, at="save", snapshots=in_step), key=lambda p: p.total)
        return save if save.total > step.total else step


def save_peak(baseline: int, state: int, counts: str, snapshots: int = 0, *, mixed: bool = False) -> ProcessPeak:
    """CPU: the peak at a checkpoint save: ``baseline`` (with the checkpoint writer's import,
    and ``torch._dynamo``'s where the save is sharded), the ``state`` the save reads (tensor
    bytes live across steps), ``SAVE_HELD`` (the writer's code paths run, its staging, the
    heap left after the trim before the save; + ``MIXED_SAVE`` for a process computing in
    bf16/fp16, ``mixed``) and the rollback ``snapshots`` held. Pure."""
    return ProcessPeak(baseline, state, SAVE_HELD + (MIXED_SAVE if mixed else 0), counts + ", at the checkpoint save",
                       at="save", snapshots=snapshots)


def snapshots_held(every: int, steps: int, first: int, steady: int) -> tuple[int, int]:
    """(in a step, at a save): the host bytes of the rollback snapshots a run of ``steps``
    steps holds at its most, taking one every ``every`` steps (``train.snapshot_every``; 0:
    none) of ``first`` bytes before its first step and ``steady`` bytes later (the optimizer
    state exists). Step 0 takes the first; step ``every`` takes a second while the first is
    kept, until that step passes; from step ``2 x every`` two steady ones. A save comes after
    a step passed, when one is kept. Pure."""
    if every <= 0 or steps <= 0:
        return 0, 0
    if steps <= every:
        return first, first
    if steps <= 2 * every:
        return first + steady, steady
    return 2 * steady, steady


def churn_bytes(phases: Mapping[str, Mapping[str, int]], churn: Mapping[str, int] | None) -> int:
    """The bytes one forward makes of ``TRANSIENT`` storages (``churn['forward']``), or, where
    the churn is not known (no dry run's, or CUDA's tracker), the transients at the peak
    (``transient_bytes``): what the heap recycles every step."""
    if churn and "forward" in churn:
        return int(churn["forward"])
    return transient_bytes(phases)


def state_bytes(phases: Mapping[str, Mapping[str, int]]) -> int:
    """The most bytes of the categories live across steps (all but ``TRANSIENT``) at any phase's
    peak: what a checkpoint save reads (0 for no phases)."""
    return max((sum(int(v) for k, v in ph.items() if k not in TRANSIENT and k != "total") for ph in phases.values()),
               default=0)


def transient_bytes(phases: Mapping[str, Mapping[str, int]]) -> int:
    """The most bytes of ``TRANSIENT`` categories live at any phase's peak (0 for no phases)."""
    return max((sum(int(ph.get(k, 0)) for k in TRANSIENT) for ph in phases.values()), default=0)
