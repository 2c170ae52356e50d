"""The frozen base of a checkpoint by content hash (``base.json``), never its values.

A run with frozen parameters (LoRA/QLoRA's base, a user's own freezing) saves only what
changes (masters, optimizer state, counters, RNG); the frozen base is rebuilt from its
source the way the run started (model source, seed, ``train.init_from``, NF4 encoding)
and checked against this manifest:

    {"format": "mct.base/1",
     "source": {"model": "hf:DIR" | "gpt" | "pkg.mod:factory", "seed": S,
                "init_from": PATH or "", "files": {name: bytes} of their weight files},
     "tensors": {name: {"dtype", "shape", "codec", "sha256"}},
     "sha256": digest of the sorted (name, sha256) lines}

A tensor's digest is of its bytes *as stored* (``mct.zero.frozen``): the identity
codec's in the working dtype; NF4's codes, absmax codes, scales and means of the groups
the tensor starts (each part in key order). A frozen unit's stored bytes are the same at
any world size and stage (NF4 groups never cross a shard), so the digests are too: a
resumed or resharded run recomputes them on its own layout. Each rank gathers one unit's
stored parts at a time (as a forward's gather does; never the whole base on one rank)
and hashes every world-th tensor (the ranks share the work: 1/N of the base each), then
the digests are exchanged so every rank holds all of them.
"""

from __future__ import annotations

import hashlib
import itertools
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from mct.persistence.files import read_json

BASE_FORMAT = "mct.base/1"
BASE = "base.json"


def _sha(parts: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in parts:
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _unit_digests(unit: Any, comm: Any, mine: Callable[[], bool]) -> dict[str, dict[str, Any]]:
    """Digests of the tensors of one ``FrozenUnit`` that ``mine()`` (asked once per tensor,
    in order) gives this rank, its stored parts gathered over the ranks (collective when
    the unit is sharded)."""
    layout, world = unit.layout, unit.layout.world
    full = unit.stored
    if world > 1:
        full = {k: torch.empty(world * v.numel(), dtype=v.dtype, device=v.device) for k, v in unit.stored.items()}
        for k, v in unit.stored.items():
            comm.all_gather(v, full[k])
    align = unit.codec.align
    codec = getattr(unit.codec, "name", "identity")
    out = {}
    for name, shape, off, n in zip(unit.names, layout.shapes, layout.offsets, layout.numels()):
        if not mine():
            continue
        end = -(-(off + n) // align) * align  # the groups the tensor starts, whole
        pieces = []
        for k in sorted(full):
            r = Fraction(full[k].numel(), layout.padded_numel)
            a, b = off * r, (end if align > 1 else off + n) * r
            assert a.denominator == 1 and b.denominator == 1, (unit.name, k, off, n)
            pieces.append(full[k][int(a):int(b)])
        out[name] = {"dtype": str(unit.dtype).removeprefix("torch."), "shape": list(shape), "codec": codec,
                     "sha256": _sha(pieces)}
    return out


def frozen_digests(frozen: Any) -> dict[str, dict[str, Any]]:
    """{name: dtype, shape, codec, sha256} of every frozen parameter of ``frozen`` (a
    ``mct.zero.frozen.FrozenModel``), sorted by name. Collective when sharded: every rank
    calls it. Mutates nothing; cached on ``frozen`` (its ``load`` drops the cache)."""
    if frozen.digest_cache is not None:
        return frozen.digest_cache
    comm, count = frozen.comm, itertools.count()
    mine = lambda: next(count) % comm.world == comm.rank  # noqa: E731  the ranks share the hashing
    out: dict[str, dict[str, Any]] = {}
    with torch.no_grad():
        for u in frozen.units:
            out.update(_unit_digests(u, comm, mine))
        for name, p in frozen.loose:  # whole on every rank: the bytes it would be stored as
            if mine():
                out[name] = {"dtype": str(frozen.dtype).removeprefix("torch."), "shape": list(p.shape),
                             "codec": "identity", "sha256": _sha([p.detach().to(frozen.dtype)])}
    if comm.world > 1:
        out = {k: v for part in comm.all_gather_object(out) for k, v in part.items()}
    frozen.digest_cache = dict(sorted(out.items()))
    return frozen.digest_cache


def whole_digest(tensors: dict[str, dict[str, Any]]) -> str:
    """One digest of the whole base: sha256 of the sorted "name sha256" lines."""
    return hashlib.sha256("".join(f"{n} {s['sha256']}\n" for n, s in sorted(tensors.items())).encode()).hexdigest()


def _weight_files(path: str) -> dict[str, int]:
    """{file: bytes} of the weight files at ``path`` (a directory's *.safetensors/*.bin,
    a file itself); {} where there are none (a run directory: its own checkpoints)."""
    p = Path(path)
    if p.is_file():
        return {p.name: p.stat().st_size}
    if not p.is_dir() or (p / "checkpoints").is_dir() or (p / "meta.json").is_file():
        return {}
    return {f.name: f.stat().st_size for f in sorted(p.iterdir()) if f.suffix in (".safetensors", ".bin")}


def base_source(config: Any) -> dict[str, Any]:
    """Where a run's frozen base comes from (``config``: its ``EngineConfig``): the model
    source, seed, ``train.init_from`` and the sizes of their weight files."""
    src, init = config.model.source, getattr(getattr(config, "train", None), "init_from", "") or ""
    files = {}
    if src.startswith("hf:"):
        files.update({f"{src[3:]}/{k}": v for k, v in _weight_files(src[3:]).items()})
    if init:
        files.update({f"{init}/{k}" if Path(init).is_dir() else init: v for k, v in _weight_files(init).items()})
    return {"model": src, "seed": config.seed, "init_from": init, "files": files}


def base_manifest(frozen: Any, config: Any) -> dict[str, Any]:
    """The ``base.json`` of a checkpoint of an engine with frozen parameters. Collective."""
    tensors = frozen_digests(frozen)
    return {"format": BASE_FORMAT, "source": base_source(config), "tensors": tensors, "sha256": whole_digest(tensors)}


def describe_source(source: dict[str, Any]) -> str:
    """'model.source = hf:DIR, train.init_from = PATH' (the parts that are set)."""
    out = f"model.source = {source.get('model')!r} (seed {source.get('seed')})"
    return out + (f", train.init_from = {source['init_from']!r}" if source.get("init_from") else "")


def base_mismatch(saved: dict[str, Any], tensors: dict[str, dict[str, Any]], where: Path) -> str | None:
    """The one-line error when the rebuilt base (``tensors``: ``frozen_digests``) is not
    the one the checkpoint at ``where`` was saved with (``saved``: its ``base.json``), else None."""
    want = saved.get("tensors", {})
    fix = (f"the run's base ({describe_source(saved.get('source', {}))}) changed since the checkpoint {where} "
           f"was saved")
    hint = "; restore the base it was trained on or start a new run"
    for name in sorted(set(want) | set(tensors)):
        if name not in tensors:
            return f"{fix}: it has no frozen tensor {name!r}{hint}"
        if name not in want:
            return f"{fix}: frozen tensor {name!r} is not in the checkpoint's base{hint}"
        a, b = want[name], tensors[name]
        for key in ("shape", "dtype", "codec", "sha256"):
            if a.get(key) != b.get(key):
                return f"{fix}: tensor {name!r} {key} {b.get(key)} != {a.get(key)} saved{hint}"
    return None


def read_base(checkpoint: Path) -> dict[str, Any] | None:
    """The checkpoint's ``base.json``, or None (no frozen base, or an older checkpoint
    that embeds it under ``frozen/``). Raises ValueError for a file of another format."""
    path = Path(checkpoint) / BASE
    if not path.is_file():
        return None
    info = read_json(path)
    if not isinstance(info, dict) or info.get("format") != BASE_FORMAT:
        raise ValueError(f"{path}: format {info.get('format') if isinstance(info, dict) else None!r}, "
                         f"expected {BASE_FORMAT!r}")
    return info


def frozen_specs(checkpoint: str | Path) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the frozen base a checkpoint references ({} for none)."""
    saved = read_base(Path(checkpoint))
    return {n: tuple(s["shape"]) for n, s in (saved or {}).get("tensors", {}).items()}


Rebuild = Callable[[Path], Iterator[tuple[str, torch.Tensor]]]
"""What gives a checkpoint's referenced base back, (name, tensor) in the run's parameter dtype:
``mct.persistence.init_from.rebuilt_frozen``, passed down to the readers that may meet one."""


def need_rebuild(rebuild: Rebuild | None, checkpoint: Path) -> Rebuild:
    """``rebuild``, or a ValueError (one line) where a reader was given none."""
    if rebuild is None:
        raise ValueError(f"{checkpoint} references its frozen base by hash ({BASE}), which only a reader that can "
                         f"rebuild the run's model reads: use mct export, mct sample or --init-from")
    return rebuild
