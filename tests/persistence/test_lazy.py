"""The DCP layer is imported on first use: a process that never saves or loads a
checkpoint does not pay torch.distributed.checkpoint's import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a fresh interpreter importing torch: seconds
def test_engine_and_trainer_import_without_dcp_and_load_it_on_first_use():
    code = ("import sys; import mct.engine, mct.run.trainer, mct.persistence.resume; "
            "before = 'torch.distributed.checkpoint' in sys.modules; "
            "from mct.persistence import checkpoint, save_engine, MANIFEST; "
            "assert callable(save_engine) and MANIFEST == 'meta.json'; "
            "assert checkpoint.shards.SafeReader.__name__ == 'SafeReader'; "
            "print(before, 'torch.distributed.checkpoint' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"], out.stdout
