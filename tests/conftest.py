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
