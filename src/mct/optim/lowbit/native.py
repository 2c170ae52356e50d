"""The fused CPU kernels of ``LowPrecisionAdamW`` (``kernel.c``), built with the system C
compiler and called through ctypes.

Why: the same step in eager torch ops is ~30 elementwise passes per 64K-element chunk, each
paying a dispatch and a trip through the cache (7-12x torch's fused fp32 AdamW on one core
here); one pass per 256-element block, its fp32 moments in L1, takes 1.1-1.4x (int8) and
0.5-0.8x (bf16) of it (``benchmarks/optimizer_state.py``, a shared, noisy 2-core machine).
torch.compile of the chunk function was measured too: 17-25 s to compile cold and ~4 s per
process from its cache, full-size temporaries allocated per call, 2.7-4x fused, and its
weights differed from eager's in the last bit; this 100-line C file builds in ~0.4 s and
its arithmetic is spelled out.

Built once per machine into ``kernels/`` of mct's cache directory (``$MCT_CACHE_DIR``, else
``$XDG_CACHE_HOME/mct``, ``~/.cache/mct``; the temporary
directory when that is not writable), named by a hash of the source, the flags, the
compiler's version and the CPU's flags (``-march=native``), written to a temporary name and
renamed, its size and sha256 recorded beside it (``adamw-KEY.so.json``). Nothing cached is
trusted unchecked: before a cached library is mapped, its size, sha256 and symbols are checked
against that record (a truncated library would be a bus error, one without the symbols an
AttributeError); a damaged one is rebuilt, with one warning line. Where no compiler is found
or the build fails, ``load()`` returns None and the optimizer runs its torch reference, which
gives the same bytes (the flags keep every operation rounding once: ``-ffp-contract=off``, no
fast-math).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import torch

from mct.machine.cache import cache_file

SOURCE = Path(__file__).with_name("kernel.c")
FLAGS = ("-O3", "-std=c99", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math")
"""No -ffast-math: every + - * / sqrt rounds once, as the torch reference's ops do.
-fno-math-errno / -fno-trapping-math only let sqrtf and floorf vectorize."""
_P, _I = ctypes.c_void_p, ctypes.c_int64
BLOCK = 256
"""kernel.c's block (codec.BLOCK)."""
MIN_BLOCKS = 256
"""Fewest blocks (64K elements) a thread is given: below, a thread costs more than it saves."""


class Kernels:
    """The loaded library. ``path``: the shared object; ``build_s``: seconds ``load()`` took
    (the compile where it was not cached; a few milliseconds where it was)."""

    def __init__(self, path: Path, build_s: float) -> None:
        self.path, self.build_s = path, build_s
        self._lib = ctypes.CDLL(str(path))
        self._lib.adamw_int8.argtypes = [_P] * 8 + [_I] * 4 + [_P]
        self._lib.adamw_bf16.argtypes = [_P] * 6 + [_I] * 4 + [_P]
        self._lib.adamw_int8.restype = self._lib.adamw_bf16.restype = None
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0

    def int8(self, p: torch.Tensor, g: torch.Tensor, st: dict[str, torch.Tensor], noise: torch.Tensor,
             om: int, ov: int, period: int, h: torch.Tensor) -> None:
        """One step over a whole flat fp32 shard ``p`` (its grad ``g``) with int8 state ``st``;
        ``noise``: the doubled uniform table, ``om`` / ``ov``: each moment's offset into it;
        ``h``: fp32 [10] (kernel.c). Mutates p and st."""
        per_block = [(p, 4 * BLOCK), (g, 4 * BLOCK), (st["exp_avg"], BLOCK), (st["exp_avg_scale"], 4),
                     (st["exp_avg_sq"], BLOCK), (st["exp_avg_sq_scale"], 4)]
        self._run(self._lib.adamw_int8, per_block, noise, om, ov, period, p.numel() // BLOCK, h)

    def bf16(self, p: torch.Tensor, g: torch.Tensor, st: dict[str, torch.Tensor], bits16: torch.Tensor,
             om: int, ov: int, period: int, h: torch.Tensor) -> None:
        """As ``int8`` for bf16 state; ``bits16``: the doubled int32 table of rounding bits."""
        per_block = [(p, 4 * BLOCK), (g, 4 * BLOCK), (st["exp_avg"], 2 * BLOCK), (st["exp_avg_sq"], 2 * BLOCK)]
        self._run(self._lib.adamw_bf16, per_block, bits16, om, ov, period, p.numel() // BLOCK, h)

    def _run(self, fn: Any, per_block: list[tuple[torch.Tensor, int]], table: torch.Tensor, om: int, ov: int,
             period: int, nblocks: int, h: torch.Tensor) -> None:
        """``fn`` over the blocks, cut into torch.get_num_threads() ranges of at least
        MIN_BLOCKS (blocks are independent: the cut changes no byte); ctypes releases the GIL."""
        base = [t.data_ptr() for t, _ in per_block]

        def blocks(j0: int, j1: int) -> None:
            fn(*(b + j0 * size for b, (_, size) in zip(base, per_block)), table.data_ptr(), table.data_ptr(),
               om + j0 * BLOCK, ov + j0 * BLOCK, period, j1 - j0, h.data_ptr())
        k = max(1, min(torch.get_num_threads(), nblocks // MIN_BLOCKS))
        if k == 1:
            blocks(0, nblocks)
            return
        if self._pool_size < k:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool, self._pool_size = ThreadPoolExecutor(k, thread_name_prefix="mct-adamw"), k
        cuts = [nblocks * i // k for i in range(k + 1)]
        list(self._pool.map(blocks, cuts[:-1], cuts[1:]))


def compiler() -> str | None:
    """``$CC``, else the first of cc, gcc, clang on PATH; None when there is none."""
    return os.environ.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)


def _cache_dir() -> Path:
    base = cache_file().parent / "kernels"  # beside the machine profile ($MCT_CACHE_DIR, ...)
    try:
        base.mkdir(parents=True, exist_ok=True)
        if os.access(base, os.W_OK):
            return base
    except OSError:
        pass
    tmp = Path(tempfile.gettempdir()) / f"mct-kernels-{os.getuid() if hasattr(os, 'getuid') else 0}"
    tmp.mkdir(parents=True, exist_ok=True)
    return tmp


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine if hasattr(os, "uname") else "?"


def _key(cc: str, flags: tuple[str, ...]) -> str:
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = "?"
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(flags).encode(), cc.encode(), version.encode(), _cpu_flags().encode()):
        h.update(part + b"\0")
    return h.hexdigest()[:20]


SYMBOLS = ("adamw_int8", "adamw_bf16")
"""The functions of kernel.c a cached library must export."""


def _record_of(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def _digest(data: bytes) -> dict[str, Any]:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _damage(path: Path) -> str | None:
    """Why the cached library ``path`` must not be loaded (None: it may): its record
    (``path.json``, written when it was built) missing or unreadable, its size or sha256
    not the recorded ones (a truncated file would be a bus error once mapped), or a symbol
    of ``SYMBOLS`` absent. Reads the file; never maps it."""
    try:
        record = json.loads(_record_of(path).read_text())
        data = path.read_bytes()
    except (OSError, ValueError) as e:
        return f"no readable record of its size and sha256 ({type(e).__name__})"
    if not isinstance(record, dict) or not isinstance(record.get("size"), int):
        return "its record of size and sha256 is damaged"
    if len(data) != record["size"]:
        return f"{len(data)} bytes, {record['size']} when it was built"
    if hashlib.sha256(data).hexdigest() != record.get("sha256"):
        return "its sha256 is not the one recorded when it was built"
    missing = [name for name in SYMBOLS if name.encode() + b"\0" not in data]
    return f"it has no symbol {missing[0]}" if missing else None


def _build(cc: str, flags: tuple[str, ...], out: Path) -> bool:
    """Compile kernel.c to a temporary name, record its size and sha256 beside ``out``
    (``out.json``), then rename it to ``out``. False when the compiler fails."""
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    try:
        done = subprocess.run([cc, *flags, "-o", str(tmp), str(SOURCE), "-lm"], capture_output=True, timeout=300)
        if done.returncode != 0:
            return False
        record = _record_of(tmp)
        record.write_text(json.dumps(_digest(tmp.read_bytes())))
        os.replace(record, _record_of(out))
        os.replace(tmp, out)
        return True
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        tmp.unlink(missing_ok=True)
        _record_of(tmp).unlink(missing_ok=True)


def _open(path: Path, t0: float) -> Kernels | None:
    try:
        return Kernels(path, time.perf_counter() - t0)
    except (OSError, AttributeError):  # verified first: only a library changed since
        return None


def load(cache_dir: Path | None = None) -> Kernels | None:
    """The kernels, built first where this machine has none cached (``cache_dir``: where,
    default as above); None where no C compiler is found or it cannot build them. A cached
    library is loaded only once ``_damage`` finds nothing wrong; a damaged one is rebuilt (or,
    where that fails, the caller runs the torch reference) with one ``mct: warning:`` line on
    stderr. Ranks of one machine take turns (a lock file beside the library), so one rebuilds
    and says so, the others load what it built."""
    cc = compiler()
    if cc is None:
        return None
    cache = cache_dir or _cache_dir()
    t0 = time.perf_counter()
    damaged: list[str] = []
    for flags in ((*FLAGS, "-march=native"), FLAGS):  # a compiler without -march=native: the generic target
        path = cache / f"adamw-{_key(cc, flags)}.so"
        with _turn(path):
            why = _damage(path) if path.exists() else None
            if why:
                damaged.append(f"{path}: {why}")
            cached = path.exists() and not why
            built = not cached and _build(cc, flags, path)
            if cached or built:
                kernels = _open(path, t0) if _damage(path) is None else None
                if damaged:
                    print(f"mct: warning: the compiled optimizer kernel {damaged[0]}; "
                          + ("the optimizer runs its torch reference (the same bytes)" if kernels is None else
                             "rebuilt it" if built and len(damaged) == 1 else f"loaded {path.name} instead"),
                          file=sys.stderr)
                return kernels
    if damaged:
        print(f"mct: warning: the compiled optimizer kernel {damaged[0]}; it could not be rebuilt, so the "
              f"optimizer runs its torch reference (the same bytes)", file=sys.stderr)
    return None


@contextlib.contextmanager
def _turn(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path.lock`` (no lock where the file cannot be made)."""
    try:
        f = open(path.with_name(path.name + ".lock"), "a")
    except OSError:
        yield
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
