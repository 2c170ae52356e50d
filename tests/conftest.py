"""Fixtures shared by the training-loop tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    """A small text corpus of 12 files (file-level train/val split), one per test module."""
    d = tmp_path_factory.mktemp("corpus")
    for i in range(12):
        (d / f"f{i:02d}.txt").write_text(f"file {i}: " + "the quick brown fox jumps over the lazy dog. " * 40)
    return d


@pytest.fixture(scope="session", autouse=True)
def machine_profile_cache(tmp_path_factory) -> Path:
    """Machine profiles (MFU's peak) live in a temporary cache for the whole session
    (subprocesses inherit ``MCT_CACHE_DIR``), seeded with ``SEEDED_RATES`` for this
    machine: no test writes the user's cache, and none waits for a measurement unless it
    asks for one (tests/machine)."""
    import json
    import os

    from mct.machine import MachineProfile, cpu_identity, usable_cores
    from tests.helpers import SEEDED_RATES

    d = tmp_path_factory.mktemp("mct-cache")
    ident = cpu_identity()
    import torch
    p = MachineProfile(device="cpu", name=ident["model"], flags=ident["flags"], torch_version=torch.__version__,
                       threads=usable_cores(), matmul_one=dict(SEEDED_RATES),
                       matmul_all={k: v * usable_cores() for k, v in SEEDED_RATES.items()},
                       matmul_size={k: 1024 for k in SEEDED_RATES}, memcpy_bytes_per_s=5e9)
    (d / "machine.json").write_text(json.dumps({"version": 1, "profiles": {p.key: p.to_dict()}}))
    os.environ["MCT_CACHE_DIR"] = str(d)
    return d
