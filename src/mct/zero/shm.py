"""Stage-3 all-gathers through shared memory, for gloo ranks on one host
(``distributed.shared_memory``).

Over gloo, a stage-3 unit's all-gather is a message per peer: the sender's kernel copies
its master shard into a socket, the receiver's copies it out into the working buffer,
with TCP's work on both sides (on two ranks of one host, about 0.9 s of system time per
rank in a medium Llama's 7 s fp32 step). Ranks on one host can skip the messages: each
rank's fp32 master shards live in shared memory (a file in ``/dev/shm`` that its owner
maps and every peer opens, unlinked once opened), and a gather reads every peer's shard
straight from that file into its row of the working buffer (``preadv``: one copy in the
kernel, no socket, and no peer's pages mapped here, so a rank's resident set is what it
was). The bytes are the same the message would carry (the master is what an fp32 gather
sends), so the results are bit for bit those of the messages.

With bf16 or fp16 parameters a gather sends the master's cast, not the master: each rank
then *publishes* that cast, a param-dtype copy of each master shard kept in shared memory
(``FlatParamUnit.published``), written once per step as the window opens (one cast per
unit a step, where the messages cast at every gather: forward, backward and any
recompute), and peers read it as they read fp32 masters. The cast is ``copy_``'s, the
same rounding as the message's, so the bits are again the messages'. It costs each rank
a param-dtype copy of its shard (2 bytes per parameter / world ranks), counted as
``params`` by the tracker, the planner's dry run and ``Engine.model_state_bytes``.

What makes it safe is when masters change: only the optimizer step, a state load or a
restore writes them, and none of those runs inside a step's forward and backward. A step
reads peers' masters only inside a *window* (``SharedMasters.window``) that opens and
closes with a barrier: once the opening barrier returns, every rank has finished its
writes (published casts included: they are refreshed before it); once the closing one
returns, every rank has finished its reads. A gather outside
a window (an evaluation, an export) sends messages as before.

Chosen once, collectively, at the engine's construction (``share_masters``): stage 3, fp32
masters resident (no optimizer offload) and gathered from themselves, gloo on CPU, two ranks
or more, and every rank able to create its shards in ``/dev/shm`` (space reserved up front:
a full tmpfs fails the reservation, never a later write) and to open every peer's: ranks on
different hosts, or a ``/dev/shm`` too small, keep the messages (the engine logs why).
The planner's dry run of a gloo run takes the same path (one host assumed): each peer's
shard is a copy of a stand-in of its size, so the time model prices the gathers as copies
and the peaks are the run's.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import secrets
import weakref
from collections.abc import Iterator

import torch

from mct.zero.comm import Comm, TorchCollectives

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
"""Where the shards' files are created (a tmpfs: memory, not disk)."""

SLACK_BYTES = 8 * 2**20
"""Free space left in ``SHM_DIR`` beyond every rank's shards before sharing is tried."""

SETUP_FAILED = "shared memory could not be set up, stage-3 gathers send messages: "
"""The start of ``share_masters``' answer when it was tried and failed (a user's notice:
``Engine.shared_note``), not off by the config."""

READ_BYTES = 256 * 2**20
"""Bytes per ``preadv`` call (Linux moves at most 2 GiB in one; an 8B model's shard is more)."""


class SharedMasters:
    """Every unit's peers' master shards, open here, and the window in which a gather
    may read them. ``peers[i]``: (rank, a read-only descriptor of that rank's master shard
    of unit ``i``, or of its published cast; None in a dry run). ``units``: the shared
    units (those with a ``published`` cast are refreshed as each window opens)."""

    def __init__(self, comm: Comm, peers: list[list[tuple[int, int | None]]], units: list) -> None:
        self.comm, self.peers = comm, peers
        self.casts = [u for u in units if u.published is not None]
        self.open = False
        self.windows = 0
        self._closer = weakref.finalize(self, _close_all, peers)

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        """Gathers inside read peers' masters. Collective: a barrier on entry (every rank's
        masters written, and their published casts refreshed from them) and on exit (every
        rank's reads done), also when the body raises (every rank raising alike keeps them
        matched; one rank alone raising fails its peers' next collective at the process
        group's timeout, as any collective would)."""
        with torch.no_grad():
            for u in self.casts:  # the masters may have changed since the last window (a step, a load)
                u.published.copy_(u.master)
        self.comm.barrier()
        self.open = True
        self.windows += 1
        try:
            yield
        finally:
            self.open = False
            self.comm.barrier()

    def close(self) -> None:
        """Close every peer's shard and drop the published casts (the engine is done; the
        descriptors also on garbage collection)."""
        self.open = False
        self._closer()
        for u in self.casts:
            u.published = None
        self.casts = []


def read_into(fd: int, out: torch.Tensor) -> None:
    """``out`` (contiguous, on the CPU) <- the file ``fd``'s first ``out.nbytes`` bytes."""
    n = out.numel() * out.element_size()
    view = memoryview((ctypes.c_char * n).from_address(out.data_ptr())).cast("B") if n else memoryview(b"")
    done = 0
    while done < n:
        got = os.preadv(fd, [view[done:min(n, done + READ_BYTES)]], done)
        if got <= 0:
            raise OSError(f"a peer's master shard ended after {done} of {n} bytes")
        done += got


def _close_all(peers: list[list[tuple[int, int | None]]]) -> None:
    for p in peers:  # the units hold these lists: emptied, no gather reads a closed descriptor
        for _, fd in p:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        p.clear()


def share_masters(units: list, comm: Comm, *, enabled: bool, resident: bool) -> tuple[SharedMasters | None, str]:
    """Move every non-persistent unit's fp32 master into shared memory (bf16/fp16
    parameters: give it a published cast there, ``FlatParamUnit.published``) and open
    every peer's; returns (the shared masters, or None, and why not). Collective: every
    rank calls it and all get the same answer (what a rank alone finds, such as no
    ``/dev/shm`` on its host, is exchanged before anything is used). ``units``: the
    ``FlatParamUnit``s, each given ``shared`` (its peers' shards and the window) when
    sharing is on."""
    why = _ineligible(units, comm, enabled=enabled, resident=resident)
    if why:
        return None, why
    shared = [u for u in units if not u.persistent]
    if comm.simulated:  # the planner's dry run of a gloo run (taken to be on one host): the same
        # gathers, each peer's shard copied from a stand-in of its shape (its bytes, no file)
        for u in shared:
            if _shares_cast(u):  # the published cast: the run's bytes, in ordinary memory
                u.published = torch.empty(u.master.shape, dtype=u.param_dtype, device=u.master.device)
        return _attach(comm, shared, [[(q, None) for q in range(comm.world) if q != comm.rank] for _ in shared]), ""
    ids = comm.all_gather_object((secrets.token_hex(8), os.getpid()))
    token, pids = ids[0][0], [pid for _, pid in ids]
    need = sum(_shared_bytes(u) for u in shared)
    mine: list[torch.Tensor] = []
    paths = [_path(token, pids[comm.rank], comm.rank, i) for i in range(len(shared))]
    error = ""
    try:
        if (not hasattr(torch.UntypedStorage, "_swap_data_ptr_") or not hasattr(os, "posix_fallocate")
                or not hasattr(os, "preadv") or not os.path.isdir(SHM_DIR)):
            raise OSError(f"no {SHM_DIR}, posix_fallocate or preadv here, or this torch cannot swap a storage's memory")
        _remove_stale()
        st = os.statvfs(SHM_DIR)
        free = st.f_bavail * st.f_frsize
        if free < comm.world * need + SLACK_BYTES:
            raise OSError(f"{SHM_DIR} has {free} bytes free, the shards of {comm.world} ranks need {comm.world * need}")
        for path, u in zip(paths, shared):
            mine.append(_create(path, u.master, u.param_dtype))
    except (OSError, RuntimeError) as e:
        error = f"rank {comm.rank}: {e}"
    peers: list[list[tuple[int, int]]] = [[] for _ in shared]
    error = _first_error(comm, error)  # every rank's files exist (or none use them)
    try:
        if not error:
            try:
                _allow_descriptors(len(shared) * (comm.world - 1))
                for i, u in enumerate(shared):
                    for q in range(comm.world):
                        if q != comm.rank:
                            peers[i].append((q, _open(_path(token, pids[q], q, i), _shared_bytes(u))))
            except (OSError, RuntimeError) as e:
                error = f"rank {comm.rank} cannot open rank {q}'s shards (another host?): {e}"
        error = _first_error(comm, error)  # every rank has opened its peers' (or none use them)
    finally:
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # open where needed: the memory lives while open or mapped
    if error:
        _close_all(peers)
        return None, f"{SETUP_FAILED}{error}"
    with torch.no_grad():
        for u, t in zip(shared, mine):
            if _shares_cast(u):
                u.published = t  # the master stays where it is; ``t`` holds its cast
            else:
                # the master tensor (the optimizer's parameter, the tracker's storage) keeps its
                # identity; its bytes now live in the mapping, which ``t`` gave up
                u.master.untyped_storage()._swap_data_ptr_(t.untyped_storage())
    del mine
    return _attach(comm, shared, peers), ""


def _shares_cast(u) -> bool:
    """Whether unit ``u`` shares a published cast of its master (bf16/fp16 parameters), not the master."""
    return u.param_dtype != u.master.dtype


def _shared_bytes(u) -> int:
    """The bytes unit ``u`` puts in shared memory: its master shard in the param dtype (the
    master itself where that is fp32, else its cast)."""
    return u.master.numel() * u.param_dtype.itemsize


def _attach(comm: Comm, shared: list, peers: list[list[tuple[int, int | None]]]) -> SharedMasters:
    sm = SharedMasters(comm, peers, shared)
    for u, p in zip(shared, peers):
        u.shared = (sm, p)
    return sm


def _ineligible(units: list, comm: Comm, *, enabled: bool, resident: bool) -> str:
    """Why sharing is off ('' if it may be tried): from the config and the model, which the
    ranks have agreed on, so the same answer on every rank."""
    if not enabled:
        return "distributed.shared_memory = false"
    if comm.world < 2:
        return "one rank"
    if comm.ctx.device.type != "cpu" or not (comm.simulated_gloo if comm.simulated else
                                             isinstance(comm.ops, TorchCollectives) and comm.ops.gloo):
        return "not gloo ranks on CPU"
    if not resident:
        return "optimizer offload moves the masters"
    shared = [u for u in units if not u.persistent]
    if not shared:
        return "no unit gathered on demand (stage < 3, or every unit persistent)"
    if any(u.master.dtype != torch.float32 or u.gather_source is not None or not u.master.is_contiguous()
           for u in shared):
        return "a gather's source is not this rank's fp32 master shard"
    return ""


def _allow_descriptors(more: int) -> None:
    """Raise this process's soft limit on open files (up to the hard one) so that ``more``
    descriptors fit beside those it has (a deep model on many local ranks: a unit per block
    and parameter group, one descriptor per peer). Past the hard limit the opens fail and
    every rank keeps the messages."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = len(os.listdir("/proc/self/fd")) + more + 256 if os.path.isdir("/proc/self/fd") else more + 1024
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(hard, want)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


def _path(token: str, pid: int, rank: int, i: int) -> str:
    """Unit ``i``'s shard file of ``rank`` (process ``pid``: ``_remove_stale`` reads it)."""
    return os.path.join(SHM_DIR, f"mct-{token}-p{pid}-r{rank}-u{i}")


def _remove_stale() -> None:
    """Unlink this user's shard files left by processes that died between creating them
    and unlinking them (a killed start): their memory would stay taken until a reboot."""
    uid = os.getuid()
    for name in os.listdir(SHM_DIR):
        parts = name.split("-")
        if len(parts) != 5 or parts[0] != "mct" or not parts[2][1:].isdigit():
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if os.stat(path).st_uid != uid:
                continue
            os.kill(int(parts[2][1:]), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(path)
        except OSError:  # gone already, or a live process of another user
            continue


def _create(path: str, master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A shared mapping of ``path`` (created, its space reserved) holding ``master``'s
    values in ``dtype`` (``copy_``'s cast, as a gather's message carries it)."""
    nbytes = master.numel() * dtype.itemsize
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(nbytes, 1))  # ENOSPC here, not SIGBUS at a later write
    finally:
        os.close(fd)
    t = torch.from_file(path, shared=True, size=master.numel(), dtype=dtype)
    with torch.no_grad():
        t.copy_(master)
    return t


def _open(path: str, nbytes: int) -> int:
    """A read-only descriptor of a peer's shard at ``path`` (FileNotFoundError on another
    host); its size must be this rank's shard's, ``nbytes``."""
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    if size != max(nbytes, 1):
        os.close(fd)
        raise OSError(f"{path} holds {size} bytes, expected {nbytes}")
    return fd


def _first_error(comm: Comm, error: str) -> str:
    errors = [e for e in comm.all_gather_object(error) if e]
    return errors[0] if errors else ""
