"""Fine-tune an HF model on your own data, as a user types it: a tiny Llama with a BPE
tokenizer trained here and a folder of raw JSON Lines go through `mct prepare
--tokenizer DIR`, `mct plan --budget`, `mct train --nproc 2 zero.stage=auto` killed
mid-run and `mct train --resume`, `mct report`, `mct export --format hf`, transformers'
`from_pretrained` and `mct sample`. Every command exits 0 (the kill with the launcher's
1 and one line naming the resume command), no warning is printed, the resumed run ends
with the uninterrupted run's bytes, the export loads with the source's special tokens,
and raw JSONL given to the HF model trains on the model's own tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from mct.data.model_data import CACHE_DIR  # noqa: E402
from tests.task.test_hf_own_tokens import _documents, save_tiny_llama_with_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BUDGET = "1.5GiB"
STEPS = 6
KILL_AT = 4
ALLOWED_WARNINGS = (
    "mct: warning: steps took ",
    f"mct: warning: skipped checkpoint(s) step_{KILL_AT:08d} (not trusted: no step after it passed); "
    f"resuming from step_{KILL_AT - 2:08d}",
)
"""The warning lines that apply on this journey (prefixes): the step-time forecast's, since
the suite's machine profile holds made-up rates (tests/conftest.py; a user's is measured);
the resume's, since rank 0 was killed before any step confirmed the checkpoint written
just before (the kill's line names the same step as the last good one). No other applies."""


@dataclass
class Journey:
    """The journey's directories and each command's (exit code, stdout, stderr) by name."""

    root: Path
    steps: dict[str, tuple[int, str, str]] = field(default_factory=dict)

    def mct(self, name: str, *args: str, fault: str = "") -> tuple[int, str, str]:
        """Run `python -m mct ARGS` in ``root`` (one thread, this checkout's src first, the
        fault ``fault`` injected when given); record and return its result (also in
        ``root/NAME.log``, for the reader of a failure)."""
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("MCT_FAULT", None)
        if fault:
            env["MCT_FAULT"] = fault
        p = subprocess.run([sys.executable, "-m", "mct", *args], cwd=self.root, env=env, capture_output=True,
                           text=True, timeout=300)
        self.steps[name] = (p.returncode, p.stdout, p.stderr)
        (self.root / f"{name}.log").write_text(f"$ mct {' '.join(args)}\nexit {p.returncode}\n{p.stdout}{p.stderr}")
        return self.steps[name]


def _train_flags(run: str) -> list[str]:
    """`mct train`'s flags of the journey's run into ``run``: 2 ranks, the model's own
    weights, the prepared dataset, ZeRO stage chosen for the budget."""
    return ["--nproc", "2", "--model", "hf:llama", "--init-from", "llama", "--run-dir", run, "--no-progress",
            "--set", "data.path=ds", "--set", "zero.stage=auto", "--set", f"memory.budget={BUDGET}",
            "--set", "model.seq_len=16", "--set", "data.micro_batch_size=2", "--set", f"train.steps={STEPS}",
            "--set", "train.checkpoint_every=2", "--set", "train.eval_every=3", "--set", "train.eval_batches=1",
            "--set", "seed=3"]


@pytest.fixture(scope="module")
def journey(tmp_path_factory) -> Journey:
    """The whole journey, run once; each test checks one of its promises."""
    j = Journey(tmp_path_factory.mktemp("journey"))
    save_tiny_llama_with_tokenizer(j.root / "llama")
    (j.root / "data").mkdir()
    for i in range(3):  # JSON Lines with a second field, as exported data often has
        lines = [json.dumps({"id": k, "text": t}) for k, t in enumerate(_documents(30, i))]
        (j.root / "data" / f"part{i}.jsonl").write_text("\n".join(lines) + "\n")
    j.mct("prepare", "prepare", "data", "--tokenizer", "llama", "--out", "ds")
    j.mct("plan", "plan", "--model", "hf:llama", "--init-from", "llama", "--set", "data.path=ds",
          "--set", "model.seq_len=16", "--set", "data.micro_batch_size=2", "--world-size", "2", "--budget", BUDGET)
    j.mct("killed", "train", *_train_flags("killed"), fault=f"kill@{KILL_AT}:0")
    j.mct("clean", "train", *_train_flags("clean"))
    j.mct("resume", "train", "--resume", "killed", "--no-progress")
    j.mct("report", "report", "killed")
    j.mct("export", "export", "killed", "--format", "hf", "--out", "tuned")
    j.mct("sample", "sample", "killed", "--tokens", "5")
    j.mct("raw", "train", "--model", "hf:llama", "--init-from", "llama", "--run-dir", "raw", "--no-progress",
          "--set", "data.path=data", "--set", "model.seq_len=16", "--set", "data.micro_batch_size=2",
          "--set", "train.steps=2", "--set", "train.eval_every=0")
    return j


@pytest.mark.cli
@pytest.mark.slow
def test_every_command_exits_0_and_the_kill_names_the_resume_command(journey):
    for name, (rc, out, err) in journey.steps.items():
        if name != "killed":
            assert rc == 0, f"{name}: {err[-2000:]}"
    rc, _, err = journey.steps["killed"]
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 1 and lines[-1].startswith("mct: error: worker rank 0 was killed by SIGKILL "), err
    assert f"the last good checkpoint is {Path('killed', 'checkpoints', f'step_{KILL_AT - 2:08d}')}; " in lines[-1]
    assert lines[-1].endswith("continue with: mct train --resume killed"), err
    assert "zero.stage" in journey.steps["plan"][1] and "recommended" in journey.steps["plan"][1]
    assert "\nauto          zero.stage=" in journey.steps["clean"][1]  # what auto chose, in the summary
    assert journey.steps["sample"][1].strip()


@pytest.mark.cli
@pytest.mark.slow
def test_no_warning_is_printed_that_does_not_apply(journey):
    said = [f"{name}: {line}" for name, (_, out, err) in journey.steps.items()
            for line in (out + err).splitlines() if "warning" in line.lower()]
    assert [s for s in said if not s.split(": ", 1)[1].startswith(ALLOWED_WARNINGS)] == []


@pytest.mark.cli
@pytest.mark.slow
def test_the_resumed_run_ends_with_the_uninterrupted_runs_weights(journey):
    killed, clean = journey.root / "killed", journey.root / "clean"
    steps = [json.loads(line)["step"] for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == STEPS - 1 and min(steps) == 0
    assert (killed / "model.safetensors").read_bytes() == (clean / "model.safetensors").read_bytes()
    assert not list((killed / "checkpoints").glob("*.untrusted"))


@pytest.mark.cli
@pytest.mark.slow
def test_the_export_loads_with_transformers_and_the_sources_special_tokens(journey):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    source = AutoTokenizer.from_pretrained(str(journey.root / "llama"))
    tok = AutoTokenizer.from_pretrained(str(journey.root / "tuned"))
    assert tok.special_tokens_map == source.special_tokens_map
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        source.bos_token_id, source.eos_token_id, source.pad_token_id) == (1, 2, 0)
    model = AutoModelForCausalLM.from_pretrained(str(journey.root / "tuned"))
    trained = load_file(str(journey.root / "killed" / "model.safetensors"))
    got = dict(model.named_parameters())
    assert all(torch.equal(got[k], v) for k, v in trained.items())


@pytest.mark.cli
@pytest.mark.slow
def test_raw_jsonl_trains_the_hf_model_on_its_own_tokens(journey):
    """The raw folder's cached tokens are the prepared dataset's: the model's BPE ids, each
    document ended by EOS (never the JSON syntax, never bytes)."""
    import numpy as np
    cached = [p for p in (journey.root / CACHE_DIR).iterdir() if p.is_dir()]
    assert len(cached) == 1
    assert (cached[0] / "tokens.bin").read_bytes() == (journey.root / "ds" / "tokens.bin").read_bytes()
    tokens = np.fromfile(journey.root / "ds" / "tokens.bin", dtype=np.uint16)
    assert int(tokens.max()) >= 256 and int((tokens == 2).sum()) == 90  # merged ids; one EOS per document
    steps = (journey.root / "raw" / "metrics.jsonl").read_text().splitlines()
    assert len(steps) == 2
