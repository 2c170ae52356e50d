"""``mct export SOURCE --out FILE.safetensors [--merge]``: the consolidated fp32 weights of a
run or checkpoint in one safetensors file; of an adapter run with ``--merge``, the base's
names with the adapters merged in. Above ``export`` (the checkpoint readers) and
``adapter_export`` (the merged deltas), which both stay below it."""

from __future__ import annotations

from pathlib import Path

from mct.persistence.adapter_export import deltas_for
from mct.persistence.export import check_target, checkpoint_specs, export_checkpoint, pick_checkpoint
from mct.persistence.init_from import rebuilt_frozen


def export(source: str | Path, out: str | Path, *, force: bool = False, merge: bool = False) -> tuple[Path, str | None]:
    """Write the consolidated fp32 weights of ``source`` (run or checkpoint directory)
    to the safetensors file ``out`` (a temporary, fsync, rename; one unit in memory at a
    time); ``merge``: of an adapter run, the base's names with the adapters merged in
    (``adapter_export.deltas_for``). Returns (checkpoint used, warning or None). Raises
    ValueError (one line) for a bad source or target (see ``check_target``), ``merge`` of
    a run without adapters, or a failed write (path and bytes)."""
    out = Path(out)
    check_target(out, force=True)  # what no --force allows, before reading the source
    path, warning = pick_checkpoint(source)
    check_target(out, force)
    deltas = deltas_for(path, list(checkpoint_specs(path)), merge, "--merge")
    export_checkpoint(path, out, deltas, rebuilt_frozen)
    return path, warning
