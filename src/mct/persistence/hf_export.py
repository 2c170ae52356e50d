"""``mct export RUN_DIR --format hf --out DIR``: a Hugging Face model directory from a
run's sharded checkpoint, that ``AutoModelForCausalLM.from_pretrained(DIR)`` loads.

The directory gets the run's ``config.json`` and tokenizer files (kept in
``RUN_DIR/hf/`` from the start of the run, else read from the model's source
directory) and the weights as safetensors: one ``model.safetensors``, or
``model-0000k-of-0000n.safetensors`` shards with ``model.safetensors.index.json`` once
they pass ``--max-shard-size``. The safetensors files are written by hand, tensor by
tensor: the header first (every name, dtype and shape is known from the checkpoint's
unit layouts), then each tensor's bytes as it is read, one checkpoint unit at a time.
Peak memory is one unit's fp32 flat master plus one converted tensor, never the model.
Everything goes to a temporary directory beside ``--out``, renamed when complete.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from pathlib import Path
from typing import Iterator

import torch

from mct.persistence import shards
from mct.persistence.checkpoint import FROZEN
from mct.persistence.export import pick_checkpoint
from mct.persistence.files import fsync_dir, read_json
from mct.task.hf import TOKENIZER_FILES

DTYPES = {"fp32": (torch.float32, "F32", "float32"), "bf16": (torch.bfloat16, "BF16", "bfloat16")}
"""--dtype -> (torch dtype, safetensors dtype, config.json dtype)."""


def copy_hf_assets(source_dir: str | Path, dest: str | Path) -> None:
    """Copy config.json and the tokenizer files ``source_dir`` has into ``dest``
    (created). Raises ValueError (one line) when config.json cannot be copied."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", *TOKENIZER_FILES):
        src = Path(source_dir) / name
        if src.is_file():
            try:
                shutil.copyfile(src, dest / name)
            except OSError as e:
                raise ValueError(f"cannot copy {src} into {dest} ({e.strerror or e})") from None


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
    return out


def _tensors(checkpoint: Path, entries: list, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """Each entry's values in ``dtype``, reading one unit's flat master at a time."""
    units = {u["name"]: u for u in read_json(checkpoint / "engine.json")["units"]}
    current: tuple[str, torch.Tensor] | None = None
    for name, shape, key, offset in entries:
        if offset < 0:  # frozen: stored whole, in its own dtype
            spec = read_json(checkpoint / "engine.json")["tensors"][key]
            t = torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"]))
            shards.load_full(checkpoint / "engine", {key: t})
            yield t.to(dtype)
            continue
        if current is None or current[0] != key:
            current = None  # the previous unit is freed before the next is read
            flat = torch.empty(int(units[key[: -len("/master")]]["numel"]), dtype=torch.float32)
            shards.load_full(checkpoint / "engine", {key: flat})
            current = (key, flat)
        yield current[1][offset:offset + math.prod(shape)].view(shape).to(dtype)


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


def _write_safetensors(path: Path, names_shapes: list[tuple[str, tuple[int, ...]]], st_dtype: str,
                       element: int, tensors: Iterator[torch.Tensor]) -> int:
    """Write one safetensors file: the header, then each tensor from ``tensors`` in
    order. Returns the data bytes written."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in names_shapes:
        n = math.prod(shape) * element
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _ in names_shapes:
            f.write(next(tensors).contiguous().view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    return offset


def write_hf(checkpoint: Path, out: Path, assets: Path, dtype: str, max_shard_bytes: int) -> None:
    """Write the HF directory of ``checkpoint`` into the (new, empty) directory ``out``."""
    torch_dtype, st_dtype, config_dtype = DTYPES[dtype]
    element = torch.empty((), dtype=torch_dtype).element_size()
    entries = _entries(checkpoint)
    files = _plan_files(entries, element, max_shard_bytes)
    stream = _tensors(checkpoint, entries, torch_dtype)
    weight_map, total = {}, 0
    for k, indices in enumerate(files):
        fname = "model.safetensors" if len(files) == 1 else f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        total += _write_safetensors(out / fname, [entries[i][:2] for i in indices], st_dtype, element, stream)
        weight_map.update({entries[i][0]: fname for i in indices})
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    copy_hf_assets(assets, out)
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    config["dtype"] = config_dtype  # what the weights hold; from_pretrained reads it
    config.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))


def export_hf(source: str | Path, out: str | Path, dtype: str = "fp32",
              max_shard_bytes: int = 2 * 10**9) -> tuple[Path, str | None]:
    """``mct export SOURCE --format hf --out DIR``: the HF directory of the newest usable
    checkpoint of a run (or of a checkpoint directory). ``out`` must not exist or be an
    empty directory; it appears complete or not at all. Returns (checkpoint used,
    warning or None). Raises ValueError (one line) for a bad source, target or dtype."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not allowed: choose {' or '.join(DTYPES)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {str(out)!r} exists and is not an empty directory; pass a new directory")
    if not out.parent.is_dir():
        raise ValueError(f"--out {str(out)!r}: directory {str(out.parent)!r} does not exist")
    path, warning = pick_checkpoint(source)
    assets = _assets_of(path)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_hf(path, tmp, assets, dtype, max_shard_bytes)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except OSError as e:
        raise ValueError(f"--out {str(out)!r}: cannot write ({e.strerror or e})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fsync_dir(out.parent)
    return path, warning


def write_run_hf(run_dir: str | Path, dtype: str = "fp32", max_shard_bytes: int = 2 * 10**9) -> Path:
    """``RUN_DIR/hf/``: the HF directory of the run's newest checkpoint, next to the
    config and tokenizer files kept there since the run started (rank 0, at the end of
    a run of an ``hf:`` model). Written beside it and swapped in. Returns its path."""
    run_dir = Path(run_dir)
    path, _ = pick_checkpoint(run_dir)
    dest = run_dir / "hf"
    tmp = run_dir / f".hf.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_hf(path, tmp, _assets_of(path), dtype, max_shard_bytes)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fsync_dir(run_dir)
    return dest
