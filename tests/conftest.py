"""Fixtures shared by the training-loop tests."""

from __future__ import annotations

import json
import os
import signal
import warnings

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one pytest worker per core (pytest-xdist): each worker's torch, and the
    # `python -m mct` runs it starts, use one thread, so workers do not fight over the cores
    os.environ.setdefault("OMP_NUM_THREADS", "1")
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

from mct.machine import MachineProfile, cpu_identity, usable_cores
from mct.memory.baseline import baseline_key
from tests.helpers import SEEDED_EXTRA, SEEDED_RATES


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    """A small text corpus of 12 files (file-level train/val split), one per test module."""
    d = tmp_path_factory.mktemp("corpus")
    for i in range(12):
        (d / f"f{i:02d}.txt").write_text(f"file {i}: " + "the quick brown fox jumps over the lazy dog. " * 40)
    return d


SEEDED_BASELINE = 300 * 2**20
"""The runtime baseline the test cache holds (made up, near this machine's): plans give process
peaks without a measurement."""
SEEDED_BASELINE_MODULES = tuple(m + d for m in ((), ("transformers.models.llama.modeling_llama",),
                                                 ("transformers.models.gpt2.modeling_gpt2",))
                                for d in ((), ("torch._dynamo",)))
"""Each library's baseline, and with torch._dynamo (a recomputing run's), and without the
checkpoint writer (``writer=False``; seeded equal: no dynamo or writer term in the tests'
process peaks unless a test seeds its own)."""


@pytest.fixture(scope="session", autouse=True)
def machine_profile_cache(tmp_path_factory) -> Iterator[Path]:
    """Machine profiles (MFU's peak) live in a temporary cache for the whole test run
    (subprocesses inherit ``MCT_CACHE_DIR``), seeded with ``SEEDED_RATES`` for this
    machine: no test writes the user's cache, and none waits for a measurement unless it
    asks for one (tests/machine); the runtime baseline is seeded too (``SEEDED_BASELINE``).
    It is pinned: a run whose steps disagree with these made-up
    rates says so but never marks it suspect, so no later test re-measures the machine."""
    d = tmp_path_factory.mktemp("mct-cache")
    ident, cores = cpu_identity(), usable_cores()
    p = MachineProfile(device="cpu", name=ident["model"], flags=ident["flags"], torch_version=torch.__version__,
                       threads=cores, matmul_one=dict(SEEDED_RATES),
                       matmul_all={k: v * cores for k, v in SEEDED_RATES.items()},
                       matmul_size={k: 1024 for k in SEEDED_RATES}, memcpy_bytes_per_s=5e9,
                       extra=dict(SEEDED_EXTRA), pinned=True)
    (d / "machine.json").write_text(json.dumps({"version": 1, "profiles": {p.key: p.to_dict()}}))
    (d / "baseline.json").write_text(json.dumps({baseline_key(m, w): SEEDED_BASELINE for m in SEEDED_BASELINE_MODULES
                                                 for w in (True, False)}))
    before = os.environ.get("MCT_CACHE_DIR")
    os.environ["MCT_CACHE_DIR"] = str(d)
    yield d
    if before is None:
        os.environ.pop("MCT_CACHE_DIR", None)
    else:
        os.environ["MCT_CACHE_DIR"] = before


def _sigint_state() -> tuple:
    """SIGINT as this thread sees it: Python's handler, the thread's signal mask, and whether
    the process ignores it at the C level (``SigIgn`` in /proc: a library can set SIG_IGN
    behind Python's back, and every subprocess then inherits it)."""
    ignored = None
    try:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("SigIgn:"))
        ignored = bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    except (OSError, StopIteration, ValueError):
        pass
    return signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, []), ignored


if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None):
    # a suite started in the background by a shell without job control (`make test &` in a
    # script) inherits SIGINT ignored, and so would every process the tests signal
    signal.signal(signal.SIGINT, signal.default_int_handler)
_SIGINT_AT_START = _sigint_state()


@pytest.fixture(autouse=True)
def sigint_as_at_start(request) -> Iterator[None]:
    """Every test starts with Ctrl-C as the session started with it (handler, signal mask,
    not ignored): tests that signal a process (``mct prepare``, the planner's workers, the
    launcher) rely on it. A change left behind by whatever ran before in this worker is
    undone and named in a warning, so the leak can be found rather than failing an
    unrelated test."""
    now = _sigint_state()
    if now != _SIGINT_AT_START:
        warnings.warn(f"SIGINT state {now} differs from the session's {_SIGINT_AT_START} before "
                      f"{request.node.nodeid}: restored")
        signal.signal(signal.SIGINT, _SIGINT_AT_START[0])  # sigaction again: also undoes a C-level SIG_IGN
        signal.pthread_sigmask(signal.SIG_SETMASK, _SIGINT_AT_START[1])
    yield


HEAVY_MARKS = ("multirank", "cli", "slow")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks it adds
def pytest_collection_modifyitems(config, items) -> None:
    """Modules with a multi-rank, CLI or slow test first, each module's tests kept together
    and in their own order (module fixtures are built once per worker), the quick modules
    last: with ``--dist loadgroup`` (the Makefile) the two workers then end on short
    tests, instead of one waiting for the other's minute-long run. The order is the same
    in every worker (pytest-xdist compares them)."""
    heavy: dict[str, bool] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        heavy[module] = heavy.get(module, False) or any(item.get_closest_marker(m) for m in HEAVY_MARKS)
    rank = {module: i for i, module in enumerate(heavy)}
    items.sort(key=lambda item: (not heavy[item.nodeid.split("::")[0]], rank[item.nodeid.split("::")[0]]))
    for item in items:
        if _uses_a_module_fixture_of_its_own(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def _uses_a_module_fixture_of_its_own(item) -> bool:
    """Does ``item`` use a module-scoped fixture its own module defines (a 2-rank spawn whose
    results several tests check, a reference run)? Such tests go to one worker together
    (``xdist_group``), so the fixture is built once, not once per worker."""
    module = item.nodeid.split("::")[0]
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    autouse = set(info.initialnames) - set(info.argnames)  # a module's own settings (one thread), not work
    defs = [d[-1] for name, d in info.name2fixturedefs.items() if d and name not in autouse]
    return any(d.scope == "module" and d.baseid == module for d in defs)
