"""Run metrics and metadata.

``RUN_DIR/metrics.jsonl``: one JSON object a line (keys in docs/metrics.md); rank 0 writes
it, every other rank writes ``metrics.rank{r}.jsonl`` so per-rank memory can be read.
``RUN_DIR/metadata.json``: seed, resolved config, versions, world size, backend,
device, start time, git commit, corpus fingerprint. Optional TensorBoard events.

JSON has no NaN or infinity. Every writer here passes its records through
``encode_row``: a non-finite float is written as ``null`` and its key (dotted for
nested dicts, e.g. ``memory.forward.total``) is listed in the row's ``nonfinite``
list; ``decode_row`` turns those back into ``nan``. ``read_jsonl`` reads a file line
by line, keeps every row it can parse and returns what it skipped, by line number.
"""

from __future__ import annotations

import json
import math
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from mct import __version__


def _jsonable(v: Any) -> Any:
    """Tensors -> numbers/lists, tuples -> lists, dict keys -> str (floats untouched)."""
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    return v


def _nulls(v: Any, path: str, found: list[str]) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        found.append(path)
        return None
    if isinstance(v, dict):
        return {k: _nulls(x, f"{path}.{k}" if path else k, found) for k, x in v.items()}
    if isinstance(v, list):
        return [_nulls(x, f"{path}.{i}", found) for i, x in enumerate(v)]
    return v


def encode_row(record: dict[str, Any]) -> dict[str, Any]:
    """A record -> a JSON-safe dict: tensors become numbers, every non-finite float
    becomes ``None`` and its (dotted) key is appended to ``row["nonfinite"]``. The
    input is not mutated. ``json.dumps(encode_row(r), allow_nan=False)`` never fails
    on a float."""
    found: list[str] = list(record.get("nonfinite") or [])
    row = _nulls(_jsonable({k: v for k, v in record.items() if k != "nonfinite"}), "", found)
    if found:
        row["nonfinite"] = found
    return row


def dumps_row(record: dict[str, Any], **kwargs: Any) -> str:
    """``json.dumps`` of ``encode_row(record)``; strict JSON (no NaN/Infinity tokens)."""
    return json.dumps(encode_row(record), allow_nan=False, **kwargs)


_LEGACY_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def decode_row(row: dict[str, Any]) -> dict[str, Any]:
    """Inverse of ``encode_row`` for readers: each key listed in ``nonfinite`` becomes
    ``nan`` (top-level and dotted nested keys). Older files wrote non-finite numbers
    as the strings "nan"/"inf"/"-inf": top-level ones are read back as floats too."""
    out = dict(row)
    for path in row.get("nonfinite") or []:
        *parents, last = str(path).split(".")
        node = out
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(last) is None:
            node[last] = math.nan
    for k, v in row.items():
        if isinstance(v, str) and v in _LEGACY_NONFINITE:
            out[k] = _LEGACY_NONFINITE[v]
    return out


def read_jsonl(path: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Read a JSONL file line by line. Returns (decoded rows, one message per skipped
    line naming the file and the 1-based line number). Blank lines are ignored; a line
    that is not JSON (e.g. truncated by a crash) or not an object is skipped, never
    fatal. Raises OSError if the file cannot be opened."""
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            line = raw.decode("utf-8", errors="replace").strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                skipped.append(f"{path}:{i}: skipped, not JSON ({e.msg} at column {e.colno}; truncated?)")
                continue
            if not isinstance(row, dict):
                skipped.append(f"{path}:{i}: skipped, a JSON {type(row).__name__} where an object was expected")
                continue
            rows.append(decode_row(row))
    return rows, skipped


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
            from torch.utils.tensorboard import SummaryWriter  # heavy (tensorboard, protobuf): only when asked
            self._tb = SummaryWriter(str(self.run_dir / "tb"))

    def log(self, record: dict[str, Any]) -> None:
        self._file.write(dumps_row(record) + "\n")
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
        "versions": {"mct": __version__, "torch": torch.__version__, "python": platform.python_version()},
        "git_commit": git_commit(),
        "world_size": world_size,
        "backend": backend,
        "device": device,
        "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        **(extra or {}),
    }
    path = Path(run_dir) / "metadata.json"
    path.write_text(dumps_row(meta, indent=2) + "\n")
    return meta


def record_metadata(run_dir: str | Path, key: str, value: Any) -> None:
    """Set ``key`` of RUN_DIR/metadata.json to ``value`` (replaced whole, atomically). A run
    dir without a readable metadata.json is left as it is."""
    path = Path(run_dir) / "metadata.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(meta, dict):
        return
    meta[key] = value
    tmp = path.with_name(".metadata.json.tmp")
    tmp.write_text(dumps_row(meta, indent=2) + "\n")
    tmp.replace(path)


def flatten_peaks(peaks: dict[str, dict[str, int]]) -> dict[str, int]:
    """{'forward': {'total': 5, 'activations': 3}} -> {'peak_forward_total': 5, ...}"""
    return {f"peak_{phase}_{cat}": v for phase, cats in peaks.items() for cat, v in cats.items()}
