"""``mct verify``: train the configured engine and the fp32 reference on the same
global batches and compare, step by step and parameter by parameter.

Three numbers, each relative to the reference:
- loss, every step;
- gradient norm (global, before clipping), every step: it is what exposes a wrong
  averaging factor (ranks, micro-batches, loss scale). Adam is invariant to a constant
  gradient scale, so with AdamW such a bug moves neither the loss nor the parameters;
- parameters after the run, as ||theta - theta_ref|| / ||theta_ref|| over the trainable
  ones (the worst single tensor is named for diagnosis); frozen ones (an adapter run's
  base) must end bit-identical to the engine's own start. Not per tensor: the attention key
  bias has a gradient that is exactly zero (softmax ignores a shift shared by every
  key), so it only ever sees rounding noise, which Adam turns into lr-sized steps; any
  change in the order of the same fp32 sums (ZeRO 2/3 reduce per micro-batch) makes
  that one tensor differ by 1e-4 (fp32) to 0.4 (bf16) of its own tiny norm.
Plus a fourth, before the first step: the engine's fp32 masters against the reference's
parameters (the same initialization), ``init_rel`` = ||master_0 - theta_ref_0|| /
||theta_ref_0|| over the trainable parameters. The masters are fp32 copies in every
mode, so it is 0; its tolerance INIT_TOL = 1e-6 (~2^-20) fails any master that went
through a format with fewer than ~20 significand bits. Derivation (docs/precision.md):
rounding to p significand bits moves an element x by up to ulp(x)/2 = 2^-p |x| (RMS
about 0.2 x 2^-p |x| for uniformly spread mantissas), so a rounded master is off by
~0.2 x 2^-p x (the norm share of the non-representable values; ones and zeros round
exactly): bf16 (p = 8) measured 4.1e-4 (tiny GPT) / 6.6e-4 (default GPT), fp16
(p = 11) 5.1e-5 / 8.3e-5, i.e. 50x-660x over INIT_TOL. After a few steps the same
offset hides in the low-precision noise (bf16 moves parameters by up to 6e-3 over 50
steps: Adam turns gradient rounding into lr-sized per-element steps), so the
end-of-run and per-step tolerances below let a rounded master through (checked in
tests/verify/test_verify.py with the old construction planted).
Tolerances: fp32 1e-5 for loss, gradient norm and parameters (with several
micro-batches at stages 2/3 the sum order alone moves parameters by ~1e-6);
bf16/fp16: loss and gradient norm 2e-2 at every step, parameters
PARAM_TOL_LOW_PRECISION (low-precision gradients move Adam's per-element steps by up
to a learning rate, so parameters drift further than losses). Measured on the tiny
and default GPTs with the default schedule (docs/precision.md): losses <= 1.3e-3
(bf16) and 5e-5 (fp16) relative over 50 steps, parameters <= 6e-3.

Low-precision optimizer state (``optimizer.state_dtype``): the reference keeps fp32
moments (the yardstick); the tolerance is the larger of the precision mode's and the
state's (STATE_TOLERANCES). Derivation: each step rounds Adam's moments with a relative
error d (bf16 stochastic rounding: 2^-8 at most, unbiased; int8 blockwise: about 1/code,
up to a few % for a block's small values), which moves that step's per-element update
m / sqrt(v) by about d of its size, at most ``lr``. Over K steps unbiased errors add as a
random walk: |dtheta| ~ lr * d * sqrt(K) per element, against weights of RMS ~0.02-0.05:
lr 3e-3, K = 50, d = 2^-8 -> ~2e-3 relative; d = 4% -> ~2e-2. Parameters get 5x that as
margin (the worst elements, correlated errors); losses the quality targets of the
low-precision state (1% bf16, 2% int8 of the loss).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import torch

from mct.adapters.qlora import dequantize_base
from mct.context import data_parallel
from mct.config import EngineConfig
from mct.dist import DistContext
from mct.engine import Engine
from mct.persistence.init_from import load_pretrained
from mct.precision import PrecisionPolicy
from mct.verify.reference import ReferenceTrainer
from mct.run.schedule import lr_at
from mct.task import build_model, check_tokens, seeded, task_for
from mct.task.gpt import make_optimizer, step_batches
from mct.data import build_data

PARAM_TOL_LOW_PRECISION = 5e-2
INIT_TOL = 1e-6
"""Masters against the reference before the first step, relative, in every mode."""
TOLERANCES = {"fp32": (1e-5, 1e-5), "bf16": (2e-2, PARAM_TOL_LOW_PRECISION),
              "fp16": (2e-2, PARAM_TOL_LOW_PRECISION)}
"""precision mode -> (loss and gradient-norm tolerance, parameter tolerance), relative."""
STATE_TOLERANCES = {"fp32": (0.0, 0.0), "bf16": (1e-2, 1e-2), "int8": (2e-2, 1e-1)}
"""optimizer.state_dtype -> (loss and gradient-norm tolerance, parameter tolerance), relative."""


def tolerances(cfg: EngineConfig) -> tuple[float, float]:
    """(loss / gradient-norm, parameter) tolerance: the larger of precision's and the state's."""
    (lt, pt), (ls, ps) = TOLERANCES[cfg.precision.mode], STATE_TOLERANCES[cfg.optimizer.state_dtype]
    return max(lt, ls), max(pt, ps)


@dataclass
class VerifyReport:
    mode: str
    rows: list[tuple[int, float, float, float, bool]] = field(default_factory=list)
    """(step, loss, reference loss, relative difference, skipped)"""
    grad_norms: list[tuple[float, float]] = field(default_factory=list)
    """(grad norm, reference grad norm) per row"""
    param_rel: float = 0.0
    """||theta - theta_ref|| / ||theta_ref|| over every trainable parameter (all of them but a frozen base)"""
    frozen: int = 0
    """frozen parameters (an adapter run's base, a user's own freezing)"""
    frozen_changed: list[str] = field(default_factory=list)
    """frozen parameters whose engine values changed during the run (must be none)"""
    init_rel: float = 0.0
    """the same before the first step: the masters against the reference's init"""
    worst_param: str = ""
    worst_param_rel: float = 0.0
    loss_tol: float = 0.0
    param_tol: float = 0.0
    checkpointing: str = "none"
    """the engine's recompute policy as it ran (``CheckpointState.policy``: per_block as runs)"""
    recomputed_blocks: int = 0
    """block forwards the engine recomputed in its last step"""
    mlp_tile_tokens: int = 0
    """checkpointing.mlp_tile_tokens as it ran (0: untiled)"""
    mlp_tiles: int = 0
    """MLP tiles the engine back-propagated in its last step"""

    @property
    def max_loss_rel(self) -> float:
        return max((r[3] for r in self.rows), default=0.0)

    @property
    def max_grad_norm_rel(self) -> float:
        return max((_rel(a, b) for a, b in self.grad_norms if b == b), default=0.0)

    @property
    def passed(self) -> bool:
        return (self.max_loss_rel <= self.loss_tol and self.max_grad_norm_rel <= self.loss_tol
                and self.param_rel <= self.param_tol and self.init_rel <= INIT_TOL and not self.frozen_changed)

    def table(self) -> str:
        lines = [f"initial parameter difference      {self.init_rel:.3e} (tolerance {INIT_TOL:.0e}: fp32 masters "
                 f"equal to the reference's init)",
                 f"{'step':>5} {'loss':>12} {'reference':>12} {'rel diff':>10} {'grad norm':>10} {'reference':>10}"]
        for (step, a, b, rel, skipped), (g, gr) in zip(self.rows, self.grad_norms):
            lines.append(f"{step:>5} {a:>12.6f} {b:>12.6f} {rel:>10.2e} {g:>10.4g} {gr:>10.4g}"
                         + ("  (skipped: overflow)" if skipped else ""))
        verdict = "PASS" if self.passed else "FAIL"
        if self.checkpointing != "none":
            lines.append(f"checkpointing {self.checkpointing}: {self.recomputed_blocks} block forward(s) "
                         f"recomputed in the last step")
        if self.mlp_tile_tokens:
            lines.append(f"MLPs in tiles of {self.mlp_tile_tokens} tokens: {self.mlp_tiles} tile(s) back-propagated "
                         f"in the last step")
        lines.append(f"max relative loss difference      {self.max_loss_rel:.3e} (tolerance {self.loss_tol:.0e})")
        lines.append(f"max relative grad-norm difference {self.max_grad_norm_rel:.3e} (tolerance {self.loss_tol:.0e})")
        lines.append(f"relative parameter difference     {self.param_rel:.3e} (tolerance {self.param_tol:.0e}); "
                     f"worst tensor {self.worst_param} {self.worst_param_rel:.2e}")
        if self.frozen:
            lines.append(f"frozen parameters                 {self.frozen - len(self.frozen_changed)} of {self.frozen} "
                         f"unchanged, bit for bit" + (f"; changed: {', '.join(self.frozen_changed[:3])}"
                                                      if self.frozen_changed else ""))
        lines.append(f"{verdict}: precision {self.mode}")
        return "\n".join(lines)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def run_verify(cfg: EngineConfig, steps: int, ctx: DistContext | None = None) -> VerifyReport | None:
    """Every rank runs the engine; rank 0 also runs the reference over all ranks'
    micro-batches. Returns the report on rank 0, None elsewhere."""
    ctx = ctx or DistContext.current()
    task = task_for(cfg)
    # context groups share a window: the reference (degree 1) steps on world / parallel.context ranks' batches
    data_rank, data_world = data_parallel(ctx.rank, ctx.world_size, cfg.parallel.context)
    corpus, sampler = build_data(cfg, data_world)
    check_tokens(task, corpus)
    model, _ = build_model(task, cfg, on_meta=False)
    optimizer = task.optimizer or make_optimizer(cfg)
    ref = None
    if ctx.is_main:
        ref_model = copy.deepcopy(model)
        # QLoRA: the reference computes on the base the engine's NF4 units decode
        dequantize_base(ref_model, cfg.adapter, PrecisionPolicy.from_config(cfg.precision).param_dtype)
        # the reference keeps fp32 optimizer state whatever the engine keeps
        fp32_state = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, state_dtype="fp32"))
        ref_opt = optimizer if cfg.optimizer.state_dtype == "fp32" else make_optimizer(fp32_state)
        ref = ReferenceTrainer(ref_model, ref_opt, grad_clip=cfg.train.grad_clip,
                               param_groups=task.param_groups(ref_model) if task.param_groups else None)
    engine = Engine(model, optimizer, cfg, ctx=ctx,
                    param_groups=task.param_groups(model) if task.param_groups else None)
    if cfg.train.init_from:
        load_pretrained(engine, cfg.train.init_from)
        loaded = engine.full_state_dict()  # collective: every rank
        if ref is not None:
            ref.load_weights(loaded)
    loss_fn = seeded(task.loss_fn)
    loss_tol, param_tol = tolerances(cfg)
    mode = cfg.precision.mode + ("" if cfg.optimizer.state_dtype == "fp32" else
                                 f", optimizer state {cfg.optimizer.state_dtype}")
    report = VerifyReport(mode, loss_tol=loss_tol, param_tol=param_tol)
    start = engine.full_state_dict()  # collective: every rank
    trainable = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    report.init_rel = _init_difference(start, trainable, ref)
    opt_step = 0
    for step in range(steps):
        lr = lr_at(opt_step, cfg.train)
        for g in engine.optimizer.param_groups:
            g["lr"] = lr
        out = engine.train_step(step_batches(sampler, cfg, step, data_rank, ctx.device), loss_fn)
        if ref is not None:
            for g in ref.optimizer.param_groups:
                g["lr"] = lr
            per_rank = [step_batches(sampler, cfg, step, r) for r in range(data_world)]
            if out.skipped:  # no update on either side: the reference skips the step too
                report.rows.append((step, out.loss, float("nan"), 0.0, True))
                report.grad_norms.append((out.grad_norm, float("nan")))
            else:
                r = ref.step(per_rank, loss_fn)
                report.rows.append((step, out.loss, r.loss, _rel(out.loss, r.loss), False))
                report.grad_norms.append((out.grad_norm, r.grad_norm))
        opt_step += not out.skipped
    report.checkpointing = engine.recompute.policy
    report.recomputed_blocks = engine.recompute.recomputed_blocks
    report.mlp_tile_tokens = cfg.checkpointing.mlp_tile_tokens
    report.mlp_tiles = engine.recompute.metrics().get("mlp_tiles", 0)
    state = engine.full_state_dict()
    if ref is None:
        return None
    report.param_rel, report.worst_param, report.worst_param_rel = param_difference(
        {n: v for n, v in state.items() if n in trainable}, ref.state_dict())
    frozen = [n for n in state if n not in trainable]
    report.frozen = len(frozen)
    report.frozen_changed = [n for n in frozen if not torch.equal(state[n], start[n])]
    return report


def _init_difference(start: dict, trainable: set[str], ref: ReferenceTrainer | None) -> float:
    """``init_rel`` of the engine's ``start`` state over the ``trainable`` parameters (the
    ones with a master; frozen ones are cast to the param dtype by design). 0.0 off rank 0."""
    if ref is None:
        return 0.0
    ref_state = ref.state_dict()
    return param_difference({n: v for n, v in start.items() if n in trainable}, ref_state)[0]


def param_difference(state: dict, ref_state: dict) -> tuple[float, str, float]:
    """(||theta - theta_ref|| / ||theta_ref|| over every parameter, the worst single
    tensor's name, its own relative difference)."""
    diff_sq = ref_sq = worst_rel = 0.0
    worst = ""
    for name, p in state.items():
        q = ref_state[name].to(p.device)
        d, n = float((p - q).double().norm()), float(q.double().norm())
        diff_sq, ref_sq = diff_sq + d * d, ref_sq + n * n
        if d / max(n, 1e-12) >= worst_rel:
            worst_rel, worst = d / max(n, 1e-12), name
    return (diff_sq / max(ref_sq, 1e-24)) ** 0.5, worst, worst_rel
