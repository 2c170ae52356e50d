"""Configuration: keyword-only dataclasses, one per TOML section.

Every user mistake raises ``ValueError`` naming the key, the value and what is
allowed. ``EngineConfig.from_dict`` accepts the same nested dict shape as the TOML
file; ``apply_overrides`` applies ``section.key=value`` strings typed by the field.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any


class Name(str, Enum):
    """A name of a fixed set (phases, verdicts, rollback actions). Equal to, hashed,
    printed, formatted and JSON-encoded as its string value, so it goes wherever that
    string went (metric keys, event records) unchanged."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int, key: str = "memory.budget") -> int:
    """'24GiB' / '512MB' / 1024 -> bytes. Raises ValueError naming ``key``."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise ValueError(f"{key} must be positive, got {text!r}")
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"{key} must be a positive size like '2GiB', '512MiB' or '1.5GB', got {text!r}")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 1:  # '0.5B' rounds to nothing: not a budget anyone means
        raise ValueError(f"{key} = {text!r} is less than one byte; pass a size like '2GiB'")
    return n


def check_int(key: str, value: Any, lo: int, hi: int | None = None) -> None:
    """Raise ValueError unless ``value`` is an integer (not a bool; numpy integers
    pass) in ``[lo, hi)`` (``hi`` None: no upper bound), naming ``key`` and the value.
    The one integer validator of the project (config, data sampler, loss scaler)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo or (
            hi is not None and value >= hi):
        bound = f"in [{lo}, {hi})" if hi is not None else f">= {lo}"
        raise ValueError(f"{key} = {value!r} is not allowed: must be an integer {bound}")


def _fail(key: str, value: Any, allowed: str) -> None:
    raise ValueError(f"{key} = {value!r} is not allowed: {allowed}")


def _check_range(key: str, value: float, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False) -> None:
    if isinstance(value, float) and not math.isfinite(value):  # nan passes every comparison
        _fail(key, value, "must be a finite number")
    if lo is not None and (value < lo or (lo_open and value == lo)):
        _fail(key, value, f"must be {'>' if lo_open else '>='} {lo}")
    if hi is not None and value > hi:
        _fail(key, value, f"must be <= {hi}")


LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")
"""The values of ``train.lr_schedule`` (``mct.run.schedule.lr_at`` computes each)."""


@dataclass(kw_only=True)
class ModelConfig:
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide d_model."""
    d_model: int = 128
    """Width of the residual stream."""
    seq_len: int = 128
    """Context length in tokens (bytes)."""
    vocab_size: int = 256
    """Vocabulary size; 256 for the byte tokenizer."""
    dropout: float = 0.0
    """Dropout probability on attention, MLP and embeddings, in [0, 1)."""
    attention: str = "auto"
    """'sdpa' (fused scaled_dot_product_attention), 'explicit' (matmuls around an fp32
    softmax) or 'auto': explicit for bf16/fp16 on CPUs with native low-precision matrix
    units, SDPA elsewhere (docs/precision.md has the measurements)."""
    source: str = "gpt"
    """What is trained: 'gpt' (the built-in GPT of the keys above), 'hf:DIR' (a local
    Hugging Face model directory; nothing is downloaded, no code from it runs) or
    'pkg.module:factory' (a function returning an nn.Module). Only seq_len applies to
    every source; the other keys of [model] are the built-in GPT's."""

    def __post_init__(self) -> None:
        self._check_source()
        for k in ("n_layer", "n_head", "d_model", "seq_len", "vocab_size"):
            _check_range(f"model.{k}", getattr(self, k), 1)
        if self.d_model % self.n_head:
            _fail("model.d_model", self.d_model, f"must be divisible by model.n_head = {self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            _fail("model.dropout", self.dropout, "must be in [0, 1)")
        if self.attention not in ("auto", "sdpa", "explicit"):
            _fail("model.attention", self.attention, "choose 'auto', 'sdpa' or 'explicit'")

    def _check_source(self) -> None:
        """The source's syntax, and no GPT-only key changed with another source (it would
        be silently ignored)."""
        src = self.source
        if src == "gpt":
            return
        if src.startswith("hf:"):
            if not src[3:].strip():
                _fail("model.source", src, "name a local directory after 'hf:', e.g. hf:./my-llama")
        elif not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", src):
            _fail("model.source", src, "choose 'gpt', 'hf:DIR' or 'package.module:factory'")
        defaults = ModelConfig()
        changed = [k for k in GPT_ONLY_KEYS if getattr(self, k) != getattr(defaults, k)]
        if changed:
            _fail(f"model.{changed[0]}", getattr(self, changed[0]),
                  f"only the built-in GPT reads it, and model.source = {src!r} brings its own architecture; "
                  f"remove model.{changed[0]} (model.seq_len is the one [model] key every source uses)")


GPT_ONLY_KEYS = ("n_layer", "n_head", "d_model", "vocab_size", "dropout", "attention")
"""[model] keys that configure the built-in GPT and mean nothing to another model.source."""


@dataclass(kw_only=True)
class DataConfig:
    path: str = ""
    """Text file, directory of text files, uint16 .bin of tokens, or a dataset directory made by
    `mct prepare` (docs/data.md); '' = the Python stdlib sources."""
    micro_batch_size: int = 16
    """Sequences per rank per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (gradient accumulation)."""
    val_fraction: float = 0.1
    """Fraction of files held out for validation (split by file, never by window)."""
    packing: str = "stream"
    """How windows are cut from the documents (docs/data.md, "packing"): 'stream' (windows at any
    offset of the concatenated tokens, attention across document boundaries; the default, so every
    run recorded before this key resumes with the windows it trained on) or 'documents' (windows
    of whole documents packed back to back, each token attending only within its document,
    position ids restarting at each document, no target crossing a boundary)."""

    def __post_init__(self) -> None:
        _check_range("data.micro_batch_size", self.micro_batch_size, 1)
        _check_range("data.grad_accum", self.grad_accum, 1)
        if not 0.0 < self.val_fraction < 1.0:
            _fail("data.val_fraction", self.val_fraction, "must be in (0, 1)")
        if self.packing not in ("stream", "documents"):
            _fail("data.packing", self.packing, "must be 'stream' or 'documents'")


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 300
    """Optimizer steps to run."""
    lr: float = 3e-3
    """Peak learning rate (by default linear warmup, then cosine decay to lr/10)."""
    warmup_steps: int = 30
    """Linear warmup steps (every schedule but 'constant')."""
    lr_schedule: str = "cosine"
    """After the warmup: 'cosine' (to lr * min_lr_ratio over train.steps), 'linear' (likewise),
    'constant' (lr at every step, no warmup) or 'wsd' (warmup, stable at lr, then linear decay to
    lr * min_lr_ratio over the last train.decay_fraction of the steps after the warmup)."""
    min_lr_ratio: float = 0.1
    """The schedule's final learning rate as a fraction of train.lr, in [0, 1]."""
    decay_fraction: float = 0.2
    """'wsd': the fraction of the steps after the warmup spent decaying, in [0, 1] (0: no decay)."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to matrices only (not to norms, biases, embeddings' norms)."""
    grad_clip: float = 0.0
    """Global L2 gradient-norm clip; 0 disables clipping. The Python API does not clip
    unless told (as DeepSpeed and FSDP); ``mct train``'s recipe sets 1.0 (``CLI_RECIPE``)."""
    eval_every: int = 50
    """Validation every N steps (and at the last step); 0 disables."""
    eval_batches: int = 8
    """Validation micro-batches per evaluation."""
    log_every: int = 10
    """Write a metrics line every N steps."""
    checkpoint_every: int = 0
    """Save a checkpoint to RUN_DIR/checkpoints every N steps (and always after the last step); 0: only the last."""
    keep_checkpoints: int = 2
    """Keep the newest N complete checkpoints (>= 1; the newest complete one is never deleted)."""
    tensorboard: bool = False
    """Also write TensorBoard event files into the run directory."""
    max_rollbacks: int = 3
    """Divergence rollbacks allowed in a run (replay, then skip the window, then cut the LR); one more
    divergence stops training with exit code 3."""
    snapshot_every: int = 10
    """Keep an in-memory (CPU) copy of the newest good state every N steps, the rollback target; 0 = roll
    back to the newest checkpoint on disk only."""
    loss_spike_factor: float = 2.0
    """Divergence: a loss above this factor x the median of the last loss_spike_window good steps; 0 disables."""
    loss_spike_window: int = 20
    """Good steps in the running median of the loss and the gradient norm (active from 5 steps on)."""
    grad_norm_factor: float = 20.0
    """Divergence: a gradient norm above this factor x the median of recent good steps; 0 disables."""
    max_consecutive_skips: int = 20
    """Divergence: this many skipped (non-finite gradient) steps in a row."""
    lr_cut_factor: float = 0.5
    """The third rollback of the same window multiplies the learning rate by this factor (in (0, 1])."""
    preempt_timeout_s: float = 30.0
    """On SIGTERM/SIGINT: seconds allowed to write the checkpoint of the last completed step before exiting."""
    init_from: str = ""
    """Pretrained weights the run starts from: a Hugging Face model directory, a .safetensors file, or an
    mct run dir or checkpoint; each rank reads only its shards' slices. '' = the model's own initialization."""
    loss_chunk_tokens: int = 0
    """Chunked linear cross-entropy: the output head, log-softmax and loss run over this many tokens at a
    time, so the [tokens, vocab] logits never exist (backward recomputes one chunk at a time); 0 = off.
    Used by the default loss of every model source (docs/planner.md, "Loss chunking")."""

    def __post_init__(self) -> None:
        _check_range("train.steps", self.steps, 1)
        _check_range("train.lr", self.lr, 0.0, lo_open=True)
        _check_range("train.warmup_steps", self.warmup_steps, 0)
        if self.lr_schedule not in LR_SCHEDULES:
            _fail("train.lr_schedule", self.lr_schedule, f"must be one of {', '.join(LR_SCHEDULES)}")
        _check_range("train.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        _check_range("train.decay_fraction", self.decay_fraction, 0.0, 1.0)
        _check_range("train.weight_decay", self.weight_decay, 0.0)
        _check_range("train.grad_clip", self.grad_clip, 0.0)
        for k in ("eval_every", "eval_batches", "checkpoint_every"):
            _check_range(f"train.{k}", getattr(self, k), 0)
        _check_range("train.log_every", self.log_every, 1)
        _check_range("train.keep_checkpoints", self.keep_checkpoints, 1)
        for k in ("max_rollbacks", "snapshot_every", "loss_spike_factor", "grad_norm_factor"):
            _check_range(f"train.{k}", getattr(self, k), 0)
        _check_range("train.loss_spike_window", self.loss_spike_window, 1)
        _check_range("train.loss_chunk_tokens", self.loss_chunk_tokens, 0)
        _check_range("train.max_consecutive_skips", self.max_consecutive_skips, 1)
        _check_range("train.lr_cut_factor", self.lr_cut_factor, 0.0, 1.0, lo_open=True)
        _check_range("train.preempt_timeout_s", self.preempt_timeout_s, 0.0, lo_open=True)
        if 0 < self.loss_spike_factor <= 1 or 0 < self.grad_norm_factor <= 1:
            _fail("train.loss_spike_factor/grad_norm_factor", (self.loss_spike_factor, self.grad_norm_factor),
                  "must be > 1 (a factor above the running median), or 0 to disable")
        if self.eval_every and not self.eval_batches:
            _fail("train.eval_batches", self.eval_batches,
                  f"must be >= 1 while train.eval_every = {self.eval_every}; set train.eval_every = 0 to skip evaluation")


@dataclass(kw_only=True)
class PrecisionConfig:
    mode: str = "fp32"
    """'fp32', 'bf16' or 'fp16': dtype of working parameters and compute."""
    reduce_dtype: str = "fp32"
    """Dtype in which gradients are reduced across ranks: 'fp32' or 'param' (the working dtype)."""
    initial_scale_power: int = 16
    """fp16: initial loss scale is 2**initial_scale_power."""
    growth_interval: int = 1000
    """fp16: double the scale after this many consecutive clean steps."""
    hysteresis: int = 2
    """fp16: overflows tolerated before the scale is halved (refilled on growth)."""
    min_scale: float = 1.0
    """fp16: the scale never goes below this; an overflow here with hysteresis used up stops training."""
    cpu_matmul: str = "auto"
    """bf16/fp16 matrix multiplies on a CPU: 'native' (torch's low-precision kernels), 'fp32'
    (fp32 kernels, result rounded back: same values up to summation order), or 'auto' = 'fp32'
    on CPUs without native bf16/fp16 units (AVX512-BF16/AMX), where 'native' is 25-40x slower."""

    def __post_init__(self) -> None:
        if self.mode not in ("fp32", "bf16", "fp16"):
            _fail("precision.mode", self.mode, "choose 'fp32', 'bf16' or 'fp16'")
        if self.reduce_dtype not in ("fp32", "param"):
            _fail("precision.reduce_dtype", self.reduce_dtype, "choose 'fp32' or 'param'")
        if self.cpu_matmul not in ("auto", "native", "fp32"):
            _fail("precision.cpu_matmul", self.cpu_matmul, "choose 'auto', 'native' or 'fp32'")
        _check_range("precision.initial_scale_power", self.initial_scale_power, 0, 64)
        _check_range("precision.growth_interval", self.growth_interval, 1)
        _check_range("precision.hysteresis", self.hysteresis, 1)
        _check_range("precision.min_scale", self.min_scale, 0.0, lo_open=True)
        if self.min_scale > 2.0**self.initial_scale_power:
            _fail("precision.min_scale", self.min_scale,
                  f"must be <= the initial loss scale 2**precision.initial_scale_power = "
                  f"{2.0**self.initial_scale_power:g}: lower min_scale or raise initial_scale_power")


POLICIES = ("none", "all", "every_k", "sqrt", "selective", "auto", "per_block")
BLOCK_POLICIES = ("all", "selective", "none")
"""What one block may do under ``checkpointing.per_block``, in the order counts fill the stack:
the first blocks recompute fully, the next selectively, the rest keep everything."""


@dataclass(kw_only=True)
class CheckpointingConfig:
    policy: str = "none"
    """Which blocks recompute in backward: none, all, every_k, sqrt, selective, auto, or per_block
    (each block as checkpointing.per_block says; implied when only per_block is given)."""
    k: int = 2
    """every_k: checkpoint every k-th block (1 = all)."""
    blocks: list[str] = field(default_factory=list)
    """Module class names that are blocks; [] = children of the longest nn.ModuleList."""
    verify: bool = False
    """First step: compare every recomputed block output with the forward one, by value."""
    offload: str = "none"
    """Where each checkpoint region's input waits for backward: 'none' (on the compute device),
    'cpu' (pinned host memory; CUDA only) or 'disk' (files under offload.dir). Same numerics."""
    per_block: dict[str, int] | list[str] = field(default_factory=list)
    """Each block's own choice (policy 'per_block'): a list of 'all' / 'selective' / 'none', one per
    block in model order, or counts {all = A, selective = S} (optionally none = N, then A + S + N must
    be the block count): the first A blocks recompute fully, the next S selectively, the rest none.
    [] = every block as checkpointing.policy says."""
    mlp_tile_tokens: int = 0
    """Run each block's MLP (its submodule named mlp, feed_forward or ffn) over this many tokens at a
    time: forward keeps only the MLP's input, backward recomputes and back-propagates one tile at a
    time; 0 = off. Any policy; same numerics up to the summation order of the MLP's weight gradients.
    The model's standard RMSNorms (transformers' Llama-style) run over the same tiles, keeping their
    input and the fp32 per-token rstd only: forward bit-identical, the weight's gradient summed per tile."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            _fail("checkpointing.policy", self.policy, f"choose one of {', '.join(POLICIES)}")
        _check_range("checkpointing.k", self.k, 1)
        check_int("checkpointing.mlp_tile_tokens", self.mlp_tile_tokens, 0)
        if self.offload not in OFFLOAD_TIERS:
            _fail("checkpointing.offload", self.offload, "choose 'none', 'cpu' or 'disk'")
        self._check_per_block()
        if self.offload != "none" and (self.policy == "none" or not self._recomputes_any()):
            _fail("checkpointing.offload", self.offload,
                  f"moves the inputs of checkpoint regions, and checkpointing.policy = {self.policy!r} "
                  f"{'' if self.policy == 'none' else f'with checkpointing.per_block = {self.per_block!r} '}"
                  "makes none: choose a policy (e.g. 'all' or 'sqrt') or checkpointing.offload = 'none'")

    def _check_per_block(self) -> None:
        """The per_block value on its own, and with policy. Its length against the model's
        block count is checked where the blocks are found (``mct.checkpointing.block_choices``)."""
        spec = self.per_block
        example = ("a list like [\"all\", \"selective\", \"none\"] (one per block) or counts like "
                   "{all = 8, selective = 8}")
        if self.policy == "per_block" and not spec:
            _fail("checkpointing.policy", self.policy, f"needs checkpointing.per_block: {example}")
        if spec and self.policy != "per_block":
            _fail("checkpointing.per_block", spec,
                  f"sets each block's policy, and checkpointing.policy = {self.policy!r} sets them all: keep one "
                  f"(drop checkpointing.policy or set it to 'per_block'; or set checkpointing.per_block = [])")
        if isinstance(spec, dict):
            for name, count in spec.items():
                if name not in BLOCK_POLICIES:
                    _fail("checkpointing.per_block", spec,
                          f"{name!r} is not a block policy: count blocks as all, selective or none")
                check_int(f"checkpointing.per_block.{name}", count, 0)
            return
        for i, choice in enumerate(spec):
            if choice not in BLOCK_POLICIES:
                _fail(f"checkpointing.per_block[{i}]", choice,
                      f"choose all, selective or none for each block ({example})")

    def _recomputes_any(self) -> bool:
        spec = self.per_block
        if not spec:
            return True
        if isinstance(spec, dict):
            return spec.get("all", 0) + spec.get("selective", 0) > 0
        return any(c != "none" for c in spec)


@dataclass(kw_only=True)
class ZeroConfig:
    stage: int | str = 0
    """0 (data parallel), 1 (optimizer state), 2 (+ gradients), 3 (+ parameters) sharded, or 'auto'."""
    bucket_mb: float = 25.0
    """Largest single gradient/parameter collective, in MiB."""
    prefetch: bool = True
    """Stage 3: all-gather the next block's parameters while this one computes."""
    persistent_numel: int = 0
    """Stage 3: units with at most this many elements stay gathered (0 = shard everything)."""
    reshard_root_after_forward: bool = True
    """Stage 3: free the root unit (parameters outside blocks: embedding, final norm, head)
    when the model's forward returns, so the loss runs without it, and gather it again when
    backward reaches the model's outputs. False keeps it gathered from the forward into the
    backward (FSDP2's root): one all-gather fewer per micro-batch, the root's gathered bytes
    held while the loss runs (the planner counts them)."""
    units: list[str] = field(default_factory=list)
    """Module class names whose instances are ZeRO units (gathered, reduced, freed together);
    [] = the same blocks as checkpointing (checkpointing.blocks)."""

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3, "auto") or isinstance(self.stage, bool):
            _fail("zero.stage", self.stage, "choose 0, 1, 2, 3 or 'auto'")
        _check_range("zero.bucket_mb", self.bucket_mb, 0.0, lo_open=True)
        _check_range("zero.persistent_numel", self.persistent_numel, 0)


HOST_MALLOC = ("auto", "default", "lean", "frugal", "cache")
"""``memory.host_malloc``'s modes (``mct.memory.host``)."""
SOLVER_LEVERS = ("micro_batch", "loss_chunk", "offload")
"""What ``memory.solver_allow`` may name: the levers ``auto``'s search changes only when allowed."""


@dataclass(kw_only=True)
class MemoryConfig:
    budget: str = ""
    """Per-rank memory budget, e.g. '2GiB'; '' = none."""
    enforce: bool = False
    """Raise MemoryBudgetExceeded as soon as live bytes pass the budget."""
    track: bool = True
    """Count live tensor bytes by category and stage (CPU: exact; CUDA: torch.cuda stats)."""
    host_malloc: str = "auto"
    """Host allocator (glibc), process-wide: 'lean' maps every block >= 64 KiB on its own
    while the model is built and >= 32 MiB while training, and trims free heap memory after
    construction and each step; 'frugal' keeps 64 KiB throughout (least resident, most
    page faults); 'cache' keeps freed memory for reuse while training (blocks under 1 GiB from
    the heap, never trimmed: no page faults, faster steps, more resident memory);
    'default' leaves glibc as it is; 'auto' = lean with offload on a CPU device unless
    the environment tunes malloc's mmap or trim threshold (MALLOC_MMAP_THRESHOLD_,
    MALLOC_TRIM_THRESHOLD_, GLIBC_TUNABLES; mct.memory.host, docs/stages.md "offload")."""
    huge_pages: bool = True
    """CPU: ask the kernel for 2 MiB pages (``madvise(MADV_HUGEPAGE)``) on mct's own large fresh
    buffers (stage-3 gathered parameters, flat gradients, collective temporaries, the gradient
    norm's) before their first write, so filling them faults once per 2 MiB instead of once per
    4 KiB. Acts only where Linux's transparent huge pages are in 'madvise' mode; bytes and values
    unchanged (mct.memory.host.HugePages). false: leave page sizes to the kernel (a machine
    whose memory is too fragmented for huge pages, where the kernel would compact to find them)."""
    solver_allow: list[str] = field(default_factory=list)
    """What ``auto``'s search may change beyond the stage, the per-block recompute and the
    activation offload (docs/planner.md, "The solver"): 'micro_batch' (data.micro_batch_size x
    data.grad_accum, the product kept; changes the order of the gradient sums), 'loss_chunk'
    (train.loss_chunk_tokens whenever faster; changes the order of the loss's sums), 'offload'
    (state offload whenever faster). Without 'loss_chunk' / 'offload' each is still tried
    when nothing fits without it, as ``auto`` always did."""

    def __post_init__(self) -> None:
        if self.host_malloc not in HOST_MALLOC:
            *rest, last = map(repr, HOST_MALLOC)
            _fail("memory.host_malloc", self.host_malloc, f"choose {', '.join(rest)} or {last}")
        bad = [v for v in self.solver_allow if v not in SOLVER_LEVERS]
        if bad:
            _fail("memory.solver_allow", self.solver_allow,
                  f"{bad[0]!r} is not a lever; choose from {', '.join(SOLVER_LEVERS)} (comma-separated, or [])")
        if self.budget:
            parse_bytes(self.budget)
        if self.enforce and not self.budget:
            _fail("memory.enforce", self.enforce, "needs memory.budget, e.g. budget = '2GiB'")
        if self.enforce and not self.track:
            _fail("memory.track", self.track, "must be true while memory.enforce = true: an untracked "
                  "budget cannot be enforced; set memory.track = true or memory.enforce = false")

    @property
    def budget_bytes(self) -> int | None:
        return parse_bytes(self.budget) if self.budget else None


@dataclass(kw_only=True)
class DistributedConfig:
    backend: str = "auto"
    """'auto' (nccl on CUDA, gloo on CPU), 'gloo' or 'nccl'."""
    timeout_s: float = 300.0
    """Process-group timeout: a collective waiting longer than this fails instead of hanging."""
    shared_memory: bool = True
    """gloo ranks on one host, ZeRO-3: a step's all-gathers copy the other ranks' master
    shards (bf16/fp16 parameters: each rank's cast of its shard, refreshed once a step, 2
    bytes a parameter / world more per rank) out of shared memory (``/dev/shm``) instead of
    sending messages (the same bytes; ``mct.zero.shared``). Tried once at start; where it
    cannot be (other hosts, no room in ``/dev/shm``, optimizer offload), messages, and
    ``mct train`` warns why. false: messages only."""

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "gloo", "nccl"):
            _fail("distributed.backend", self.backend, "choose 'auto', 'gloo' or 'nccl'")
        _check_range("distributed.timeout_s", self.timeout_s, 0.0, hi=MAX_TIMEOUT_S, lo_open=True)


MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""A week: longer timeouts overflow the process group's clock and would never fire in practice."""
MAX_SEED = 2**63 - 1
"""Seeds feed torch.manual_seed and numpy's SeedSequence: non-negative, below 2**63."""


OPTIMIZER_NAMES = ("adamw",)
STATE_DTYPES = ("fp32", "bf16", "int8")


@dataclass(kw_only=True)
class OptimizerConfig:
    """The optimizer of ``mct train`` and of ``mct.Engine``'s default. The learning rate
    and weight decay stay ``train.lr`` / ``train.weight_decay`` (their one home: the LR
    schedule and the recipes' param groups read them there); ``optimizer.lr`` and
    ``optimizer.weight_decay`` are refused with that hint, so the two can never disagree."""

    name: str = "adamw"
    """'adamw' (torch.optim.AdamW for fp32 state; mct.optim.lowbit.LowPrecisionAdamW otherwise)."""
    betas: list[float] = field(default_factory=list)
    """[beta1, beta2]; [] = the recipe's: (0.9, 0.95) for mct train's models, torch's (0.9, 0.999)
    for mct.Engine's default optimizer."""
    eps: float = 0.0
    """Adam's epsilon; 0 = the recipe's (1e-8)."""
    state_dtype: str = "fp32"
    """Adam's two moments: 'fp32' (torch's fused AdamW: 8 bytes/param), 'bf16' (stochastic
    rounding: 4), 'int8' (blockwise, 256 elements per fp32 scale: ~2.03). Master weights and
    the update arithmetic stay fp32."""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZER_NAMES:
            _fail("optimizer.name", self.name, f"choose one of {', '.join(OPTIMIZER_NAMES)}")
        if self.state_dtype not in STATE_DTYPES:
            _fail("optimizer.state_dtype", self.state_dtype, "choose 'fp32', 'bf16' or 'int8'")
        if self.betas and (len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas)):
            _fail("optimizer.betas", self.betas, "must be [beta1, beta2], each in [0, 1) (or [] for the recipe's)")
        _check_range("optimizer.eps", self.eps, 0.0)

    def adam_kwargs(self, betas: tuple[float, float], eps: float) -> dict[str, Any]:
        """betas / eps for AdamW: the configured ones, else the given recipe defaults."""
        return {"betas": tuple(self.betas) if self.betas else betas, "eps": self.eps or eps}


OFFLOAD_TIERS = ("none", "cpu", "disk")


@dataclass(kw_only=True)
class OffloadConfig:
    optimizer: str = "none"
    """Where fp32 master shards and optimizer state live between steps (the step streams them
    through the compute device): 'none' (on it), 'cpu' (host memory; pinned on CUDA) or
    'disk' (files under offload.dir). Stages 2/3 stream gradient shards out as backward
    produces them too."""
    params: str = "none"
    """Stage 3: where the low-precision parameter shards live between gathers: 'none',
    'cpu' or 'disk'. Needs offload.optimizer != 'none' (otherwise the resident fp32 master
    is the gather source)."""
    dir: str = ""
    """Directory for 'disk' offload; each engine makes (and removes) its own folder in it.
    '' = the system temporary directory."""
    chunk_mb: float = 4.0
    """MiB of fp32 per streamed chunk of one unit's shard: the step's unit of I/O and compute."""
    buffers: int = 2
    """Chunks in flight (>= 2): one is stepped while the next ones are read and the last written."""

    def __post_init__(self) -> None:
        for key in ("optimizer", "params"):
            if getattr(self, key) not in OFFLOAD_TIERS:
                _fail(f"offload.{key}", getattr(self, key), "choose 'none', 'cpu' or 'disk'")
        if self.params != "none" and self.optimizer == "none":
            _fail("offload.params", self.params,
                  "needs offload.optimizer = 'cpu' or 'disk' too: without it the fp32 master shard stays "
                  "resident and is the stage-3 gather source, so there is nothing to move")
        _check_range("offload.chunk_mb", self.chunk_mb, 0.0, lo_open=True)
        _check_range("offload.buffers", self.buffers, 2)

    @property
    def enabled(self) -> bool:
        return self.optimizer != "none"


_SECTIONS: dict[str, type] = {
    "model": ModelConfig, "data": DataConfig, "train": TrainConfig,
    "precision": PrecisionConfig, "checkpointing": CheckpointingConfig,
    "zero": ZeroConfig, "memory": MemoryConfig, "distributed": DistributedConfig,
    "offload": OffloadConfig, "optimizer": OptimizerConfig,
}


@dataclass(kw_only=True)
class EngineConfig:
    seed: int = 1337
    """Seeds model init, data order and dropout; recorded in metadata.json."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)

    def __post_init__(self) -> None:
        _check_range("seed", self.seed, 0, MAX_SEED)
        self._check_tensor_sizes()
        if self.offload.params != "none" and self.zero.stage not in (3, "auto"):
            _fail("offload.params", self.offload.params,
                  f"offloads stage-3 parameter shards; zero.stage = {self.zero.stage!r} keeps whole parameters "
                  f"on every rank: set zero.stage = 3 or offload.params = 'none'")

    def check_resolved(self) -> None:
        """ValueError when zero.stage or checkpointing.policy is still 'auto' (an engine needs them chosen)."""
        for key, value in (("zero.stage", self.zero.stage), ("checkpointing.policy", self.checkpointing.policy)):
            if value == "auto":
                raise ValueError(f"{key} = 'auto' must be resolved before the engine is built: `mct train` does it; "
                                 f"from Python call mct.planner.resolve_auto(config, world_size, workload), which "
                                 f"returns the config with the planner's choice (it needs memory.budget)")

    def _check_tensor_sizes(self) -> None:
        """Raise ValueError when the sizes make a tensor of the built-in GPT (logits,
        embedding, MLP weight, attention scores; or all its parameters) too large for
        64-bit byte counts: torch
        would fail deep inside with an overflow, not name the key."""
        m, b = self.model, self.data
        for keys, numel in ((("data.micro_batch_size", "model.seq_len", "model.vocab_size"),
                             b.micro_batch_size * m.seq_len * m.vocab_size),
                            (("model.vocab_size", "model.d_model"), m.vocab_size * m.d_model),
                            (("model.d_model",), 4 * m.d_model * m.d_model),
                            (("model.n_layer", "model.d_model"), 12 * m.n_layer * m.d_model * m.d_model),
                            (("data.micro_batch_size", "model.n_head", "model.seq_len"),
                             b.micro_batch_size * m.n_head * m.seq_len * m.seq_len)):
            if numel >= 2**60:
                values = ", ".join(f"{k} = {getattr(getattr(self, k.split('.')[0]), k.split('.')[1])}" for k in keys)
                raise ValueError(f"{values} need {numel:.3g} elements in one tensor (or all parameters), beyond 64-bit sizes: "
                                 f"use realistic sizes (`mct plan` shows what a configuration needs)")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "EngineConfig":
        """Build from the nested dict shape of the TOML file. Raises ValueError on
        unknown sections or keys, wrong types, and out-of-range values."""
        d = dict(d or {})
        kwargs: dict[str, Any] = {}
        if "seed" in d:
            kwargs["seed"] = _coerce("seed", d.pop("seed"), int)
        for name, sub in d.items():
            if name not in _SECTIONS:
                allowed = ", ".join(["seed", *_SECTIONS])
                raise ValueError(f"unknown config section {name!r}; allowed: {allowed}")
            if not isinstance(sub, dict):
                raise ValueError(f"config section [{name}] must be a table, got {sub!r}; "
                                 f"write it as [{name}] with key = value lines")
            kwargs[name] = _build_section(name, _SECTIONS[name], sub)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _refused(section: str, key: str) -> str:
    """Why ``section.key`` is refused although it reads like a key ('' when it is not)."""
    if section == "optimizer" and key in ("lr", "weight_decay"):
        return (f"optimizer.{key} is not a key: set train.{key} (its one home, read by the LR schedule and "
                f"the param groups)")
    return ""


def _build_section(name: str, klass: type, values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(klass)
    fields = {f.name for f in dataclasses.fields(klass)}
    out = {}
    for key, value in values.items():
        if _refused(name, key):
            raise ValueError(_refused(name, key))
        if key not in fields:
            raise ValueError(f"unknown config key {name}.{key}; allowed in [{name}]: {', '.join(sorted(fields))}")
        out[key] = _coerce(f"{name}.{key}", value, hints[key])
    if name == "checkpointing" and out.get("per_block") and "policy" not in out:
        out["policy"] = "per_block"  # per_block alone says what every block does
    return klass(**out)


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Check ``value`` against the annotation ``typ``; ints are accepted for floats."""
    options = typing.get_args(typ) if isinstance(typ, types.UnionType) else (typ,)
    for t in options:
        origin = typing.get_origin(t)
        if origin is list:
            item = (typing.get_args(t) or (str,))[0]
            if isinstance(value, list) and all(isinstance(v, str) for v in value) and item is str:
                return list(value)
            if isinstance(value, list) and item is float:
                return [_coerce(f"{key}[{i}]", v, float) for i, v in enumerate(value)]
            continue
        if origin is dict:
            if isinstance(value, dict) and all(isinstance(k, str) for k in value):
                return {k: _coerce(f"{key}.{k}", v, typing.get_args(t)[1]) for k, v in value.items()}
            continue
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ValueError(f"{key} = {value!r} is not allowed: must be a finite number")
            return float(value)
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            if not -2**63 <= value < 2**63:  # torch sizes and seeds are 64-bit; beyond is a typo, not a size
                raise ValueError(f"{key} = {value!r} is not allowed: must fit in 64 bits (|value| < 2**63)")
            return value
        if t in (str, bool) and type(value) is t:
            return value
    names = " or ".join(getattr(t, "__name__", str(t)) for t in options)
    raise ValueError(f"{key} = {value!r} has the wrong type: expected {names}")


def _parse_text(key: str, text: str, typ: Any) -> Any:
    """Type a --set string by the field's annotation."""
    options = typing.get_args(typ) if isinstance(typ, types.UnionType) else (typ,)
    for t in options:
        if t is bool:
            if text.lower() in ("true", "1", "yes", "on"):
                return True
            if text.lower() in ("false", "0", "no", "off"):
                return False
        elif typing.get_origin(t) is dict:
            if "=" in text:  # name=value,name=value (TOML's {name = value, ...} too)
                pairs = [s.split("=", 1) for s in text.strip().strip("{}").split(",") if s.strip()]
                if all(len(p) == 2 for p in pairs):
                    return {k.strip(): _parse_text(f"{key}.{k.strip()}", v.strip(), typing.get_args(t)[1])
                            for k, v in pairs}
        elif typing.get_origin(t) is list:
            items = [s.strip() for s in text.strip("[]").split(",") if s.strip()]
            if (typing.get_args(t) or (str,))[0] is float:
                return [_parse_text(f"{key}[{i}]", s, float) for i, s in enumerate(items)]
            return [s.strip() for s in text.split(",") if s.strip()]
        elif t in (int, float):
            try:
                return t(text)
            except (ValueError, OverflowError):
                continue
        elif t is str:
            return text
    names = " or ".join(getattr(t, "__name__", str(t)) for t in options)
    raise ValueError(f"{key} = {text!r} has the wrong type: expected {names}")


def apply_overrides(d: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` strings to a config dict, typing each by its field."""
    d = {k: (dict(v) if isinstance(v, dict) else v) for k, v in d.items()}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set {item!r} must look like section.key=value, e.g. zero.stage=2")
        path, text = item.split("=", 1)
        path = path.strip()
        if path == "seed":
            d["seed"] = _parse_text("seed", text, int)
            continue
        if path.count(".") != 1:
            raise ValueError(f"--set {item!r}: the key must be section.key, e.g. train.steps=100")
        section, key = path.split(".")
        if section not in _SECTIONS:
            raise ValueError(f"--set {item!r}: unknown section {section!r}; allowed: {', '.join(_SECTIONS)}")
        hints = typing.get_type_hints(_SECTIONS[section])
        if _refused(section, key):
            raise ValueError(f"--set {item!r}: {_refused(section, key)}")
        if key not in hints:
            raise ValueError(f"--set {item!r}: unknown key {path}; allowed in [{section}]: {', '.join(sorted(hints))}")
        if not isinstance(d.setdefault(section, {}), dict):
            raise ValueError(f"config section [{section}] must be a table, got {d[section]!r}; "
                             f"write it as [{section}] with key = value lines")
        d[section][key] = _parse_text(path, text.strip(), hints[key])
    return d


CLI_RECIPE: dict[str, dict[str, Any]] = {"train": {"grad_clip": 1.0}}
"""Defaults of the ``mct`` command's training recipe where they differ from the Python
API's: the CLI clips the global gradient norm at 1.0 (nanoGPT's recipe); ``Engine``
built from ``EngineConfig.from_dict`` does not clip unless told (DeepSpeed, FSDP)."""


def _read_config_file(path: str | Path) -> dict[str, Any]:
    """Parse a TOML config file. Raises ValueError (one line) for a missing path, a
    directory, a device or FIFO (which would block or read nothing), an unreadable or
    non-UTF-8 file, and invalid TOML."""
    p = Path(path)
    what = f"--config {str(p)!r}"
    if not p.exists():
        raise ValueError(f"{what}: no such file; pass the path of a TOML file")
    if p.is_dir():
        raise ValueError(f"{what} is a directory; pass a TOML file inside it")
    if not p.is_file():
        raise ValueError(f"{what} is not a regular file (a device, FIFO or socket); pass a TOML file")
    try:
        text = p.read_bytes().decode("utf-8")
    except OSError as e:
        raise ValueError(f"{what} cannot be read ({e.strerror or e}); check its permissions") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} is not UTF-8 text; pass a TOML file") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{what} is not valid TOML: {e}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                defaults: dict[str, dict[str, Any]] | None = None) -> EngineConfig:
    """``defaults`` (e.g. ``CLI_RECIPE``) < TOML file (optional) < ``--set`` overrides ->
    validated EngineConfig. Raises ValueError naming the key, the value and the fix."""
    d: dict[str, Any] = {k: dict(v) for k, v in (defaults or {}).items()}
    if path is not None:
        for name, value in _read_config_file(path).items():
            if isinstance(value, dict) and isinstance(d.get(name), dict):
                d[name] = {**d[name], **value}
            else:
                d[name] = value
    return EngineConfig.from_dict(apply_overrides(d, overrides or []))


def with_values(cfg: EngineConfig, values: dict[str, Any]) -> EngineConfig:
    """``cfg`` with ``{"section.key": value}`` replaced (``dataclasses.replace``: each changed
    section, then the whole config, validated again as at load). Values are typed already
    (not text: ``apply_overrides`` types a user's). Raises ValueError as at load."""
    sections: dict[str, dict[str, Any]] = {}
    for path, value in values.items():
        section, key = path.split(".")
        sections.setdefault(section, {})[key] = value
    return dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **kv)
                                       for name, kv in sections.items()})
