"""AdamW whose two moments are kept in bf16 or blockwise int8; the update is fp32.

Each step, per 256-element block of a parameter: decode the moments to fp32, update them
and the fp32 parameter (decoupled weight decay, bias correction, ``eps`` outside the
square root), encode the moments back. Only one block's (fused kernel) or one chunk's
(torch reference) fp32 moments exist at a time, so the state stays at 2 (bf16) or ~1.03
(int8) bytes per element per moment.

Two implementations, the same bytes: on CPU the fused kernel of ``native.py`` (C, one
pass per block; built once per machine), elsewhere (CUDA, no C compiler, ``native=False``)
``_step_reference``, torch ops over 64K-element chunks. Both round
every operation once: m = m*b1 + g*(1-b1); v = v*b2 + (g*g)*(1-b2);
p = p*(1-lr*wd) - (step_size*m) / (sqrt(v)/sqrt(1-b2^t) + eps), square roots correctly
rounded (``codec.sqrt_``). The fp32-state loop keeps torch's own AdamW arithmetic (lerp,
addcmul, addcdiv: fused multiply-adds), bit for bit.

Shard invariance: the engine tells the optimizer where each flat master shard starts
in its unit's global flat tensor (``place``); int8 blocks and the rounding noise are
laid on that global index, so the bytes of element i do not depend on the world size.

State per parameter (checkpointed as it is, codes and scales; never re-quantized):
  ``step``                         fp32 scalar
  ``exp_avg``, ``exp_avg_sq``      bf16 [n] | int8 [n], uint8 [n]
  ``exp_avg_scale``, ``exp_avg_sq_scale``   (int8 only) fp32 [n / BLOCK], per block
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor

from mct.optim.eager import EagerOptimizer
from mct.optim.lowbit import codec, native, noise

STATE_DTYPES = ("fp32", "bf16", "int8")
CHUNK = noise.T
"""Elements the torch reference decodes at a time (a multiple of codec.BLOCK)."""

_SALT_M, _SALT_V = 1, 2


class LowPrecisionAdamW(EagerOptimizer):
    """AdamW with ``state_dtype`` moments ('bf16': stochastic rounding; 'int8': blockwise
    codes, stochastic rounding; 'fp32': plain fp32 moments through the same loop, a
    check of the arithmetic against ``torch.optim.AdamW``). ``seed`` keys the rounding
    noise. ``native``: None (default) runs the fused CPU kernel where it loads and the
    torch reference elsewhere; False always the reference; True the kernel for every CPU
    tensor (ValueError when it cannot be built). Raises ValueError for arguments torch's
    AdamW would refuse too, and for amsgrad / maximize (not supported). An ``EagerOptimizer``:
    it never imports ``torch._dynamo``."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, state_dtype: str = "bf16",
                 seed: int = 0, amsgrad: bool = False, maximize: bool = False,
                 native: bool | None = None) -> None:
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype = {state_dtype!r}: choose one of {', '.join(STATE_DTYPES)}")
        if amsgrad or maximize:
            raise ValueError("LowPrecisionAdamW supports neither amsgrad nor maximize; "
                             "use optimizer.state_dtype = 'fp32' (torch.optim.AdamW) for them")
        if not 0.0 <= lr or not 0.0 <= eps or not 0.0 <= weight_decay:
            raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.state_dtype, self.seed = state_dtype, int(seed)
        self._place: dict[int, tuple[int, int]] = {}
        self._noise: dict[torch.device, noise.NoiseTable] = {}
        self.native = native
        self._kernels: native.Kernels | None = None
        self._kernels_tried = False  # a failed build is not retried every step
        if native and state_dtype != "fp32":
            self._kernels = self._load_kernels()

    # ---- the engine's protocol ----
    @property
    def block_state(self) -> dict[str, int]:
        """Per-block state names -> elements per entry (``mct.zero.state`` reshards them by block)."""
        return {"exp_avg_scale": codec.BLOCK, "exp_avg_sq_scale": codec.BLOCK} if self.state_dtype == "int8" else {}

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("step", "exp_avg", "exp_avg_sq", *self.block_state)

    @property
    def shard_align(self) -> int:
        """Shards of this optimizer's state must start at multiples of this many elements."""
        return 1 if self.state_dtype == "fp32" else codec.BLOCK

    def place(self, param: torch.Tensor, offset: int, stream: int) -> None:
        """``param`` starts at global flat index ``offset`` of unit number ``stream``.
        Raises ValueError when ``offset`` splits a quantization block."""
        if offset % self.shard_align or (self.shard_align > 1 and param.numel() % self.shard_align):
            raise ValueError(f"a shard of {param.numel()} elements at offset {offset} is not aligned to "
                             f"{codec.BLOCK}: build the engine with optimizer.state_dtype = {self.state_dtype!r} in its config "
                             f"(it aligns the ZeRO shards), not only the optimizer factory")
        self._place[id(param)] = (int(offset), int(stream))

    @contextlib.contextmanager
    def placed_as(self, chunk: torch.Tensor, param: torch.Tensor, start: int) -> Iterator[None]:
        """For the duration, ``chunk`` (a tensor of its own: the offloaded step's proxy)
        steps as elements ``[start, start + chunk.numel())`` of the placed ``param``: the
        same global index, so the same blocks and rounding noise as stepping ``param``.
        Raises ValueError when the chunk splits a quantization block."""
        offset, stream = self._place.get(id(param), (0, 0))
        self.place(chunk, offset + start, stream)
        try:
            yield
        finally:
            self._place.pop(id(chunk), None)

    # ---- state ----
    def _init_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        n, dev = p.numel(), p.device
        if self.state_dtype == "int8":
            codec._blocked(p.detach().view(-1))  # asserts whole blocks
            nb = n // codec.BLOCK
            return {"step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": torch.zeros(n, dtype=torch.int8, device=dev),
                    "exp_avg_sq": torch.zeros(n, dtype=torch.uint8, device=dev),
                    "exp_avg_scale": torch.zeros(nb, dtype=torch.float32, device=dev),
                    "exp_avg_sq_scale": torch.zeros(nb, dtype=torch.float32, device=dev)}
        dt = torch.bfloat16 if self.state_dtype == "bf16" else torch.float32
        return {"step": torch.zeros((), dtype=torch.float32), "exp_avg": torch.zeros(n, dtype=dt, device=dev),
                "exp_avg_sq": torch.zeros(n, dtype=dt, device=dev)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict``, then each state tensor back in this optimizer's
        storage dtype (torch casts every tensor to the parameter's fp32: int8 codes and
        bf16 moments go there and back exactly)."""
        super().load_state_dict(state_dict)
        for p, st in self.state.items():
            want = self._init_state(p) if "exp_avg" in st else {}
            for k, v in want.items():
                if k in st and k != "step":
                    st[k] = st[k].to(v.dtype)

    # ---- the step ----
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st.update(self._init_state(p))
                st["step"] += 1
                self._step_param(p.view(-1), p.grad.view(-1), st, group, self._place.get(id(p), (0, 0)))
        return loss

    def _step_param(self, p: torch.Tensor, g: torch.Tensor, st: dict[str, torch.Tensor], group: dict,
                    placed: tuple[int, int]) -> None:
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        step = int(st["step"].item()) if not _is_fake(st["step"]) else 1
        step_size = lr / (1 - b1**step)
        bc2_sqrt = (1 - b2**step) ** 0.5  # as torch's AdamW, for bit parity with fp32 state
        if self.state_dtype == "fp32":
            self._step_torch_adamw(p, g, st, (lr, b1, b2, eps, wd, step_size, bc2_sqrt))
            return
        h = (1 - lr * wd, b1, 1 - b1, b2, 1 - b2, step_size, bc2_sqrt, eps, 1.0 / 127.0**2, 1.0 / 255.0)
        offset, stream = placed
        kernels = self._kernels_for(p, g, st)
        if kernels is None:
            self._step_reference(p, g, st, h, (stream, step, offset))
            return
        table = self._table(p.device)
        ht = torch.tensor(h, dtype=torch.float32)  # the same float32 roundings torch's ops make of h
        if _is_fake(p):
            return  # the planner's dry run: the table and ``ht`` are all the kernel allocates
        om, ov = (table.shift(stream, step, salt, offset) for salt in (_SALT_M, _SALT_V))
        if self.state_dtype == "int8":
            kernels.int8(p, g, st, table.uniform_table, om, ov, noise.T, ht)
        else:
            kernels.bf16(p, g, st, table.bits16_table, om, ov, noise.T, ht)

    def _step_torch_adamw(self, p: torch.Tensor, g: torch.Tensor, st: dict[str, torch.Tensor],
                          hyper: tuple[float, ...]) -> None:
        """fp32 state: torch's single-tensor AdamW arithmetic, chunk by chunk."""
        lr, b1, b2, eps, wd, step_size, bc2_sqrt = hyper
        for a in range(0, p.numel(), CHUNK):
            b = min(a + CHUNK, p.numel())
            m, v, pc, gc = st["exp_avg"][a:b], st["exp_avg_sq"][a:b], p[a:b], g[a:b]
            pc.mul_(1 - lr * wd)
            m.lerp_(gc, 1 - b1)
            v.mul_(b2).addcmul_(gc, gc, value=1 - b2)
            denom = (v.sqrt() / bc2_sqrt).add_(eps)
            pc.addcdiv_(m, denom, value=-step_size)

    def _step_reference(self, p: torch.Tensor, g: torch.Tensor, st: dict[str, torch.Tensor],
                        h: tuple[float, ...], where: tuple[int, int, int]) -> None:
        """bf16 / int8 state in torch ops, chunk by chunk: the bytes of ``kernel.c``."""
        decay, b1, c1, b2, c2, step_size, bc2_sqrt, eps = h[:8]
        stream, step, offset = where
        for a in range(0, p.numel(), CHUNK):
            b = min(a + CHUNK, p.numel())
            m, v = self._decode(st, a, b)
            pc, gc = p[a:b], g[a:b]
            m.mul_(b1).add_(gc * c1)
            v.mul_(b2).add_(torch.mul(gc, gc).mul_(c2))
            denom = codec.sqrt_(v.clone()).div_(bc2_sqrt).add_(eps)
            pc.mul_(decay).sub_(m.mul(step_size).div_(denom))
            self._encode(st, a, b, m, v, (self.seed, stream, step, offset + a))

    def _kernels_for(self, p: torch.Tensor, g: torch.Tensor, st: dict[str, torch.Tensor]) -> native.Kernels | None:
        """The fused kernels where they apply: contiguous fp32 CPU shard, grad and state of
        whole blocks (fake ones too: the planner's dry run takes the path the real step takes;
        a bf16 parameter of another length, outside the engine, takes the reference)."""
        if self.native is False or p.device.type != "cpu" or p.numel() % codec.BLOCK:
            return None
        tensors = (p, g, *(t for k, t in st.items() if k != "step"))
        if not (p.dtype == g.dtype == torch.float32 and all(t.is_contiguous() for t in tensors)):
            return None
        if self._kernels is None and not self._kernels_tried:
            self._kernels, self._kernels_tried = native.load(), True
        return self._kernels

    def _load_kernels(self) -> native.Kernels:
        kernels = native.load()
        if kernels is None:
            cc = native.compiler() or "no C compiler ($CC, cc, gcc, clang)"
            raise ValueError(f"native=True, but the fused CPU kernel could not be built with {cc}: install "
                             "a C compiler, or pass native=None to run the torch reference (the same bytes)")
        return kernels

    def _decode(self, st: dict[str, torch.Tensor], a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.state_dtype == "bf16":
            return st["exp_avg"][a:b].float(), st["exp_avg_sq"][a:b].float()
        ka, kb = a // codec.BLOCK, codec.blocks_of(b)
        dev = st["exp_avg"].device
        m = codec.decode_signed(st["exp_avg"][a:b], st["exp_avg_scale"][ka:kb],
                                torch.empty(b - a, dtype=torch.float32, device=dev))
        v = codec.decode_unsigned(st["exp_avg_sq"][a:b], st["exp_avg_sq_scale"][ka:kb],
                                  torch.empty(b - a, dtype=torch.float32, device=dev))
        return m, v

    def _encode(self, st: dict[str, torch.Tensor], a: int, b: int, m: torch.Tensor, v: torch.Tensor,
                where: tuple[int, int, int, int]) -> None:
        _, stream, step, start = where
        n, table = b - a, self._table(m.device)
        if self.state_dtype == "bf16":
            codec.round_bf16(m, st["exp_avg"][a:b], table.bits16(stream, step, _SALT_M, start, n))
            codec.round_bf16(v, st["exp_avg_sq"][a:b], table.bits16(stream, step, _SALT_V, start, n))
            return
        ka, kb = a // codec.BLOCK, codec.blocks_of(b)
        codec.encode_signed(m, st["exp_avg"][a:b], st["exp_avg_scale"][ka:kb],
                            table.uniform(stream, step, _SALT_M, start, n))
        codec.encode_unsigned(v, st["exp_avg_sq"][a:b], st["exp_avg_sq_scale"][ka:kb],
                              table.uniform(stream, step, _SALT_V, start, n))

    def _table(self, device: torch.device) -> noise.NoiseTable:
        if device not in self._noise:
            self._noise[device] = noise.NoiseTable(self.seed, device)
        return self._noise[device]


def _is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, FakeTensor)
