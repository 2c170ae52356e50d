"""``mct export RUN_DIR --format hf --out DIR``: a Hugging Face model directory from a
run's sharded checkpoint, that ``AutoModelForCausalLM.from_pretrained(DIR)`` loads.

The directory gets the run's ``config.json`` and tokenizer files (kept in
``RUN_DIR/hf/`` from the start of the run, else read from the model's source
directory) and the weights as safetensors: one ``model.safetensors``, or
``model-0000k-of-0000n.safetensors`` shards with ``model.safetensors.index.json`` once
they pass ``--max-shard-size``. The safetensors files are written by hand, tensor by
tensor: the header first (every name, dtype and shape is known from the checkpoint's
unit layouts), then each tensor's bytes as they are read from the DCP files, one stored
chunk (the piece of a unit one rank wrote) at a time, converted 16 MiB at a time. Peak
memory is the largest stored chunk plus 16 MiB, never the model.
Everything goes to a temporary directory beside ``--out``, renamed when complete.

A run that trained adapters is exported merged (``--merge``, ``mct.persistence.adapter_export``):
each adapted weight is read whole (one weight, in fp32), ``B A * alpha/rank`` is added, and
the LoRA tensors are left out, so the directory is the base architecture transformers loads.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator

import torch

from mct.adapters import is_adapter_name
from mct.data.tokenizer import tokenizer_identity
from mct.errors import READ, WRITE, user_error
from mct.persistence.lazy import LazyModule
from mct.persistence.base_manifest import frozen_specs
from mct.persistence.init_from import rebuilt_frozen
from mct.persistence.manifest import FROZEN
from mct.outputs import check_dir_output, install_dir, temporary
from mct.persistence.adapter_export import deltas_for
from mct.persistence.export import pick_checkpoint
from mct.persistence.run_dir import check_outside_runs
from mct.persistence.files import fsync_dir, read_json
from mct.persistence.safetensors_out import SafetensorsWriter
from mct.task.hf import TOKENIZER_FILES

shards = LazyModule("mct.persistence.shards")  # DCP: imported on first use

EXPORT_DTYPES = {"fp32": (torch.float32, "float32"), "bf16": (torch.bfloat16, "bfloat16")}
"""--dtype -> (torch dtype, safetensors dtype, config.json dtype)."""


def copy_hf_assets(source_dir: str | Path, dest: str | Path, tokenizer: str | Path | None = None) -> str | None:
    """Copy config.json and the tokenizer files ``source_dir`` has into ``dest``
    (created). ``tokenizer``: the tokenizer.json the model is trained with (a run's own,
    from its dataset), when known. Where it maps other ids than ``source_dir``'s own
    (compared by content, ``tokenizer_identity``: the same tokenizer written again is the same), the
    directory's tokenizer files would encode text as ids the model never saw: ``dest``
    gets ``tokenizer`` as its tokenizer.json and none of the directory's tokenizer files,
    and a warning saying so is returned (else None). Raises ValueError (one line) when a
    file cannot be copied."""
    dest, source_dir = Path(dest), Path(source_dir)
    dest.mkdir(parents=True, exist_ok=True)
    own = [n for n in TOKENIZER_FILES if n != "generation_config.json" and (source_dir / n).is_file()]
    differs = tokenizer is not None and _identity(Path(tokenizer)) != _identity(source_dir / "tokenizer.json")
    names, note = ("config.json", *TOKENIZER_FILES), None
    if differs:
        names = ("config.json", "generation_config.json")
        if own:
            note = (f"the run trains on the ids of its dataset's tokenizer, which is not {str(source_dir)!r}'s own "
                    f"({', '.join(own)}): the run's Hugging Face directory (and mct export --format hf) get the "
                    f"tokenizer.json the model is trained with, and none of the model directory's tokenizer files")
    for name in names:
        if (source_dir / name).is_file():
            _copy(source_dir / name, dest / name)
    if differs:
        _copy(Path(tokenizer), dest / "tokenizer.json")
    return note


def _identity(path: Path) -> str | None:
    """What the tokenizer.json at ``path`` maps (``tokenizer_identity``: its vocabulary
    and added tokens, not its bytes or path); None when there is no such file, the
    file's sha256 when it is no tokenizer.json."""
    if not path.is_file():
        return None
    try:
        data = path.read_bytes()
    except OSError as e:
        raise user_error(e, path) from None
    try:
        return tokenizer_identity(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return hashlib.sha256(data).hexdigest()


def _copy(src: Path, dst: Path) -> None:
    try:
        shutil.copyfile(src, dst)
    except OSError as e:
        action = WRITE if e.filename is not None and Path(e.filename) == dst else READ
        raise user_error(e, dst if action == WRITE else src, action) from None


def _assets_of(checkpoint: Path) -> Path:
    """Where the config and tokenizer of the run that wrote ``checkpoint`` are."""
    kept = checkpoint.parent.parent / "hf"
    if (kept / "config.json").is_file():
        return kept
    source = read_json(checkpoint / "trainer.json").get("config", {}).get("model", {}).get("source", "gpt")
    if not source.startswith("hf:"):
        raise ValueError(f"--format hf needs a run of a Hugging Face model (--model hf:DIR); the run of "
                         f"{checkpoint} trained model.source = {source!r}: export it with --out FILE.safetensors")
    if not (Path(source[3:]) / "config.json").is_file():
        raise ValueError(f"--format hf: the run's config.json is neither in {kept} nor in its source {source[3:]!r}")
    return Path(source[3:])


def _entries(checkpoint: Path) -> list[tuple[str, tuple[int, ...], str, int]]:
    """(name, shape, checkpoint key, offset in it) of every parameter, in unit order."""
    info = read_json(checkpoint / "engine.json")
    out = [(n, tuple(s), f"{u['name']}/master", o) for u in info["units"] for n, s, o in u["params"]]
    out += [(k[len(FROZEN):], tuple(spec["shape"]), k, -1) for k, spec in info["tensors"].items()
            if k.startswith(FROZEN)]
    out += [(name, shape, "", -2) for name, shape in frozen_specs(checkpoint).items()]  # rebuilt (base.json)
    return out


class _Chunks:
    """A checkpoint's 1-D unit tensors read one stored chunk (what one rank wrote) at a
    time, straight from the DCP files: only the newest chunk is held."""

    def __init__(self, engine_dir: Path, base_file: Path | None = None) -> None:
        self.dir = engine_dir
        self.base_file = base_file
        md = shards.SafeReader(str(engine_dir)).read_metadata()
        self.where: dict[str, list[tuple[int, int, object]]] = {}
        for idx, info in md.storage_data.items():
            spec = md.state_dict_metadata.get(idx.fqn)
            if len(idx.offset) != 1 or not hasattr(spec, "chunks"):
                continue
            size = next(c.sizes[0] for c in spec.chunks if c.offsets[0] == idx.offset[0])
            self.where.setdefault(idx.fqn, []).append((int(idx.offset[0]), int(size), info))
        for chunks in self.where.values():
            chunks.sort(key=lambda c: c[0])
        self._base: dict[str, torch.Tensor] | None = None
        self._held: tuple[str, int, torch.Tensor] | None = None

    def frozen(self, checkpoint: Path, name: str) -> torch.Tensor:
        """The frozen tensor ``name`` of a checkpoint that references its base by hash: read
        alone from ``base_file`` (the run's own ``model.safetensors``, written from the live
        engine, whose base is the checkpoint's) where given, else from the base rebuilt on
        first use and held (``init_from.rebuilt_frozen``: the run's parameter dtype)."""
        if self.base_file is not None:
            from safetensors import safe_open
            with safe_open(str(self.base_file), framework="pt") as f:
                return f.get_tensor(name)
        if self._base is None:
            self._base = dict(rebuilt_frozen(checkpoint))
        return self._base[name]

    def pieces(self, key: str, start: int, end: int) -> Iterator[torch.Tensor]:
        """Consecutive views covering elements [start, end) of ``key``."""
        for c0, n, info in self.where[key]:
            a, b = max(start, c0), min(end, c0 + n)
            if a < b:
                yield self._chunk(key, c0, info)[a - c0:b - c0]

    def _chunk(self, key: str, c0: int, info) -> torch.Tensor:
        if self._held is not None and self._held[:2] == (key, c0):
            return self._held[2]
        self._held = None  # the previous chunk is freed before the next is read
        if getattr(info, "transform_descriptors", None):
            raise ValueError(f"{self.dir}: chunk {key}@{c0} is stored transformed ({info.transform_descriptors}); "
                             f"export it with --out FILE.safetensors")
        try:
            with open(self.dir / info.relative_path, "rb") as f:
                t = shards.read_stored(f, info.offset, info.length)
        except OSError as e:
            raise user_error(e, self.dir / info.relative_path, READ) from None
        self._held = (key, c0, t.reshape(-1))
        return self._held[2]


PIECE = 1 << 22
"""Elements converted to the export dtype at a time (16 MiB of fp32)."""


def _pieces(checkpoint: Path, entry: tuple, chunks: _Chunks, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """One entry's values in ``dtype``, in pieces of at most ``PIECE`` elements."""
    name, shape, key, offset = entry
    if offset == -2:  # frozen, referenced by hash: rebuilt from the run's source once, checked
        yield chunks.frozen(checkpoint, name).reshape(-1).to(dtype)
        return
    if offset < 0:  # frozen: stored whole, in its own dtype
        spec = read_json(checkpoint / "engine.json")["tensors"][key]
        yield shards.load_whole(checkpoint / "engine", key, spec).reshape(-1).to(dtype)
        return
    for piece in chunks.pieces(key, offset, offset + math.prod(shape)):
        for i in range(0, piece.numel(), PIECE):
            yield piece[i:i + PIECE].to(dtype)  # no copy when dtype is already fp32
        del piece  # no view keeps this chunk alive while the next one is read


def _merged_pieces(checkpoint: Path, entry: tuple, chunks: _Chunks, dtype: torch.dtype,
                   deltas: dict[str, torch.Tensor]) -> Iterator[torch.Tensor]:
    """``_pieces``, with ``deltas[name]`` (fp32, the entry's shape) added to the entry when
    it has one: that entry comes whole, summed in fp32, then converted to ``dtype``."""
    delta = deltas.get(entry[0])
    if delta is None:
        yield from _pieces(checkpoint, entry, chunks, dtype)
        return
    whole = torch.cat([p.reshape(-1) for p in _pieces(checkpoint, entry, chunks, torch.float32)])
    yield (whole.view(delta.shape) + delta).to(dtype).reshape(-1)


def _plan_files(entries: list, element: int, max_bytes: int) -> list[list[int]]:
    """Entry indices per file, in order, each file at most ``max_bytes`` (a larger
    tensor gets a file of its own)."""
    files: list[list[int]] = [[]]
    size = 0
    for i, (_, shape, _, _) in enumerate(entries):
        n = math.prod(shape) * element
        if files[-1] and size + n > max_bytes:
            files.append([])
            size = 0
        files[-1].append(i)
        size += n
    return files


def _write_safetensors(path: Path, entries: list[tuple], dtype: torch.dtype,
                       pieces: Callable[[tuple], Iterator[torch.Tensor]]) -> int:
    """Write one safetensors file (``SafetensorsWriter``: reserved, written in place,
    renamed once complete) from each entry's pieces as ``pieces`` yields them. Returns
    the data bytes written."""
    writer = SafetensorsWriter(path, {name: (dtype, shape) for name, shape, _, _ in entries},
                               metadata={"format": "pt"})  # what from_pretrained expects
    try:
        for entry in entries:
            pos = 0
            for piece in pieces(entry):
                writer.put_part(entry[0], pos, piece)
                pos += piece.numel()
                del piece  # (a view of the stored chunk: see _pieces)
    except BaseException:
        writer.abort()
        raise
    writer.commit()
    return writer.nbytes - writer.base


def write_hf(checkpoint: Path, out: Path, assets: Path, dtype: str, max_shard_bytes: int,
             deltas: dict[str, torch.Tensor] | None = None, base_file: Path | None = None) -> str | None:
    """Write the HF directory of ``checkpoint`` into the (new, empty) directory ``out``,
    with the tokenizer the run trained with (``copy_hf_assets``). ``deltas``: merged
    adapters (``adapter_export.deltas_for``): added to their weights, LoRA tensors left
    out. ``base_file``: a safetensors file holding the frozen base a checkpoint references
    by hash (the run's ``model.safetensors``), read a tensor at a time instead of rebuilding
    the base. Returns its warning."""
    torch_dtype, config_dtype = EXPORT_DTYPES[dtype]
    element = torch_dtype.itemsize
    entries = _entries(checkpoint)
    adapters = [name for name, *_ in entries if is_adapter_name(name)]
    if adapters and deltas is None:  # transformers would load the base and drop them without a word
        raise ValueError(f"{checkpoint}: the run trained LoRA adapters ({adapters[0]}, ...), which a Hugging Face "
                         f"model directory has no place for: add --merge (base + B A merged), export the "
                         f"adapters with --format peft, or base and adapters by name with --out FILE.safetensors")
    entries = [e for e in entries if deltas is None or not is_adapter_name(e[0])]
    files = _plan_files(entries, element, max_shard_bytes)
    chunks = _Chunks(checkpoint / "engine", base_file)
    weight_map, total = {}, 0
    for k, indices in enumerate(files):
        fname = "model.safetensors" if len(files) == 1 else f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        total += _write_safetensors(out / fname, [entries[i] for i in indices], torch_dtype,
                                    lambda e: _merged_pieces(checkpoint, e, chunks, torch_dtype, deltas or {}))
        weight_map.update({entries[i][0]: fname for i in indices})
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    trained_with = checkpoint.parent.parent / "tokenizer.json"  # the run's own (mct.data.copy_tokenizer)
    note = copy_hf_assets(assets, out, tokenizer=trained_with if trained_with.is_file() else None)
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    config["dtype"] = config_dtype  # what the weights hold; from_pretrained reads it
    config.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return note


def export_hf(source: str | Path, out: str | Path, dtype: str = "fp32",
              max_shard_bytes: int = 2 * 10**9, force: bool = False, merge: bool = False) -> tuple[Path, str | None]:
    """``mct export SOURCE --format hf --out DIR [--merge]``: the HF directory of the newest
    usable checkpoint of a run (or of a checkpoint directory); ``merge``: of an adapter
    run, the base with the adapters merged in. ``out`` must not exist, be an empty
    directory or (``force``) an earlier HF export (``check_hf_out``); it appears complete
    or not at all (``mct.outputs.install_dir``). Returns (checkpoint used, warning or
    None). Raises ValueError (one line) for a bad source, target or dtype, an adapter run
    without ``merge`` or ``merge`` of a run without adapters."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not allowed: choose {' or '.join(EXPORT_DTYPES)}")
    out = check_hf_out(out, force)
    path, warning = pick_checkpoint(source)
    assets = _assets_of(path)
    names = [e[0] for e in _entries(path)]
    if not merge and any(is_adapter_name(n) for n in names):
        raise ValueError(f"--format hf: the run of {path} trained LoRA adapters, which transformers does not "
                         f"load into the base: add --merge (the base with the adapters merged in) or export "
                         f"the adapters with --format peft")
    deltas = deltas_for(path, names, merge, "--merge")
    tmp = temporary(out)
    try:
        tmp.mkdir()
        note = write_hf(path, tmp, assets, dtype, max_shard_bytes, deltas)
        warning = "; ".join(w for w in (warning, note) if w) or None
        install_dir(tmp, out, force=force)
    except OSError as e:  # reads of the checkpoint are named by _Chunks: what is left is writing
        raise user_error(e, e.filename or out, WRITE) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path, warning


HF_WRITES = ("config.json", "*.safetensors", "model.safetensors.index.json", *TOKENIZER_FILES)
"""What an HF export directory holds: what ``--force`` may replace."""


def check_hf_out(out: str | Path, force: bool) -> Path:
    """``out`` as a Path if an HF directory may be exported there (``mct.outputs``:
    new, empty, or with ``force`` an earlier export; outside a run's own tree). Raises
    ValueError (one line) otherwise."""
    return check_dir_output(out, "--out", force=force, writes=HF_WRITES, command="mct export --format hf",
                            owned=check_outside_runs)


def write_run_hf(run_dir: str | Path, dtype: str = "fp32", max_shard_bytes: int = 2 * 10**9) -> Path:
    """``RUN_DIR/hf/``: the HF directory of the run's newest checkpoint, next to the
    config and tokenizer files kept there since the run started (rank 0, at the end of
    a run of an ``hf:`` model; an adapter run's merged, as ``--merge``). Written beside
    it and swapped in. Returns its path."""
    run_dir = Path(run_dir)
    path, _ = pick_checkpoint(run_dir)
    names = [e[0] for e in _entries(path)]
    deltas = deltas_for(path, names, any(is_adapter_name(n) for n in names), "RUN_DIR/hf")
    dest = run_dir / "hf"
    tmp = run_dir / f".hf.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        own = run_dir / "model.safetensors"  # written from the live engine just before: its base is the run's
        write_hf(path, tmp, _assets_of(path), dtype, max_shard_bytes, deltas, own if own.is_file() else None)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fsync_dir(run_dir)
    return dest
