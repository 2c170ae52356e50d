"""A process's peak, predicted: what the kernel (CPU: the resident set's high-water mark,
VmHWM) or ``nvidia-smi`` (CUDA) counts, from a configuration's tensor peak.

    process_peak = runtime_baseline + tensor peak + allocator_overhead

On the CPU, ``runtime_baseline`` is ``mct.memory.baseline``'s (measured by ``mct calibrate``
for the model's library) and the allocator's overhead models glibc malloc under each
``memory.host_malloc`` mode (``mct.memory.host``; docs/memory.md has the measurements). A
process peaks either inside a step or at a checkpoint save, and the prediction is the larger
(``ProcessPeak.at``):

    step:  baseline - writer + tensor peak + STEP_FIXED + RETAINED[mode] x transient
    save:  baseline (+ dynamo where the save is sharded) + state + SAVE_HELD

``writer`` is what the checkpoint writer's import adds to the baseline (the steps of a run
that saves only after its last step run without it; ``ProcessModel.writer``); ``state`` the
tensor bytes live across steps (``state_bytes``), which a save reads on a heap trimmed just
before it (``host.trim_between``). No step imports ``torch._dynamo``: a recomputing run does
it on mct's own checkpoint frame (``mct.checkpointing.frame``), so recomputing or not changes
nothing here beyond the tensor peak. ``transient`` is the tensor bytes a step allocates and frees again
(activations and 'other' temporaries at the phase where they are largest: what the
allocator recycles every step). The parameters, gradients and optimizer state live across
steps and cost the allocator nothing beyond page rounding.
``STEP_FIXED`` is what a training process adds beside its tensors whatever the mode (the FLOP
count's imports, the model's and the autograd graph's Python objects, the worker threads'
stacks and arenas). ``RETAINED[mode]`` is the share of a step's transients still resident,
as freed heap chunks, when the next step peaks: glibc's dynamic mmap threshold rises to the
largest freed block (up to 32 MiB) after the first step, so later temporaries come from the
heap and freed heap memory stays resident ('default'); 'lean' and 'frugal' map blocks of
32 MiB / 64 KiB and up and trim after each step, so less stays ('frugal': only what is under
64 KiB); 'cache' never gives freed heap memory back.

On CUDA (written, not measured here): the CUDA context (``CUDA_CONTEXT``) + the tensor peak
+ what the caching allocator reserves beyond allocated bytes, modelled as its 2 MiB rounding
of every segment (``CUDA_SEGMENT``) plus ``CUDA_RETAINED`` of the transients (blocks split and
cached for reuse): what ``torch.cuda.max_memory_reserved()`` plus the context shows in
``nvidia-smi``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from mct.memory.host import resolve

MiB = 2**20

STEP_FIXED = 24 * MiB
"""CPU: what a training process holds beside its tensors beyond the runtime baseline,
whatever the allocator mode (measured: benchmarks/process_peak.py, docs/memory.md)."""
SAVE_HELD = 32 * MiB
"""CPU: what a process holds at a checkpoint save beyond the baseline (the writer's import
counted there) and the state the save reads: the writer's code paths run, its staging of
each piece, and the heap the steps leave after the trim before the save (measured:
benchmarks/process_peak.py, docs/memory.md; 40 MiB while the process held its corpus)."""
RETAINED = {"default": 0.5, "lean": 0.25, "frugal": 0.25, "cache": 1.0}
"""CPU: the share of a step's transient tensor bytes glibc keeps resident when the next step
peaks, per resolved ``memory.host_malloc`` mode ('frugal' and 'cache': from glibc's rules,
not measured here; docs/memory.md)."""
CUDA_CONTEXT = 500 * MiB
"""CUDA: the context (kernels, cuBLAS/cuDNN handles) as nvidia-smi shows it; not measured here
(typically 300-600 MiB with torch 2.x, larger on newer architectures)."""
CUDA_SEGMENT = 2 * MiB
"""CUDA: the caching allocator's rounding of the small-block pool (one 2 MiB segment)."""
CUDA_RETAINED = 0.1
"""CUDA: the share of a step's transients the caching allocator keeps reserved beyond allocated
bytes (split blocks, cached for reuse); not measured here."""
TRANSIENT = ("activations", "other")
"""The tensor categories a step allocates and frees again (``mct.memory.tracker.CATEGORIES``)."""


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
    save: ``tensor_peak`` is the state it reads, ``allocator_overhead`` ``SAVE_HELD``)."""

    @property
    def total(self) -> int:
        return self.baseline + self.tensor_peak + self.allocator_overhead


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

    def predict(self, tensor_peak: int, phases: Mapping[str, Mapping[str, int]], *, offload: bool,
                sharded_save: bool = False) -> ProcessPeak:
        """The process peak of a configuration with steady-state ``tensor_peak`` and per-phase
        bytes by category (``phases``: phase -> {category: bytes}, the dry run's), its state
        offloaded or not (``offload``: 'auto' resolves to 'lean' then), saving sharded state or
        not (``sharded_save``: ZeRO stage 1 and up on several ranks). The larger of its two
        peaks (``ProcessPeak.at``): inside a step, and at the checkpoint save (``save_peak``).
        Pure arithmetic; never fails."""
        transient = transient_bytes(phases)
        if self.device == "cuda":
            overhead = CUDA_SEGMENT + round(CUDA_RETAINED * transient)
            return ProcessPeak(CUDA_CONTEXT, tensor_peak, overhead,
                               "device memory (CUDA context + reserved; not measured here)")
        mode = resolve(self.host_malloc, offload=offload, device=self.device)
        retained = round(RETAINED.get(mode, RETAINED["default"]) * transient)
        counts = f"resident (VmHWM), host_malloc {mode}"
        step = ProcessPeak(self.baseline - self.writer, tensor_peak, STEP_FIXED + retained, counts)
        save = save_peak(self.baseline + (self.dynamo if sharded_save else 0), state_bytes(phases), counts)
        return save if save.total > step.total else step


def save_peak(baseline: int, state: int, counts: str) -> ProcessPeak:
    """CPU: the peak at a checkpoint save: ``baseline`` (with the checkpoint writer's import,
    and ``torch._dynamo``'s where the save is sharded), the ``state`` the save reads (tensor
    bytes live across steps), and ``SAVE_HELD`` (the writer's code paths run, its staging,
    the heap left after the trim before the save). Pure."""
    return ProcessPeak(baseline, state, SAVE_HELD, counts + ", at the checkpoint save", at="save")


def state_bytes(phases: Mapping[str, Mapping[str, int]]) -> int:
    """The most bytes of the categories live across steps (all but ``TRANSIENT``) at any phase's
    peak: what a checkpoint save reads (0 for no phases)."""
    return max((sum(int(v) for k, v in ph.items() if k not in TRANSIENT and k != "total") for ph in phases.values()),
               default=0)


def transient_bytes(phases: Mapping[str, Mapping[str, int]]) -> int:
    """The most bytes of ``TRANSIENT`` categories live at any phase's peak (0 for no phases)."""
    return max((sum(int(ph.get(k, 0)) for k in TRANSIENT) for ph in phases.values()), default=0)
