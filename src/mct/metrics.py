"""Run metrics and metadata.

``RUN_DIR/metrics.jsonl``: one JSON object a line (keys in the README); rank 0 writes
it, every other rank writes ``metrics.rank{r}.jsonl`` so per-rank memory can be read.
``RUN_DIR/metadata.json``: seed, resolved config, versions, world size, backend,
device, start time, git commit, corpus fingerprint. Optional TensorBoard events.
"""

from __future__ import annotations

import json
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

import mct


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
        return str(v)  # JSON has no NaN/inf; keep them visible as strings
    return v


class MetricsWriter:
    """Appends metric records to JSONL (and TensorBoard when asked)."""

    def __init__(self, run_dir: str | Path, rank: int = 0, tensorboard: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        name = "metrics.jsonl" if rank == 0 else f"metrics.rank{rank}.jsonl"
        self.path = self.run_dir / name
        self._file = open(self.path, "a", buffering=1)
        self._tb = None
        if tensorboard and rank == 0:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(str(self.run_dir / "tb"))

    def log(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(_jsonable(record)) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                    self._tb.add_scalar(k, v, record["step"])

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def write_metadata(run_dir: str | Path, *, config: dict, world_size: int, backend: str, device: str,
                   extra: dict[str, Any] | None = None) -> dict[str, Any]:
    meta = {
        "seed": config.get("seed"),
        "config": config,
        "versions": {"mct": mct.__version__, "torch": torch.__version__, "python": platform.python_version()},
        "git_commit": git_commit(),
        "world_size": world_size,
        "backend": backend,
        "device": device,
        "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        **(extra or {}),
    }
    path = Path(run_dir) / "metadata.json"
    path.write_text(json.dumps(_jsonable(meta), indent=2) + "\n")
    return meta


def flatten_peaks(peaks: dict[str, dict[str, int]]) -> dict[str, int]:
    """{'forward': {'total': 5, 'activations': 3}} -> {'peak_forward_total': 5, ...}"""
    return {f"peak_{stage}_{cat}": v for stage, cats in peaks.items() for cat, v in cats.items()}


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
