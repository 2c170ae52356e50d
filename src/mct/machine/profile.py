"""Measure this machine: ``torch.mm`` FLOP/s per dtype with one thread and with every
usable core, and a one-thread memory-copy bandwidth; on CUDA the device's own rates.

A matmul rate is the fastest of several calls (a loaded machine only ever slows a call
down, so the fastest is the best estimate of the peak) at a square size grown (256, 512, ... at
most 2048 on CPU, 8192 on CUDA) until one call takes long enough to time well, so a
slow dtype (fp16 on a CPU without fp16 units) is measured at a small size and the
whole measurement stays within a few seconds. A dtype whose matmul does not run here is
left out. ``MachineProfile`` is plain data (``to_dict`` / ``from_dict``) so the cache
(``mct.machine.cache``) and the run's metadata can hold it as JSON.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from mct.checkpointing.policies import SelectiveDispatch, context_fn_for
from mct.machine.entry import check_extra, check_marks, check_types, positive_rates
from mct.machine.load import Load
from mct.memory.tracker import MemoryTracker
from mct.precision.cpu_matmul import UpcastMatmul

PROFILE_VERSION = 10
"""Bumped when a profile gains a rate older code did not measure: a cached profile of
another version is measured again, never half-used. 3: the random-number rate
(``extra['random_elements_per_s']``), the fused attention kernels' rates
(``extra['attention_by_dim']``) and the per-op overhead at a world size
(``extra['op_overhead_s']`` keys '<threads>x<ranks>'). 4: elementwise curves of the other
compute dtypes (``extra['elementwise_by_dtype']``). 5: the per-op overhead and the wait from
real steps of two models, with the per-byte cost inside a step beside them
(``extra['byte_overhead_s']``). 6: elementwise curves by kind of op
(``extra['elementwise_by_kind']``). 7: the per-op overhead, the per-byte cost and the wait
from the median of the real steps (the fastest before), one process's at the rank's own
threads (one thread before); the cost of an op passing through a Python dispatch mode
(``extra['python_mode_op_s']``). 8: the cost of an op passing through torch's
selective-checkpoint dispatch modes (``extra['selective_mode_op_s']``), and the every-core
speed-up of elementwise ops and matmuls by size (``extra['elementwise_speedup']``,
``extra['matmul_speedup']``; the thread count, and a blend by FLOPs, assumed before), the
memory tracker's cost per op (``extra['tracker_op_s']``), and the per-op overhead of steps
without the tracker (with it before). 9: the wait per collective call as the slope from the
calibration engines' stage-0 steps to their stage-3 ones (``collective_wait_s``; stage 0's
time in its collectives over its calls before, a once-a-step skew counted per call). 10: the
collectives timed as the engine issues them (gloo's all-gather and 2-rank reduce-scatter as
sends and receives, ``mct.zero.comm.TorchCollectives``; gloo's collectives before)."""

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The precision modes' compute dtypes, by their config names."""

KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
                "amx_fp16", "asimd", "sve", "sve2", "bf16", "i8mm")
"""The CPU flags (x86 ``flags``, Arm ``Features``) that decide which matmul kernels torch runs."""

MIN_CALL_S = 0.03
"""A matmul size is grown until one call takes at least this long (or the size cap)."""

ELEMENTWISE_SIZES = (2**16, 2**19, 2**22)
"""Bytes per tensor of the one-thread elementwise curve (``extra['elementwise_curve']``):
tensors that stay in a core's caches move several times faster than 32 MiB ones."""

THREADED_MATMUL_SIZES = (64, 128, 256, 512)
"""The square fp32 matmuls whose every-core speed-up is measured (``extra['matmul_speedup']``)."""

MATMUL_DIMS = (16, 32, 64, 128, 256, 512)
"""The smallest dimension of the one-thread matmuls of ``extra['matmul_by_dim']``
([1024, d] x [d, 1024]): a matmul with a short side (a head's width, a narrow layer) runs
far below the square peak, and a model's are mostly such on a CPU."""

ATTENTION_DIMS = (16, 64)
"""Head widths of the one-thread fused attention curve (``extra['attention_by_dim']``;
[4, 4, 128, d] causal, forward and backward)."""

BY_DIM_BUDGET_S = 0.25
"""Seconds of ``extra['matmul_by_dim']`` timed batches at one dimension after which no more
are timed (at least 2): fp16 matmuls on a CPU without fp16 units (the 2-core AVX-512 EPYC:
3 GFLOP/s quiet, 1 under load) took 3.7 s of a 14 s measurement quiet and 20 s under load at
5 batches each; a call that long is timed well by 2, and the passes of a busy measurement
(``mct.machine.passes``) add interleaved samples where back-to-back ones would all be slowed alike."""

RANDOM_ELEMENTS = 2**16
"""Elements of the fp32 tensor ``bernoulli_`` fills to time random-number generation
(``extra['random_elements_per_s']``): dropout's masks cost ~10 ns an element on one CPU
thread, 50x an add's, so they are timed apart from the elementwise ops."""


@dataclass(frozen=True)
class MachineProfile:
    """One machine's measured rates, keyed by ``key``.

    ``matmul_one``: FLOP/s of one thread per dtype name (fp32/bf16/fp16; on CUDA the
    device's); ``matmul_all``: with ``threads`` threads (every usable core; on CUDA the
    device's again); ``matmul_size``: the square size each dtype was timed at;
    ``memcpy_bytes_per_s``: bytes one thread copies per second (each read once, written
    once; on CUDA device to device)."""

    device: str
    name: str
    flags: tuple[str, ...]
    torch_version: str
    threads: int
    matmul_one: dict[str, float]
    matmul_all: dict[str, float]
    matmul_size: dict[str, int]
    memcpy_bytes_per_s: float
    measured_at: str = ""
    seconds: float = 0.0
    version: int = PROFILE_VERSION
    load: dict[str, Any] = field(default_factory=dict)
    """What other processes used of this machine's cores while it was measured
    (``mct.machine.load.Load.to_dict`` and 'passes', ``mct.machine.passes``); {}: not recorded
    (a profile measured before mct watched the load, or written by hand)."""
    suspect: str = ""
    """Why a run found this profile wrong ('' when none did): the next command that measures
    (``mct.machine.cache.calibrate``: `mct plan`, `auto`, `mct train`'s rank 0) measures it again."""
    pinned: bool = False
    """A profile written by hand or copied from another machine: a run that disagrees with it
    still says so, but never marks it suspect (only ``mct calibrate --force`` replaces it)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Rates beyond the peaks (the time model's, ``mct.planner.steptime``): 'matmul_by_dim'
    {dtype: [[smallest dimension, FLOP/s], ...]} one thread at ``MATMUL_DIMS``;
    'elementwise_curve' [[bytes an op reads and writes, bytes/s], ...] one thread at
    ``ELEMENTWISE_SIZES`` (fp32), 'elementwise_by_dtype' {dtype: the same curve} for the
    other compute dtypes (CPU), 'elementwise_by_kind' {kind: {dtype: the curve of that kind's
    ops}} (``ELEMENTWISE_KINDS``, CPU);
    'copy_all_bytes_per_s' (every thread); 'disk_bytes_per_s' (write + fsync in the
    temporary directory); 'host_bytes_per_s' (CUDA: pinned host to device);
    'random_elements_per_s' (one thread's ``bernoulli_``, ``RANDOM_ELEMENTS``);
    'python_mode_op_s' (CPU: what an op costs passing through mct's Python dispatch mode,
    ``python_mode_op_s``); 'selective_mode_op_s' (what an op costs passing through torch's
    selective-checkpoint dispatch modes, ``selective_mode_op_s``); 'tracker_op_s' (CPU: what an
    op costs through the memory tracker's dispatch mode, ``tracker_op_s``); 'elementwise_speedup'
    [[bytes an op moves, x]] and 'matmul_speedup' [[FLOPs, x]] (CPU, more than one core:
    what every core gains over one, by size, ``_threads_speedup``);
    'attention_by_dim' {dtype: {'forward'|'backward': [[head width, FLOP/s], ...]}} one
    thread at ``ATTENTION_DIMS``, FLOPs as torch's counter counts them (CPU only);
    'collectives' {'<backend>:<world>': {kind: [latency s, bytes/s]}}, and
    {'<backend>:<world>/<group>': {kind: ...}} the context group's collectives within groups
    of <group> ranks, every group at once (``mct.machine.collectives.measure_group_collectives``;
    measured on first use, so a profile without them stays valid), and 'op_overhead_s'
    {'<threads>': s of one process alone, '<threads>x<ranks>': s of each of that many
    ranks stepping at once} and 'collective_wait_s' {'<threads>x<ranks>': s a rank waits at
    each collective call of a real step beyond the collective's time} and 'byte_overhead_s'
    {the same keys: s per byte an op moves inside a real step beyond these rates}, measured on
    first use (``mct.planner.overhead.measure_op_overhead``)."""

    @property
    def load_busy(self) -> bool:
        """Was this profile measured under load (``load`` says so; False when not recorded)?"""
        return bool(self.load) and Load.from_dict(self.load).busy

    @property
    def key(self) -> str:
        return machine_key(self.device, self.name, self.flags, self.torch_version, self.threads)

    def peak_flops(self, dtype: str, threads_per_rank: int, ranks: int) -> float | None:
        """The matmul peak a run of ``ranks`` ranks can reach in ``dtype``: the one-thread
        rate x ``threads_per_rank`` x ``ranks`` on a CPU, the device rate x ``ranks`` on
        CUDA. None when ``dtype`` was not measured here."""
        rate = self.matmul_one.get(dtype)
        if rate is None:
            return None
        return rate * ranks * (1 if self.device == "cuda" else max(1, threads_per_rank))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["flags"] = list(self.flags)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "MachineProfile":
        """The profile ``to_dict`` wrote. Raises ValueError naming what is wrong (a
        damaged or foreign entry: the cache then measures again)."""
        if not isinstance(d, dict):
            raise ValueError(f"a machine profile is a JSON object, got {type(d).__name__}")
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"machine profile version {d.get('version')!r}, this mct reads {PROFILE_VERSION}")
        try:
            check_types(d)
            p = cls(device=d["device"], name=d["name"], flags=tuple(d["flags"]),
                    torch_version=d["torch_version"], threads=d["threads"],
                    matmul_one=positive_rates(d["matmul_one"]), matmul_all=positive_rates(d["matmul_all"]),
                    matmul_size=dict(d["matmul_size"]),
                    memcpy_bytes_per_s=float(d["memcpy_bytes_per_s"]), measured_at=d.get("measured_at", ""),
                    seconds=float(d.get("seconds", 0.0)), extra=dict(d.get("extra") or {}),
                    load=dict(d.get("load") or {}), suspect=d.get("suspect") or "", pinned=d.get("pinned", False))
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"machine profile entry is damaged ({type(e).__name__}: {e})") from None
        check_marks(p.load, p.suspect, p.pinned)
        if "fp32" not in p.matmul_one or not p.memcpy_bytes_per_s > 0:
            raise ValueError("machine profile entry has no fp32 matmul rate or no copy bandwidth")
        check_extra(p.extra)
        return p


def machine_key(device: str, name: str, flags: tuple[str, ...] | list[str], torch_version: str, threads: int) -> str:
    """The cache key: what the rates depend on."""
    return f"{device} | {name} | {' '.join(flags) or '-'} | torch {torch_version} | {threads} threads"


def format_rate(flops_per_s: float) -> str:
    """FLOP/s with an SI prefix, e.g. '93.6 GFLOP/s'."""
    return f"{format_flops(flops_per_s)}/s"


def format_flops(n: float) -> str:
    """FLOPs with an SI prefix, e.g. '1.91 GFLOP'."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {prefix}FLOP"
    return f"{n:.3g} FLOP"


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, else the CPU count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_identity() -> dict[str, Any]:
    """This CPU: ``model`` (the /proc/cpuinfo model name, else the platform's processor
    or machine name) and ``flags`` (those of ``KERNEL_FLAGS`` it has, in that order)."""
    model, flags = platform.processor() or platform.machine() or "?", set()
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and value.strip():
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return {"model": model, "flags": tuple(f for f in KERNEL_FLAGS if f in flags)}


def cpu_line(identity: dict[str, Any] | None = None) -> str:
    """``cpu_identity()`` as one line: 'MODEL (flags), N cores'."""
    ident = identity or cpu_identity()
    return f"{ident['model']} ({' '.join(ident['flags']) or '-'}), {usable_cores()} cores"


def current_key(device: str = "cpu") -> str:
    """The key a profile measured now on ``device`` ('cpu' | 'cuda') would have. Raises
    ValueError for a device that cannot be measured here (``check_device``)."""
    check_device(device)
    if device == "cuda":
        name, flags = _cuda_identity()
        return machine_key("cuda", name, flags, torch.__version__, 1)
    ident = cpu_identity()
    return machine_key("cpu", ident["model"], ident["flags"], torch.__version__, usable_cores())


def check_device(device: str) -> None:
    """Raise ValueError unless ``device`` is 'cpu', or 'cuda' with a CUDA device torch can use."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} cannot be measured: choose 'cpu' or 'cuda'")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device: measure 'cpu' "
                         "(mct calibrate --device cpu)")


def _cuda_identity() -> tuple[str, tuple[str, ...]]:
    major, minor = torch.cuda.get_device_capability()
    return torch.cuda.get_device_name(), (f"sm_{major}{minor}", f"cuda {torch.version.cuda}")


def default_device() -> str:
    """'cuda' where torch sees a CUDA device, else 'cpu'."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def measure_profile(device: str = "cpu", disk: Path | None = None) -> MachineProfile:
    """Measure this machine now (a few seconds). ``device``: 'cpu', or 'cuda' (the
    current CUDA device); ``disk``: the folder whose disk is timed (``disk_rate``).
    Raises ValueError for a device ``check_device`` refuses."""
    check_device(device)
    started = time.perf_counter()
    profile = _measure_cuda(disk) if device == "cuda" else _measure_cpu(disk)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return dataclasses.replace(profile, measured_at=stamp, seconds=round(time.perf_counter() - started, 3))


def _measure_cpu(disk: Path | None) -> MachineProfile:
    ident, cores, before = cpu_identity(), usable_cores(), torch.get_num_threads()
    one: dict[str, float] = {}
    every: dict[str, float] = {}
    sizes: dict[str, int] = {}
    try:
        for name, dtype in DTYPES.items():
            torch.set_num_threads(1)
            measured = _matmul_rate(dtype, "cpu", 2048, lambda: None, time.perf_counter)
            if measured is None:
                continue
            one[name], sizes[name] = measured
            torch.set_num_threads(cores)
            every[name] = one[name] if cores == 1 else (_matmul_rate(dtype, "cpu", 2048, lambda: None,
                                                                     time.perf_counter, start=sizes[name])
                                                        or measured)[0]
        torch.set_num_threads(1)
        copy = _copy_rate("cpu", 32 * 2**20, lambda: None)
        curve = {name: _matmul_by_dim(DTYPES[name], "cpu", lambda: None) for name in one}
        elementwise = [_elementwise_rate("cpu", n, lambda: None) for n in ELEMENTWISE_SIZES]
        by_dtype = {name: [_elementwise_rate("cpu", n, lambda: None, DTYPES[name]) for n in ELEMENTWISE_SIZES]
                    for name in one if name != "fp32"}
        by_kind = {kind: {name: [_elementwise_rate("cpu", n, lambda: None, DTYPES[name], kind) for n in ELEMENTWISE_SIZES]
                          for name in one} for kind in ELEMENTWISE_KINDS}
        random = random_rate("cpu", lambda: None)
        mode_op = python_mode_op_s()
        attention = {name: _attention_by_dim(DTYPES[name]) for name in one}
        torch.set_num_threads(cores)
        copy_all = _copy_rate("cpu", 32 * 2**20, lambda: None)
        threaded = _threads_speedup() if cores > 1 else {}
    finally:
        torch.set_num_threads(before)
    extra = {"matmul_by_dim": curve, "elementwise_curve": elementwise, "elementwise_by_dtype": by_dtype,
             "elementwise_by_kind": by_kind, "copy_all_bytes_per_s": copy_all,
             "random_elements_per_s": random, "attention_by_dim": attention, "disk_bytes_per_s": disk_rate(disk),
             "python_mode_op_s": mode_op, "selective_mode_op_s": selective_mode_op_s(),
             "tracker_op_s": tracker_op_s(), **threaded}
    return MachineProfile(device="cpu", name=ident["model"], flags=ident["flags"], torch_version=torch.__version__,
                          threads=cores, matmul_one=one, matmul_all=every, matmul_size=sizes,
                          memcpy_bytes_per_s=copy, extra=extra)


def _measure_cuda(disk: Path | None) -> MachineProfile:
    name, flags = _cuda_identity()
    sync = torch.cuda.synchronize
    rates: dict[str, float] = {}
    sizes: dict[str, int] = {}
    prior = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 is fp32 unless a run turns TF32 on itself
    try:
        for dname, dtype in DTYPES.items():
            measured = _matmul_rate(dtype, "cuda", 8192, sync, _synced_clock(sync), start=1024)
            if measured is not None:
                rates[dname], sizes[dname] = measured
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prior
    copy = _copy_rate("cuda", 256 * 2**20, sync)
    curve = {d: _matmul_by_dim(DTYPES[d], "cuda", sync, dims=(*MATMUL_DIMS, 1024, 2048), side=8192) for d in rates}
    elementwise = [_elementwise_rate("cuda", n, sync) for n in (2**20, 2**24, 2**27)]
    host = torch.empty(64 * 2**20, dtype=torch.uint8, pin_memory=True)
    extra = {"matmul_by_dim": curve, "elementwise_curve": elementwise, "copy_all_bytes_per_s": copy,
             "disk_bytes_per_s": disk_rate(disk), "random_elements_per_s": random_rate("cuda", sync, 2**24),
             "host_bytes_per_s": _transfer_rate(host, sync), "selective_mode_op_s": selective_mode_op_s()}
    return MachineProfile(device="cuda", name=name, flags=flags, torch_version=torch.__version__, threads=1,
                          matmul_one=rates, matmul_all=dict(rates), matmul_size=sizes, memcpy_bytes_per_s=copy,
                          extra=extra)


def _synced_clock(sync: Callable[[], None]) -> Callable[[], float]:
    def clock() -> float:
        sync()
        return time.perf_counter()
    return clock


def _matmul_rate(dtype: torch.dtype, device: str, max_n: int, sync: Callable[[], None],
                 clock: Callable[[], float], start: int = 256) -> tuple[float, int] | None:
    """(FLOP/s, size): the fastest of 5-9 timed ``torch.mm`` calls of [n, n] x [n, n]
    (2 n^3 FLOPs each) at the first size from ``start`` (doubling) whose call takes
    ``MIN_CALL_S`` or reaches ``max_n``. None when ``dtype`` matmuls raise here."""
    n = start
    while True:
        try:
            a = torch.randn(n, n, device=device).to(dtype)
            b = torch.randn(n, n, device=device).to(dtype)
            torch.mm(a, b)  # warm-up: kernel choice, first-touch pages
            sync()
        except RuntimeError:
            return None
        t0 = clock()
        torch.mm(a, b)
        took = clock() - t0
        if took >= MIN_CALL_S or n >= max_n:
            break
        n *= 2
    times = [took]
    for _ in range(max(4, min(8, int(0.3 / max(took, 1e-9))))):
        t0 = clock()
        torch.mm(a, b)
        times.append(clock() - t0)
    return 2.0 * n ** 3 / min(times), n  # the fastest call: a loaded machine only ever slows one down


def _threads_speedup(tries: int = 7) -> dict[str, list[list[float]]]:
    """What every core (the current thread count) gains over one thread, by size, measured
    here (CPU): 'elementwise_speedup' [[bytes an op moves, speed-up], ...] of the usual mix at
    the ``ELEMENTWISE_SIZES`` that torch splits over threads (all but the smallest);
    'matmul_speedup' [[FLOPs, speed-up], ...] of fp32 ``torch.mm`` of [n, n] x [n, n] at
    ``THREADED_MATMUL_SIZES``. One thread and every thread are timed in turn, ``tries`` times
    each, the fastest of each: a core another job takes for a moment slows both alike. Neither
    is the thread count: on the 2-core AVX2 machine an elementwise op of 0.75-3 MiB ran
    1.35-1.4x as fast at 2 threads (the barrier, the second core's wake-up), one of 12 MiB
    1.9x; a matmul of 1.7e7 FLOPs 1.8x."""
    threads = torch.get_num_threads()

    def gain(fn: Callable[[], Any], reps: int) -> float:
        fn()
        best = {1: float("inf"), threads: float("inf")}
        for _ in range(tries):
            for t in best:
                torch.set_num_threads(t)
                best[t] = min(best[t], _fastest(fn, reps, lambda: None, tries=1))
        torch.set_num_threads(threads)
        return best[1] / best[threads]

    elementwise = []
    for nbytes in ELEMENTWISE_SIZES[1:]:
        n = nbytes // 4
        x, y = torch.randn(n), torch.randn(n)
        ops = _mix(x, y, x.view(-1, 256))
        moved = sum(k for _, k in ops) * nbytes
        elementwise.append([moved / len(ops), gain(lambda: [op() for op, _ in ops], max(1, 2**25 // nbytes))])
    matmul = []
    for n in THREADED_MATMUL_SIZES:
        a, b = torch.randn(n, n), torch.randn(n, n)
        matmul.append([2.0 * n**3, gain(lambda: torch.mm(a, b), max(1, 2**29 // n**3))])
    return {"elementwise_speedup": elementwise, "matmul_speedup": matmul}


def _matmul_by_dim(dtype: torch.dtype, device: str, sync: Callable[[], None],
                   dims: tuple[int, ...] | None = None, side: int = 1024) -> list[list[float]]:
    """[[d, FLOP/s], ...] of ``torch.mm`` of [side, d] x [d, side] for each d (default
    ``MATMUL_DIMS``; the fastest of a few repeats of a batch of calls, about 10 ms each)."""
    out = []
    for d in dims or MATMUL_DIMS:
        a = torch.randn(side, d, device=device).to(dtype)
        b = torch.randn(d, side, device=device).to(dtype)
        flops = 2.0 * side * d * side
        torch.mm(a, b)
        out.append([float(d), flops / _fastest(lambda: torch.mm(a, b), max(1, min(50, int(2e8 / flops))), sync,
                                               budget_s=BY_DIM_BUDGET_S)])
    return out


def _fastest(fn: Callable[[], Any], reps: int, sync: Callable[[], None], tries: int = 5,
             budget_s: float | None = None) -> float:
    """Seconds of one ``fn()``: the fastest of ``tries`` timed batches of ``reps`` calls; with
    ``budget_s``, of at least 2 once the batches took that long together."""
    best, spent = float("inf"), 0.0
    for i in range(tries):
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        took = time.perf_counter() - t0
        best, spent = min(best, took / reps), spent + took
        if budget_s is not None and i >= 1 and spent >= budget_s:
            break
    return best


def _mix(x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor) -> tuple:
    """(op, tensors of ``x``'s size it reads and writes) of a training step's usual mix."""
    return ((lambda: x + y, 3), (lambda: x.mul_(1.0), 2), (lambda: torch.nn.functional.gelu(x), 2),
            (lambda: torch.softmax(rows, -1), 2), (lambda: torch.nn.functional.layer_norm(rows, (256,)), 2))


ELEMENTWISE_KINDS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple]] = {
    "light": lambda x, y, rows: ((lambda: x + y, 3), (lambda: x.mul_(1.0), 2), (lambda: x.copy_(y), 2)),
    "softmax": lambda x, y, rows: ((lambda: torch.softmax(rows, -1), 2), (lambda: torch.log_softmax(rows, -1), 2)),
    "safe_softmax": lambda x, y, rows: ((lambda: torch.ops.aten._safe_softmax(rows, -1), 2),),
    "layer_norm": lambda x, y, rows: ((lambda: torch.nn.functional.layer_norm(rows, (256,)), 2),),
}
"""The ops each kind of ``mct.planner.work.KINDS`` is timed with (CPU,
``extra['elementwise_by_kind']``): a step's arithmetic runs several times the mix's rate,
its softmaxes and norms below it."""


def _elementwise_rate(device: str, nbytes: int, sync: Callable[[], None],
                      dtype: torch.dtype = torch.float32, kind: str = "") -> list[float]:
    """[bytes an op reads and writes, bytes/s] of a training step's usual elementwise ops
    on ``dtype`` tensors of ``nbytes`` (add, in-place multiply, GELU, softmax, layer norm:
    the fastest of a few repeats of the set), or of the ops of ``ELEMENTWISE_KINDS[kind]``.
    A CPU's bf16 kernels compute in fp32 and convert: per element they cost about what
    fp32's do, so per byte about twice."""
    n = nbytes // torch.finfo(dtype).bits * 8
    x, y = torch.randn(n, device=device).to(dtype), torch.randn(n, device=device).to(dtype)
    rows = x.view(-1, 256)
    ops = ELEMENTWISE_KINDS[kind](x, y, rows) if kind else _mix(x, y, rows)
    moved = sum(k for _, k in ops) * nbytes
    best = _fastest(lambda: [op() for op, _ in ops], max(1, 2**22 // nbytes), sync)
    return [moved / len(ops), moved / best]


def _attention_by_dim(dtype: torch.dtype) -> dict[str, list[list[float]]]:
    """{'forward'|'backward': [[d, FLOP/s], ...]} of causal ``scaled_dot_product_attention``
    on the CPU ([4, 4, 128, d], each d of ``ATTENTION_DIMS``; the fastest of 5), FLOPs by
    torch's counter (the full [S, S] scores: 2 matmuls forward, 5 backward); {} when it
    does not run in ``dtype``."""
    out: dict[str, list[list[float]]] = {"forward": [], "backward": []}
    for d in ATTENTION_DIMS:
        shape = (4, 4, 128, d)
        q, k, v = (torch.randn(shape).to(dtype).requires_grad_() for _ in range(3))
        try:
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            o.backward(torch.ones_like(o), retain_graph=True)
        except RuntimeError:
            return {}
        grad = torch.ones_like(o)
        fwd = _fastest(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), 1,
                       lambda: None)
        bwd = _fastest(lambda: torch.autograd.grad(o, (q, k, v), grad, retain_graph=True), 1, lambda: None)
        out["forward"].append([float(d), sdpa_flop_count(shape, shape, shape) / fwd])
        out["backward"].append([float(d), sdpa_backward_flop_count(shape, shape, shape, shape) / bwd])
    return out


def random_rate(device: str, sync: Callable[[], None], n: int = RANDOM_ELEMENTS) -> float:
    """Elements per second ``bernoulli_`` fills (fp32, ``n`` elements; the fastest of 5
    batches): the random-number generation of dropout's masks."""
    x = torch.empty(n, device=device)
    x.bernoulli_(0.9)
    return n / _fastest(lambda: x.bernoulli_(0.9), max(1, min(20, 2**18 // n)), sync)


MODE_STEP_REPS = 5
"""Forward-backward passes per timed batch of ``_mode_cost`` (the fastest of 5 batches)."""


def _tiny_transformer() -> tuple[torch.nn.Module, Callable[[torch.nn.Module], None]]:
    """A tiny transformer (two encoder layers of width 32 and a head) and one fp32
    forward-backward of it on a fixed batch: the mix of ops a training step dispatches
    (norms, softmax, matmuls, their gradients), each costing almost nothing but its dispatch."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
                                  for _ in range(2)], torch.nn.Linear(32, 64))
    x, y = torch.randn(2, 16, 32, generator=g), torch.randint(0, 64, (2, 16), generator=g)

    def step(forward: torch.nn.Module) -> None:
        out = forward(x)
        torch.nn.functional.cross_entropy(out.reshape(-1, 64), y.reshape(-1)).backward()

    return model, step


def _extra_per_op(plain: Callable[[], None], other: Callable[[], None], ops: int, tries: int = 5) -> float:
    """Seconds per op that ``other`` costs beyond ``plain``: (its time - ``plain``'s) over
    ``ops``, the fastest of ``tries`` batches each (never below 0). The batches alternate,
    one of each per try, so load from elsewhere that comes and goes during the measurement
    weighs on both alike (timed one after the other, all of ``other``'s batches first, the
    selective modes' extra once read 0 in the test suite on a shared 2-core machine)."""
    best_plain = best_other = float("inf")
    for _ in range(tries):
        best_other = min(best_other, _fastest(other, MODE_STEP_REPS, lambda: None, tries=1))
        best_plain = min(best_plain, _fastest(plain, MODE_STEP_REPS, lambda: None, tries=1))
    return max(0.0, (best_other - best_plain) / max(1, ops))


def _counted(run: Callable[[], None], counter: Callable[[], int]) -> int:
    """How far one ``run()`` advances ``counter()`` (a class counter of dispatched ops)."""
    before = counter()
    run()
    return counter() - before


def _mode_cost(context: Callable[[], Any]) -> float:
    """Seconds per op of the tiny transformer's forward-backward inside ``context()`` beyond
    it outside, over the ops the step dispatches (``_extra_per_op``)."""
    model, step = _tiny_transformer()
    plain = functools.partial(step, model)

    def inside() -> None:
        with context():
            plain()

    def counting() -> None:
        with UpcastMatmul():  # fp32 ops pass through it untouched: it counts the step's
            plain()

    plain()
    inside()
    return _extra_per_op(plain, inside, _counted(counting, lambda: UpcastMatmul.dispatched))


def python_mode_op_s() -> float:
    """Seconds one op costs passing through mct's Python dispatch mode beyond its plain
    dispatch (``UpcastMatmul``, which a bf16/fp16 step on a CPU without native units runs
    every forward and backward op through), measured on a tiny transformer's fp32
    forward-backward under the mode against without it (``_mode_cost``). On the AVX2 machine
    14.6-30 us an op, twice what a loop of tiny adds measured (ops of a real step carry more
    tensors), which predicted bf16 steps 15-20% fast."""
    return _mode_cost(UpcastMatmul)


def tracker_op_s() -> float:
    """Seconds one op costs passing through the CPU memory tracker's dispatch mode (it
    counts every new storage by category and phase: ``mct.memory.tracker``) beyond its plain
    dispatch: a tiny transformer's forward-backward inside a tracked phase against outside it
    (``_mode_cost``). `mct train` tracks only its logged steps
    (``Engine.train_step(track_memory=False)`` otherwise), a run with ``memory.enforce`` every one."""
    tracker = MemoryTracker("cpu")
    return _mode_cost(lambda: tracker.phase("forward"))


def selective_mode_op_s() -> float:
    """Seconds one op of a 'selective' region costs passing through torch's
    selective-checkpoint dispatch modes (the forward caches or marks its output, the
    recompute replays from that cache; ``mct.checkpointing.policies.SelectiveDispatch``)
    beyond the same region recomputed whole: a tiny transformer's forward-backward, its
    layers one checkpointed region with mct's selective context against without it, over
    the ops the modes dispatched (``_extra_per_op``). Host-side Python: the same on a CUDA host."""
    model, step = _tiny_transformer()
    kept = context_fn_for("selective")
    whole = functools.partial(step, lambda x: checkpoint(model, x, use_reentrant=False))
    selective = functools.partial(step, lambda x: checkpoint(model, x, use_reentrant=False, context_fn=kept))
    whole()
    selective()
    return _extra_per_op(whole, selective, _counted(selective, lambda: SelectiveDispatch.dispatched))


def _transfer_rate(host: torch.Tensor, sync: Callable[[], None]) -> float:
    """Bytes per second of a pinned host-to-device copy (the fastest of 5)."""
    dev = torch.empty_like(host, device="cuda")
    dev.copy_(host)
    return host.numel() / _fastest(lambda: dev.copy_(host, non_blocking=True), 1, sync)


def disk_rate(folder: Path | None = None, nbytes: int = 32 * 2**20) -> float:
    """Bytes per second written (and fsync'ed) to a file in ``folder`` (default the
    temporary directory), the fastest of 3; 0.0 when it cannot be written."""
    folder = Path(folder or tempfile.gettempdir())
    data = os.urandom(1 << 20) * (nbytes >> 20)
    best = float("inf")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f".disk-rate.{os.getpid()}"
        for _ in range(3):
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            best = min(best, time.perf_counter() - t0)
        path.unlink(missing_ok=True)
    except OSError:
        return 0.0
    return nbytes / best


def _copy_rate(device: str, nbytes: int, sync: Callable[[], None]) -> float:
    """Bytes per second one ``copy_`` of ``nbytes`` moves (the fastest of 7, after a warm-up)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return nbytes / _fastest(lambda: dst.copy_(src), max(1, 2**22 // nbytes), sync, tries=7)
