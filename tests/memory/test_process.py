"""``mct.memory.process``: a process's peak resident set from /proc, and a job's sum."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mct.memory.process import LAUNCHER_PID_ENV, job_resident, resident_peak, status_bytes

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")


def test_resident_peak_is_at_least_the_current_resident_set_and_grows_with_touched_memory():
    before, rss = resident_peak(), status_bytes("VmRSS")
    block = bytearray(64 * 2**20)  # zero-filled: every page touched
    after = resident_peak()
    # the peak holds what is resident now, the block included (an earlier, higher peak may hide the growth)
    assert status_bytes("VmRSS") <= after and after >= max(before, rss + 32 * 2**20)
    del block
    assert resident_peak(2**31) is None and status_bytes("NoSuchField") is None


def test_job_resident_adds_the_launcher_and_an_agent_between_it_and_the_worker(monkeypatch):
    monkeypatch.setenv(LAUNCHER_PID_ENV, str(os.getppid()))  # our parent plays the launcher: no agent
    job = job_resident([100, 200])
    assert job["launcher"] > 0 and job["agent"] is None and job["total"] == 300 + job["launcher"]
    monkeypatch.setenv(LAUNCHER_PID_ENV, "1")  # another process above the parent: the parent is an agent
    job = job_resident([100, None])
    assert job["agent"] > 0 and job["total"] == 100 + job["agent"] + (job["launcher"] or 0)
    monkeypatch.delenv(LAUNCHER_PID_ENV)  # not launched: the workers alone
    assert job_resident([100]) == {"workers": [100], "launcher": None, "agent": None, "total": 100}


@pytest.mark.slow
def test_a_gpt_training_process_never_imports_dynamo_plotting_tensorboard_transformers_or_tokenizers(tmp_path, corpus_dir):
    """What training does not need is never loaded (docs/memory.md: torch._dynamo about 70 MiB,
    matplotlib about 52 MiB, transformers' Llama about 156 MiB, tensorboard about 15 MiB beyond
    torch; tokenizers about 3 MiB and safetensors about 1 MiB on a byte corpus), through the
    optimizer, the tracker, the FLOP count and step-time dry run (fake tensors, in a forked
    child), an evaluation, a checkpoint save and the export."""
    import subprocess
    import sys
    code = ("import sys\nfrom mct.cli import main\n"
            f"rc = main(['train', '--run-dir', {str(tmp_path / 'run')!r}, '--no-progress', '--set', "
            f"'data.path={corpus_dir}', '--set', 'model.n_layer=1', '--set', 'model.d_model=32', '--set', "
            "'model.n_head=2', '--set', 'model.seq_len=16', '--set', 'data.micro_batch_size=2', '--set', "
            "'train.steps=2', '--set', 'train.eval_every=2', '--set', 'train.checkpoint_every=2'])\n"
            "print(rc, *sorted(m for m in ('torch._dynamo', 'matplotlib', 'tensorboard', 'transformers', "
            "'torch.utils.tensorboard', 'tokenizers', 'safetensors') "
            "if m in sys.modules))")
    src = Path(__file__).resolve().parents[2] / "src"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1"))
    assert out.stdout.split()[-1:] == ["0"], out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["all", "selective"])
def test_a_recomputing_gpt_training_process_never_imports_dynamo(tmp_path, corpus_dir, policy):
    """A run that recomputes (docs/memory.md: torch's checkpoint reads ``torch._dynamo.config``,
    wraps its recompute and its selective dispatch modes for dynamo) trains through mct's own
    checkpoint frame (``mct.checkpointing.frame``) and never loads torch._dynamo."""
    import subprocess
    import sys
    code = ("import sys\nfrom mct.cli import main\n"
            f"rc = main(['train', '--run-dir', {str(tmp_path / 'run')!r}, '--no-progress', '--set', "
            f"'data.path={corpus_dir}', '--set', 'model.n_layer=2', '--set', 'model.d_model=32', '--set', "
            "'model.n_head=2', '--set', 'model.seq_len=16', '--set', 'model.dropout=0.1', '--set', "
            f"'data.micro_batch_size=2', '--set', 'train.steps=2', '--set', 'checkpointing.policy={policy}'])\n"
            "print(rc, 'torch._dynamo' in sys.modules)")
    src = Path(__file__).resolve().parents[2] / "src"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1"))
    assert out.stdout.split()[-2:] == ["0", "False"], out.stdout[-2000:] + out.stderr[-2000:]
