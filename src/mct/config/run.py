"""What is trained, on what, for how long: the [model], [data] and [train] sections."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from mct.config.values import OnResume, _check_range, _fail, fixed, may


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

    ON_RESUME: ClassVar[dict[str, OnResume]] = {
        **dict.fromkeys(("n_layer", "n_head", "d_model", "seq_len", "vocab_size", "source"),
                        fixed("the checkpoint holds the weights of the run's architecture")),
        "dropout": fixed("the run's dropout is part of its numerics (the same masks at every step)"),
        "attention": fixed("another attention kernel changes the run's numerics"),
    }

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

    ON_RESUME: ClassVar[dict[str, OnResume]] = {
        "path": fixed("the samples and their order belong to the run"),
        "micro_batch_size": fixed("the run's global batch belongs to it (same samples at the same steps)"),
        "grad_accum": fixed("a resume sets it from the run's global batch and the number of ranks",
                            "change --nproc instead (it must divide the run's micro-batches per step)"),
        "val_fraction": fixed("the train/validation split belongs to the run"),
        "packing": fixed("the windows a run trains on (and what each token attends to) belong to the run"),
    }

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
    loss_vocab_slice: int = 0
    """With the chunked loss and a frozen output head (adapters): the head is reached this many vocabulary
    rows at a time, forward and backward, never whole (a sharded head is gathered a slice at a time);
    0 = the whole head (docs/qlora.md)."""

    ON_RESUME: ClassVar[dict[str, OnResume]] = {
        "steps": may("the run continues to the new count (or stops at once when it is already there); "
                     "the LR schedule's decay is computed over the new count from the resumed step on"),
        **dict.fromkeys(("lr", "warmup_steps", "lr_schedule", "min_lr_ratio", "decay_fraction", "weight_decay",
                         "grad_clip"), fixed("the optimizer's hyperparameters belong to the run")),
        **dict.fromkeys(("eval_every", "eval_batches", "log_every", "tensorboard"),
                        may("evaluation and logging follow the new value from the resumed step on")),
        **dict.fromkeys(("checkpoint_every", "keep_checkpoints"),
                        may("checkpoints are saved and kept as the new value says from the resumed step on")),
        **dict.fromkeys(("max_rollbacks", "snapshot_every", "loss_spike_factor", "loss_spike_window",
                         "grad_norm_factor", "max_consecutive_skips", "lr_cut_factor", "preempt_timeout_s"),
                        may("the divergence and signal handling use the new value from the resumed step on")),
        "init_from": fixed("a resume continues from the run's checkpoint, never from other weights"),
        "loss_chunk_tokens": may("the loss runs over the new chunks: the same values up to summation order"),
        "loss_vocab_slice": may("the loss reaches the head in the new slices: the same values up to summation "
                                "order"),
    }

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
        _check_range("train.loss_vocab_slice", self.loss_vocab_slice, 0)
        _check_range("train.max_consecutive_skips", self.max_consecutive_skips, 1)
        _check_range("train.lr_cut_factor", self.lr_cut_factor, 0.0, 1.0, lo_open=True)
        _check_range("train.preempt_timeout_s", self.preempt_timeout_s, 0.0, lo_open=True)
        if 0 < self.loss_spike_factor <= 1 or 0 < self.grad_norm_factor <= 1:
            _fail("train.loss_spike_factor/grad_norm_factor", (self.loss_spike_factor, self.grad_norm_factor),
                  "must be > 1 (a factor above the running median), or 0 to disable")
        if self.eval_every and not self.eval_batches:
            _fail("train.eval_batches", self.eval_batches,
                  f"must be >= 1 while train.eval_every = {self.eval_every}; set train.eval_every = 0 to skip evaluation")


CONTEXT_ATTENTION = ("auto", "all_to_all", "all_gather", "ring")
"""The values of ``parallel.context_attention`` (``mct.context.attention`` implements each)."""


@dataclass(kw_only=True)
class ParallelConfig:
    context: int = 1
    """Context parallelism: ranks that share one window, each holding 1/context of its tokens
    (docs/parallel.md); the world size must be a multiple of it (data parallel over world / context).
    1 = off. model.seq_len must be a multiple of 2 x context (the causal load balance)."""
    context_attention: str = "auto"
    """How attention crosses the context group: 'all_to_all' (Ulysses: heads and key/value heads
    split over the group, each rank attends the whole window for its heads), 'all_gather' (each rank
    gathers every key and value; any mask, any head count), 'ring' (keys and values passed around the
    group block by block, overlapped with attention, log-sum-exp merge; any head count, holds 1/context
    of them for backward) or 'auto' = 'all_gather': on this CPU it held 0.47x all_to_all's activation
    peak in 0.65x its step time (it attends and masks this rank's rows over their causal prefix,
    all_to_all the whole window for its heads) and took 0.75x the ring's step time for 1.07x its peak
    (docs/parallel.md)."""

    ON_RESUME: ClassVar[dict[str, OnResume]] = {
        "context": may("every step trains the same windows (the sampler draws the run's global batch as "
                       "before; data.grad_accum is set for world / context data-parallel ranks), the same loss "
                       "and gradients up to summation order; dropout draws each rank's masks anew"),
        "context_attention": may("the same attention up to summation order, through the new collectives"),
    }

    def __post_init__(self) -> None:
        _check_range("parallel.context", self.context, 1)
        if self.context_attention not in CONTEXT_ATTENTION:
            _fail("parallel.context_attention", self.context_attention,
                  f"choose {', '.join(repr(c) for c in CONTEXT_ATTENTION)}")
