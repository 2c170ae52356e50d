"""Streaming chunks of offloaded state through a small pool of reusable buffers.

``ChunkStream`` owns ``slots`` buffer sets on the compute device (one buffer per
tensor name, each ``chunk_numel`` long, a per-block state's ``chunk_numel / per``;
allocated on first use and reused for the engine's lifetime) and one background I/O
thread. ``run`` walks a list of chunks:

    read chunk i+1 .. i+slots-1     (I/O thread, ahead)
    compute chunk i                 (calling thread, e.g. an optimizer step)
    write chunk i                   (I/O thread, behind)

The I/O thread executes jobs strictly in submission order (one worker), which is
what makes the pool safe without locks: the read that reuses chunk i-1's slot is
submitted after chunk i-1's write. Plain file reads and writes release the GIL, so
they overlap with the step's kernels. On CUDA, host<->device copies run on a side
stream; the compute stream waits on an event recorded after each read, and each
write waits on an event recorded after the compute, so no copy races a kernel.
Disk reads on CUDA bounce through pinned host staging buffers of one chunk.
"""

from __future__ import annotations

import collections
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from mct.offload.store import Store




@dataclass(frozen=True)
class Item:
    """One tensor range of one chunk: record ``key`` of ``store``, elements [lo, hi),
    held in the slot buffer ``name``. ``per``: chunk elements per record entry (1; a
    per-block state's block size, e.g. the fp32 scales of int8 moments), which sizes
    the slot buffer."""

    name: str
    store: Store
    key: str
    lo: int
    hi: int
    per: int = 1


class ChunkStream:
    """``device``: where chunks are computed on. ``slots`` >= 2 buffer sets of
    ``chunk_numel`` elements. ``on_alloc(t)`` is called with each new pool buffer
    (e.g. to count it in a memory tracker)."""

    def __init__(self, device: torch.device, *, slots: int, chunk_numel: int,
                 on_alloc: Callable[[torch.Tensor], None] | None = None) -> None:
        assert slots >= 2 and chunk_numel >= 1, (slots, chunk_numel)
        self.device, self.slots, self.chunk_numel = device, slots, chunk_numel
        self.on_alloc = on_alloc
        self._cuda = device.type == "cuda"
        self._pool: list[dict[str, torch.Tensor]] = [{} for _ in range(slots)]
        self._staging: list[dict[str, torch.Tensor]] = [{} for _ in range(slots + 1)]  # last: grad writes
        self._side = torch.cuda.Stream(device) if self._cuda else None
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mct-offload-io")
        self._pending: collections.deque[Future] = collections.deque()
        self.io_wait_s = 0.0
        """Seconds the calling thread waited for reads (I/O the compute did not hide)."""
        self.io_busy_s = 0.0
        """Seconds the I/O thread spent on reads and writes (written by that thread only)."""

    # ---- buffers ----
    def buffer(self, slot: int, name: str, dtype: torch.dtype, n: int, per: int = 1) -> torch.Tensor:
        """The first ``n`` elements of slot ``slot``'s buffer ``name`` (allocated once,
        ``ceil(chunk_numel / per)`` long: ``per`` chunk elements share one entry)."""
        buf = self._pool[slot].get(name)
        if buf is None or buf.dtype != dtype:
            buf = self._pool[slot][name] = torch.empty(-(-self.chunk_numel // per), dtype=dtype, device=self.device)
            if self.on_alloc is not None:
                self.on_alloc(buf)
        return buf[:n]

    def pool_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self._pool for t in s.values())

    def _stage(self, slot: int, name: str, dtype: torch.dtype, n: int) -> torch.Tensor:
        buf = self._staging[slot].get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < n:
            buf = self._staging[slot][name] = torch.empty(max(n, self.chunk_numel), dtype=dtype, pin_memory=True)
        return buf[:n]

    # ---- jobs ----
    def read(self, slot: int, items: Sequence[Item]) -> Future:
        """Fill slot buffers from the stores (asynchronously); ``wait`` before use."""
        bufs = [self.buffer(slot, it.name, it.store.records[it.key].dtype, it.hi - it.lo, it.per) for it in items]
        return self._submit(self._read_job, slot, list(zip(items, bufs)))

    def _read_job(self, slot: int, pairs: list[tuple[Item, torch.Tensor]]) -> Any:
        if self._cuda:
            self._side.synchronize()  # this slot's staging buffers may still feed an earlier copy
        for it, buf in pairs:
            if not self._cuda:
                it.store.read(it.key, it.lo, it.hi, buf)
                continue
            src = it.store.host_view(it.key, it.lo, it.hi)
            if src is None:
                src = self._stage(slot, it.name, buf.dtype, buf.numel())
                it.store.read(it.key, it.lo, it.hi, src)
            with torch.cuda.stream(self._side):
                buf.copy_(src, non_blocking=True)
        return self._event(self._side)

    def wait(self, fut: Future) -> None:
        """Block until a read is done; on CUDA the compute stream waits for its copies."""
        t0 = time.perf_counter()
        ev = fut.result()
        self.io_wait_s += time.perf_counter() - t0
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)

    def fetch(self, item: Item, out: torch.Tensor) -> None:
        """Read one range into ``out`` (any tensor) now, after every queued job."""
        self.wait(self._submit(self._read_job, self.slots, [(item, out)]))

    def write(self, slot: int, writes: Sequence[tuple[Item, torch.Tensor]]) -> Future:
        """Write tensors (slot buffers, or any tensor the job keeps alive until done)
        to the stores, after the compute that produced them (CUDA: an event)."""
        ev = self._event(torch.cuda.current_stream(self.device)) if self._cuda else None
        return self._submit(self._write_job, slot, list(writes), ev)

    def _write_job(self, slot: int, writes: list[tuple[Item, torch.Tensor]], ev) -> None:
        if ev is not None:
            self._side.wait_event(ev)
        for it, src in writes:
            if not self._cuda:
                it.store.write(it.key, it.lo, src)
                continue
            for a in range(0, src.numel(), self.chunk_numel):  # bounce through one chunk at a time
                piece = src[a:a + self.chunk_numel]
                dst = it.store.host_view(it.key, it.lo + a, it.lo + a + piece.numel())
                host = dst if dst is not None else self._stage(slot, it.name, src.dtype, piece.numel())
                with torch.cuda.stream(self._side):
                    host.copy_(piece, non_blocking=True)
                self._side.synchronize()
                if dst is None:
                    it.store.write(it.key, it.lo + a, host)

    def _submit(self, fn, *args) -> Future:
        fut = self._io.submit(self._in_device(fn), *args)
        self._pending.append(fut)
        while self._pending and self._pending[0].done():
            self._pending.popleft().result()  # surface errors of finished jobs
        return fut

    def _in_device(self, fn):
        def run(*args):
            t0 = time.perf_counter()
            try:
                if not self._cuda:
                    return fn(*args)
                with torch.cuda.device(self.device):
                    return fn(*args)
            finally:
                self.io_busy_s += time.perf_counter() - t0
        return run

    @staticmethod
    def _event(stream) -> Any:
        if stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def drain(self, limit: int = 0) -> None:
        """Wait until at most ``limit`` jobs are outstanding; re-raise a job's error."""
        while len(self._pending) > limit:
            self._pending.popleft().result()

    # ---- the pipeline ----
    def run(self, chunks: Sequence[Any], reads: Callable[[Any], list[Item]],
            compute: Callable[[Any, int], list[tuple[Item, torch.Tensor]]]) -> None:
        """For each chunk in order: wait for its reads (issued ``slots - 1`` chunks
        ahead), ``compute(chunk, slot)`` -> the writes to issue. Returns after every
        write is done; a failing read, write or compute is raised after draining."""
        ahead = self.slots - 1
        futs: dict[int, Future] = {}
        try:
            for j in range(min(ahead, len(chunks))):
                futs[j] = self.read(j % self.slots, reads(chunks[j]))
            for i, chunk in enumerate(chunks):
                self.wait(futs.pop(i))
                self.write(i % self.slots, compute(chunk, i % self.slots))
                j = i + ahead  # its slot is chunk i-1's, whose write is queued before this read
                if j < len(chunks):
                    futs[j] = self.read(j % self.slots, reads(chunks[j]))
        except BaseException:
            self._drain_quietly()  # no job may still use a buffer once the error propagates
            raise
        self.drain()

    def _drain_quietly(self) -> None:
        while self._pending:
            try:
                self._pending.popleft().result()
            except Exception:  # noqa: BLE001 - the error already propagating says more
                pass

    def close(self) -> None:
        self._drain_quietly()
        self._io.shutdown(wait=True)
