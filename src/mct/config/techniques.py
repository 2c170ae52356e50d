"""How it is trained: the [precision], [checkpointing], [zero], [memory], [distributed],
[optimizer], [offload] and [adapter] sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from mct.config.values import ByteSize, OnResume, PrecisionMode, _check_range, _fail, check_int, fixed, may


@dataclass(kw_only=True)
class PrecisionConfig:
    mode: PrecisionMode = PrecisionMode.fp32
    """'fp32', 'bf16' or 'fp16': dtype of working parameters and compute (a ``PrecisionMode``
    once loaded: its dtype and what follows from it)."""
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

    ON_RESUME: ClassVar[dict[str, OnResume]] = dict.fromkeys(
        ("mode", "reduce_dtype", "initial_scale_power", "growth_interval", "hysteresis", "min_scale", "cpu_matmul"),
        fixed("the run's precision is part of its numerics"))

    def __post_init__(self) -> None:
        if self.mode not in tuple(PrecisionMode):
            _fail("precision.mode", self.mode, "choose 'fp32', 'bf16' or 'fp16'")
        self.mode = PrecisionMode(self.mode)
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

    ON_RESUME: ClassVar[dict[str, OnResume]] = dict.fromkeys(
        ("policy", "k", "blocks", "verify", "offload", "per_block", "mlp_tile_tokens"),
        may("the blocks recompute (and their inputs wait) as the new value says: the same values"))

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

    ON_RESUME: ClassVar[dict[str, OnResume]] = dict.fromkeys(
        ("stage", "bucket_mb", "prefetch", "persistent_numel", "reshard_root_after_forward", "units"),
        may("the checkpoint is resharded to the new layout: the same values up to fp32 reduction order"))

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3, "auto") or isinstance(self.stage, bool):
            _fail("zero.stage", self.stage, "choose 0, 1, 2, 3 or 'auto'")
        _check_range("zero.bucket_mb", self.bucket_mb, 0.0, lo_open=True)
        _check_range("zero.persistent_numel", self.persistent_numel, 0)


BUDGET_COUNTS = ("process", "tensors")
"""What ``memory.budget`` is compared with (``MemoryConfig.budget_counts``)."""
HOST_MALLOC = ("auto", "default", "lean", "frugal", "cache")
"""``memory.host_malloc``'s modes (``mct.memory.host``)."""
SOLVER_LEVERS = ("micro_batch", "loss_chunk", "offload", "context")
"""What ``memory.solver_allow`` may name: the levers ``auto``'s search changes only when allowed."""


@dataclass(kw_only=True)
class MemoryConfig:
    budget: ByteSize | None = None
    """Per-rank memory budget, written as a size ('2GiB', '512MB') or a byte count; bytes
    (an int) once loaded: converted here, once; '' or absent = none. What it counts:
    ``budget_counts``."""
    budget_counts: str = "process"
    """What ``budget`` is compared with: 'process' (default: each process's peak as the kernel
    counts it, the resident set on CPU, the CUDA context + the caching allocator's reserved bytes
    on CUDA; the plan's ``process_peak``) or 'tensors' (live tensor bytes only, the plan's
    ``peak``: the meaning ``memory.budget`` had before)."""
    enforce: bool = False
    """Raise MemoryBudgetExceeded as soon as live tensor bytes pass the budget, and, when the
    budget counts the process, as soon as the resident set (CUDA: reserved bytes + context) does."""
    track: bool = True
    """Count live tensor bytes by category and stage (CPU: exact; CUDA: torch.cuda stats)."""
    host_malloc: str = "auto"
    """Host allocator (glibc), process-wide: 'lean' maps every block >= 64 KiB on its own
    while the model is built and >= 32 MiB while training, and trims free heap memory after
    construction and each step; 'frugal' keeps 64 KiB throughout (least resident, most
    page faults); 'cache' keeps freed memory for reuse while training (blocks under 1 GiB from
    the heap, never trimmed: no page faults, faster steps, more resident memory);
    'default' leaves glibc as it is; every mode but 'cache' also trims after each validation
    and before each checkpoint save and the export; 'auto' = lean with offload on a CPU device unless
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
    (state offload whenever faster), 'context' (parallel.context: any degree that divides the
    world size with model.seq_len a multiple of 2 x it, the global batch kept by scaling
    data.grad_accum; changes the order of the attention's and the gradients' sums). Without
    'loss_chunk' / 'offload' each is still tried when nothing fits without it, as ``auto``
    always did."""

    ON_RESUME: ClassVar[dict[str, OnResume]] = dict.fromkeys(
        ("budget", "budget_counts", "enforce", "track", "host_malloc", "huge_pages", "solver_allow"),
        may("memory is budgeted, counted and allocated as the new value says from the resumed step on"))

    def __post_init__(self) -> None:
        if self.host_malloc not in HOST_MALLOC:
            *rest, last = map(repr, HOST_MALLOC)
            _fail("memory.host_malloc", self.host_malloc, f"choose {', '.join(rest)} or {last}")
        if self.budget_counts not in BUDGET_COUNTS:
            _fail("memory.budget_counts", self.budget_counts,
                  "choose 'process' (the process's resident peak) or 'tensors' (live tensor bytes)")
        bad = [v for v in self.solver_allow if v not in SOLVER_LEVERS]
        if bad:
            _fail("memory.solver_allow", self.solver_allow,
                  f"{bad[0]!r} is not a lever; choose from {', '.join(SOLVER_LEVERS)} (comma-separated, or [])")
        self.budget = ByteSize.of(self.budget) if self.budget not in (None, "") else None  # the one parse
        if self.enforce and not self.budget:
            _fail("memory.enforce", self.enforce, "needs memory.budget, e.g. budget = '2GiB'")
        if self.enforce and not self.track:
            _fail("memory.track", self.track, "must be true while memory.enforce = true: an untracked "
                  "budget cannot be enforced; set memory.track = true or memory.enforce = false")

    @property
    def budget_bytes(self) -> int | None:
        """``budget`` (bytes already): the name older callers read."""
        return self.budget

    @property
    def counts_process(self) -> bool:
        """Does ``budget`` count the process (not only its tensors)?"""
        return self.budget_counts == "process"


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
    sending messages (the same bytes; ``mct.zero.shm``). Tried once at start; where it
    cannot be (other hosts, no room in ``/dev/shm``, optimizer offload), messages, and
    ``mct train`` warns why. false: messages only."""

    ON_RESUME: ClassVar[dict[str, OnResume]] = dict.fromkeys(
        ("backend", "timeout_s", "shared_memory"), may("the new process group uses the new value"))

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

    ON_RESUME: ClassVar[dict[str, OnResume]] = {
        **dict.fromkeys(("name", "betas", "eps"), fixed("the optimizer's hyperparameters belong to the run")),
        "state_dtype": fixed("the checkpoint holds Adam's moments in the run's state dtype (no conversion)",
                             "resume with optimizer.state_dtype={old} (the run's), or start a new run from these "
                             "weights, its moments starting over: mct train --init-from RUN_DIR --set "
                             "optimizer.state_dtype={new}"),
    }

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

    ON_RESUME: ClassVar[dict[str, OnResume]] = dict.fromkeys(
        ("optimizer", "params", "dir", "chunk_mb", "buffers"),
        may("the state is loaded into the new tier: the same values (offload on or off)"))

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


ADAPTER_KINDS = ("none", "lora", "qlora")
BASE_DTYPES = ("auto", "nf4")
"""``adapter.base_dtype``: 'auto' (lora: the working dtype of ``precision.mode``; qlora: nf4) or 'nf4'."""


@dataclass(kw_only=True)
class AdapterConfig:
    """Low-rank adapters on a frozen base (``mct.adapters``, docs/adapters.md): each targeted
    linear layer keeps its weight frozen and adds ``lora_B(lora_A(dropout(x))) * alpha / rank``."""

    kind: str = "none"
    """'none' (train every parameter), 'lora' (train adapters only) or 'qlora' (lora on a 4-bit base)."""
    rank: int = 8
    """Rank r of each adapter: lora_A is [r, in], lora_B is [out, r]."""
    alpha: float = 16.0
    """Scale: an adapter's output is multiplied by alpha / rank."""
    dropout: float = 0.0
    """Dropout on an adapter's input (the base layer sees its input unchanged), in [0, 1)."""
    targets: list[str] = field(default_factory=list)
    """fnmatch patterns on module names ('*.attn.qkv', '*q_proj'); [] = every linear layer inside
    the transformer blocks (attention and MLP projections; never the embedding or the output head)."""
    base_dtype: str = "auto"
    """Storage of the frozen base: 'auto' (lora: the working dtype; qlora: 'nf4') or 'nf4'."""

    ON_RESUME: ClassVar[dict[str, OnResume]] = {
        **dict.fromkeys(("kind", "rank", "targets", "base_dtype"),
                        fixed("the checkpoint holds the run's adapters (their names and shapes) on its base")),
        **dict.fromkeys(("alpha", "dropout"), fixed("the adapters' scale and dropout are part of the run's numerics")),
    }

    def __post_init__(self) -> None:
        if self.kind not in ADAPTER_KINDS:
            _fail("adapter.kind", self.kind, "choose 'none', 'lora' or 'qlora'")
        check_int("adapter.rank", self.rank, 1)
        _check_range("adapter.alpha", self.alpha, 0.0, lo_open=True)
        if not 0.0 <= self.dropout < 1.0:
            _fail("adapter.dropout", self.dropout, "must be in [0, 1)")
        if self.base_dtype not in BASE_DTYPES:
            _fail("adapter.base_dtype", self.base_dtype, "choose 'auto' or 'nf4'")
        if self.base_dtype == "nf4" and self.kind != "qlora":
            _fail("adapter.base_dtype", self.base_dtype, f"is QLoRA's 4-bit base, and adapter.kind = {self.kind!r}: "
                  "set adapter.kind = 'qlora' (or adapter.base_dtype = 'auto')")
        if self.kind == "none":
            self._check_unused()
        bad = [t for t in self.targets if not t.strip()]
        if bad:
            _fail("adapter.targets", self.targets, "each pattern names modules, e.g. ['*.attn.qkv', '*q_proj']; "
                  "drop the empty one ([] = the default targets)")

    def _check_unused(self) -> None:
        """ValueError for a key set away from its default while adapter.kind = 'none' (it would do nothing)."""
        for key, default in (("rank", 8), ("alpha", 16.0), ("dropout", 0.0), ("targets", []), ("base_dtype", "auto")):
            if getattr(self, key) != default:
                _fail(f"adapter.{key}", getattr(self, key),
                      "configures adapters, and adapter.kind = 'none' trains without them: set adapter.kind = "
                      f"'lora' (or drop adapter.{key})")

    @property
    def enabled(self) -> bool:
        return self.kind != "none"
