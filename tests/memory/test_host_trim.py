"""The heap trims between the steps (``mct.memory.host.trim_between``): where a run does something
other than a step (a validation pass, a checkpoint save, the export), the steps' freed heap is
given back first, in every ``memory.host_malloc`` mode but 'cache'."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mct.config import EngineConfig
from mct.memory import host

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.mark.parametrize("mode, trims", [("default", 1), ("lean", 1), ("frugal", 1), ("cache", 0)])
def test_trim_between_trims_in_every_mode_but_cache(monkeypatch, mode, trims):
    calls: list[int] = []
    monkeypatch.setattr(host, "trim", lambda: calls.append(1))
    host.trim_between(mode)
    assert len(calls) == trims


def test_a_run_trims_after_each_validation_and_before_each_save_and_the_export(monkeypatch, tmp_path, corpus_dir):
    """The order of events in a tiny run with two validations and two checkpoint saves: each save
    and the export come right after a trim, each validation is followed by one."""
    import mct.run.components as components
    import mct.run.trainer as trainer
    events: list[str] = []

    def recorded(owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            out = original(*args, **kwargs)
            events.append(label)
            return out
        monkeypatch.setattr(owner, name, wrapper)
    monkeypatch.setattr(host, "trim_between", lambda mode: events.append(f"trim {mode}"))
    recorded(components.Validator, "run", "validate")
    recorded(trainer.RunCheckpointer, "save", "save")
    recorded(trainer, "export_engine", "export")
    cfg = EngineConfig.from_dict({
        "seed": 5, "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "seq_len": 16},
        "data": {"path": str(corpus_dir), "micro_batch_size": 2},
        "train": {"steps": 4, "warmup_steps": 1, "eval_every": 2, "eval_batches": 1, "checkpoint_every": 2}})
    trainer.train(cfg, tmp_path / "run", progress=False)
    assert events.count("validate") == 3 and events.count("save") == 2 and events.count("export") == 1
    for i, event in enumerate(events):
        if event in ("save", "export"):
            assert events[i - 1] == "trim default", events
        if event == "validate":
            assert events[i + 1] == "trim default", events


@pytest.mark.skipif(host._libc() is None, reason="glibc only: elsewhere trim_between does nothing")
def test_trim_between_gives_freed_heap_chunks_back_except_under_cache():
    """In a fresh interpreter: 64 MiB of 64 KiB heap chunks (below glibc's mmap threshold), each
    written, then freed but the last (it pins the heap's top, so free() alone keeps them all
    resident). ``trim_between('default')`` gives them back; ``'cache'`` keeps them."""
    code = (
        "import ctypes, sys\n"
        "from mct.memory import host\n"
        "libc = host._libc(); libc.malloc.restype = ctypes.c_void_p; libc.free.argtypes = [ctypes.c_void_p]\n"
        "def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096\n"
        "def churn():\n"
        "    blocks = [libc.malloc(65536) for _ in range(1024)]\n"
        "    for b in blocks: ctypes.memset(b, 1, 65536)\n"
        "    for b in blocks[:-1]: libc.free(b)\n"
        "for mode in sys.argv[1:]:\n"
        "    churn(); before = rss(); host.trim_between(mode); print(mode, (before - rss()) // 2**20)\n")
    out = subprocess.run([sys.executable, "-c", code, "cache", "default"], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=str(SRC)))
    assert out.returncode == 0, out.stderr
    given_back = {mode: int(mib) for mode, mib in (line.split() for line in out.stdout.splitlines())}
    assert given_back["cache"] < 8 and given_back["default"] > 32, given_back
