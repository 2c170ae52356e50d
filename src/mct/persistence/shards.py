"""Sharded tensors on disk through torch.distributed.checkpoint (DCP).

Each 1-D piece a rank holds (see ``mct.zero.state_io``: an element range of a unit's
global flat tensor) is handed to DCP as a ``DTensor`` sharded on dim 0, so DCP records
every rank's chunk and can load any element range into any other sharding: N -> M ranks
and stage -> stage need no conversion step. Replicated tensors (stage 0, scalars) are
plain tensors, written once. Without a process group (one process, ``mct export``) DCP
runs with ``no_dist=True``.

Loading never unpickles arbitrary objects: tensor data is read by DCP with
``torch.load(weights_only=True)``, and DCP's ``.metadata`` (a pickle) is read by an
unpickler that only builds DCP's own metadata classes.
"""

from __future__ import annotations

import contextlib
import errno
import io
import pickle
import warnings
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _create_file_view
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
            ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
            ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP metadata classes, torch dtypes and sizes; refuses anything else."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED_MODULES or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: not DCP checkpoint metadata")


class SafeReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose metadata is read by the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
            raise ValueError(f"{path}: not readable DCP metadata ({e})") from None
        if not isinstance(metadata, Metadata):
            raise ValueError(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


@contextlib.contextmanager
def _quiet():
    """DCP warns on every single-process call that it assumes one process: we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _mesh(device: torch.device):
    return init_device_mesh(device.type, (dist.get_world_size(),))


class _StreamingPlanner(DefaultSavePlanner):
    """DCP's default save planner, except that a key with a reader is written from
    ``reader()`` (its state-dict entry is a meta-device placeholder of the same shape).

    DCP resolves one write item at a time, but its file writer keeps a reference to
    every tensor it wrote until the file is closed (``tensor_dict``, used only for its
    safetensors format), so whatever this planner hands out for the write (a piece read
    from the store, or the copy of a view that DCP would otherwise make itself) is
    emptied (storage resized to 0) when the next item is resolved: the one before has
    been written by then. One piece is held at a time."""

    def __init__(self, readers: dict[str, Callable[[], torch.Tensor]]) -> None:
        super().__init__()
        self.readers = readers
        self._handed: torch.Tensor | None = None

    def resolve_data(self, write_item: Any) -> Any:
        if self._handed is not None:  # written: free it (DCP's own reference keeps an empty tensor)
            self._handed.untyped_storage().resize_(0)
            self._handed = None
        read = self.readers.get(write_item.index.fqn)
        data = super().resolve_data(write_item) if read is None else read()
        if isinstance(data, torch.Tensor) and (read is not None or data.device.type != "cpu"
                                               or data.untyped_storage().nbytes() != data.nbytes):
            # a view of live state (or a device tensor) DCP would copy to the host itself: copy it here
            data = data if read is not None else data.to("cpu", copy=True)
            self._handed = data
        return data


def _wrap(tensors: dict[str, torch.Tensor], extents: dict[str, list[int]],
          device: torch.device | None = None) -> dict[str, Any]:
    """Pieces that cover only part of their global tensor become DTensors (Shard(0)) where
    every rank's piece is DTensor's own (torch.chunk's) range of it, else ShardedTensors
    with each piece's explicit offset (shards aligned to quantization blocks): the files'
    chunks record the offsets either way, so either loads into any other sharding."""
    partial = {k for k, t in tensors.items() if k in extents and t.numel() != extents[k][1]}
    if not _distributed():
        return dict(tensors)
    mesh = _mesh(device or next(t.device for t in tensors.values() if t.device.type != "meta"))
    explicit = set()
    for k in (k for k in tensors if k in extents):
        size, off = compute_local_shape_and_global_offset((extents[k][1],), mesh, [Shard(0)])
        if (tensors[k].numel(), extents[k][0]) != (size[0], off[0]) and tensors[k].numel():
            explicit.add(k)
    # every rank must wrap the same keys (a rank may hold all of a tiny unit), the same way
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (sorted(partial), sorted(explicit)))
    partial = {k for keys, _ in everyone for k in keys}
    explicit = {k for _, keys in everyone for k in keys} & partial
    if not partial:
        return dict(tensors)
    return {k: (_sharded(t, extents[k]) if k in explicit else
                DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=(extents[k][1],), stride=(1,))
                if k in partial else t) for k, t in tensors.items()}


def _sharded(t: torch.Tensor, extent: list[int]) -> Any:
    """A 1-D ShardedTensor of global size ``extent[1]`` whose local shard is ``t`` at
    offset ``extent[0]`` (none where ``t`` is empty). Collective."""
    from torch.distributed._shard.sharded_tensor import Shard as LocalShard, ShardMetadata, init_from_local_shards
    place = f"rank:{dist.get_rank()}/{t.device}"
    local = [LocalShard(t, ShardMetadata([extent[0]], [t.numel()], place))] if t.numel() else []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ShardedTensor is deprecated for DTensor, which has no explicit offsets
        return init_from_local_shards(local, extent[1])


def save_pieces(tensors: dict[str, torch.Tensor], extents: dict[str, list[int]], path: Path, *,
                readers: dict[str, Callable[[], torch.Tensor]] | None = None,
                device: torch.device | None = None) -> None:
    """Collective when a process group is up: every rank passes its pieces (the same
    keys everywhere) and DCP writes ``__<rank>_0.distcp`` files plus ``.metadata``
    into ``path``. Tensors are written from where they are (views are copied one at a
    time); a key in ``readers`` is a meta placeholder whose data ``readers[key]()``
    returns when it is written. So the save holds at most one extra piece. ``device``:
    the mesh's device (default: that of the first real tensor). Raises OSError (a
    failed write on any rank, on every rank) with DCP's wrapping removed."""
    # per_thread_copy_ahead=0: DCP's serial loader (one item resolved, then written) on CUDA
    # too; its overlapping loader would resolve ahead, and the planner frees what it handed out
    writer = dcp.FileSystemWriter(str(path), single_file_per_rank=True, sync_files=True, thread_count=1,
                                  per_thread_copy_ahead=0)
    wrapped = _wrap(tensors, extents, device)
    try:
        with _quiet():
            dcp.save(wrapped, storage_writer=writer, planner=_StreamingPlanner(readers or {}),
                     no_dist=not _distributed())
    except (CheckpointException, RuntimeError) as e:  # a rank's write failed: surface it as an OSError
        failure = _write_error(e)
        if failure is None:
            raise
        raise failure from None


def _write_error(e: BaseException) -> OSError | None:
    """The OSError behind a failed DCP save (a full disk, a size limit, a read-only
    place), looking through DCP's per-rank wrapping and exception chains; torch's zip
    writer reports a short write as a RuntimeError 'unexpected pos'. None: not a write
    failure (a bug to surface as it is)."""
    todo = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()] if isinstance(
        e, CheckpointException) else [e]
    seen = []
    while todo:
        err = todo.pop()
        if err is None or any(err is s for s in seen):
            continue
        seen.append(err)
        if isinstance(err, OSError):
            return err
        todo += [err.__cause__, err.__context__]
    if any("unexpected pos" in str(err) for err in seen):
        return OSError(errno.EIO, "a short write (the disk is full, or a file-size limit was hit)")
    return None


def load_pieces(template: dict[str, torch.Tensor], extents: dict[str, list[int]], path: Path) -> dict[str, torch.Tensor]:
    """Fill fresh tensors shaped like ``template`` (this rank's pieces, with their
    extents) from the checkpoint in ``path``, whatever sharding wrote it. Collective
    when a process group is up. Raises ValueError naming ``path`` on unreadable data."""
    SafeReader(str(path)).read_metadata()  # a clean ValueError before DCP's own wrapping
    wrapped = _wrap(template, extents)
    try:
        with _quiet():
            dcp.load(wrapped, storage_reader=SafeReader(str(path)), no_dist=not _distributed())
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - DCP wraps per-rank failures in CheckpointException
        raise ValueError(f"{path}: cannot load the sharded state ({type(e).__name__}: {str(e)[:300]})") from None
    return {k: (v.to_local() if hasattr(v, "to_local") else
                template[k] if hasattr(v, "local_shards") else v) for k, v in wrapped.items()}


def read_stored(file: BinaryIO, offset: int, length: int) -> torch.Tensor:
    """The tensor DCP stored at bytes [offset, offset + length) of an open ``.distcp``
    file (a chunk's ``_StorageInfo``), read with ``weights_only=True`` onto the CPU."""
    return torch.load(_create_file_view(file, offset, length), map_location="cpu", weights_only=True)


def read_metadata(path: Path) -> dict[str, TensorStorageMetadata]:
    """Key -> stored tensor metadata (global size, dtype, chunks) of a DCP directory."""
    md = SafeReader(str(path)).read_metadata()
    return {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def load_whole(path: Path, key: str, spec: dict) -> torch.Tensor:
    """One tensor a checkpoint stores whole (a frozen parameter of an older checkpoint):
    ``spec`` is its ``engine.json`` entry (shape, dtype). Raises as ``load_full``."""
    t = torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"]))
    load_full(path, {key: t})
    return t


def load_full(path: Path, keys: dict[str, torch.Tensor]) -> None:
    """Fill each given full-size tensor from the checkpoint, in one process (no process
    group needed): used by export, one unit at a time."""
    SafeReader(str(path)).read_metadata()
    try:
        with _quiet():
            dcp.load(keys, storage_reader=SafeReader(str(path)), no_dist=True)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{path}: cannot load the sharded state ({type(e).__name__}: {str(e)[:300]})") from None
