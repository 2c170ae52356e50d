"""Activation offload (``checkpointing.offload``): a checkpoint region's input leaves the
compute device after the region's forward and comes back, one region ahead, in backward.

What moves: the tensor a region keeps to replay itself, its first block's chained input
(the hidden states a plain ``for`` loop passes from block to block; other inputs, such as
masks or position embeddings, are shared by every region and stay). What it costs: while
region k runs forward, region k-1's input is still being written (``park`` waits for it at
the end of region k, then drops it), and while region k replays, region k-1's input is
being read back: so at most two regions' inputs are resident besides the one block that
recomputes. The last region's input is never read back: it is still resident when
backward starts. The moments bytes leave and come back are fixed points of the main
thread, never the I/O thread's timing, so the memory tracker (and the planner's dry run,
which runs this code on fake tensors and only simulates the I/O) sees the same bytes on
every run. Values come back bit for bit (raw bytes), so training is identical to no offload.

Tiers: ``disk`` writes files under ``offload.dir`` through one background daemon thread
(CPU and CUDA: a CUDA tensor goes through pinned host memory first); ``cpu`` (CUDA only)
copies into pinned host memory on a side stream, overlapped with compute. On a CPU device
the compute memory is host memory, so ``cpu`` is refused with a one-line error.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily
from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

from mct.checkpointing.act_store import ActivationStore
from mct.memory.host import Advise, as_is

ReportFn = Callable[[str, int], None]


@contextlib.contextmanager
def outside_selective_cache() -> Iterator[None]:
    """Leave selective checkpointing's dispatch modes for the duration: its replay cache
    (which refuses any op its forward did not run) and its forward's caching (which keeps
    matmul outputs for the replay); modes below them, such as the memory tracker's, stay on."""
    with contextlib.ExitStack() as stack:
        while isinstance(_get_current_dispatch_mode(), (_CachedTorchDispatchMode, _CachingTorchDispatchMode)):
            stack.enter_context(_pop_mode_temporarily())
        yield


class _Job:
    """One piece of I/O on the worker thread; ``wait`` re-raises its error here."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn: Callable[[], None] | None = fn
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            assert self.fn is not None
            self.fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            self.error = e
        finally:
            self.fn = None  # the closure's tensors are released here, never later by this thread
            self.done.set()

    def wait(self) -> float:
        """Block until done; the seconds waited. Re-raises the job's error."""
        t0 = time.perf_counter()
        self.done.wait()
        if self.error is not None:
            raise self.error
        return time.perf_counter() - t0


class _Worker:
    """One daemon thread running jobs in submission order (a read after a write of the
    same file sees it). Daemon: it never keeps the interpreter from exiting."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], None]) -> _Job:
        if self._thread is None:
            self._thread = threading.Thread(target=_loop, args=(self._queue,), name="mct-act-offload", daemon=True)
            self._thread.start()
            weakref.finalize(self, self._queue.put, None)  # the thread ends with its owner
        job = _Job(fn)
        self._queue.put(job)
        return job

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=10.0)
            self._thread = None


def _loop(jobs: queue.SimpleQueue) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        job.run()
        del job


@dataclass(eq=False)
class Parked:
    """A region input that left (or is leaving) the compute device."""
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    nbytes: int
    fake: bool
    tensor: torch.Tensor | None = None   # resident until its write is settled
    host: torch.Tensor | None = None     # CUDA: the pinned copy
    copied: Any = None                   # CUDA: event recorded after the device -> host copy
    path: str | None = None              # disk: its file
    write: _Job | None = None
    read: _Job | None = None
    back: torch.Tensor | None = None     # the prefetched tensor on the compute device


class ActivationOffload:
    """Parks region inputs in tier ``tier`` ('cpu' or 'disk') and brings them back.

    ``report(tier, nbytes)`` is told the bytes parked now after every change (the engine
    passes its tracker's ``set_offloaded``). Per-step counters: ``parked_peak_bytes``, ``parked_total_bytes``,
    ``parked_count``, ``wait_s``. ``advise(t)``: called on each buffer an input is read back
    into, before the read, returning it (the engine's huge pages, ``mct.memory.host.HugePages``).
    Raises ValueError for 'cpu' on a CPU device. ``planned_for``: the device type a dry run
    (fake tensors on the CPU) stands for; 'cuda' accepts the 'cpu' tier there (nothing moves).
    """

    def __init__(self, tier: str, device: torch.device | str, *, root: str = "", name: str = "act",
                 report: ReportFn | None = None,
                 advise: Advise = as_is, planned_for: str | None = None) -> None:
        self.device = torch.device(device)
        self._advise = advise
        if tier not in ("cpu", "disk"):
            raise ValueError(f"checkpointing.offload = {tier!r}: choose 'none', 'cpu' or 'disk'")
        # a dry run of a CUDA run parks its fake CPU tensors as the CUDA run parks real ones
        if tier == "cpu" and (planned_for or self.device.type) != "cuda":
            raise ValueError(f"checkpointing.offload = 'cpu' moves checkpointed inputs from the accelerator to "
                             f"host memory, but this run computes on {self.device.type!r}, whose memory is host "
                             f"memory already: use checkpointing.offload = 'disk' (files under offload.dir) or 'none'")
        self.tier = tier
        self.store = ActivationStore(root, name=name) if tier == "disk" else None
        self._worker = _Worker()
        self._side = None
        self._report = report
        self._pending: list[Parked] = []   # this step's parked inputs, forward order
        self._unsettled: Parked | None = None
        self.parked_bytes = 0
        self.parked_peak_bytes = 0
        self.parked_total_bytes = 0
        self.parked_count = 0
        self.wait_s = 0.0

    # -- forward -----------------------------------------------------------------

    def park(self, t: Any) -> Any:
        """Start moving ``t`` out; returns its ``Parked`` handle, or ``t`` itself when it
        is not a dense, contiguous, non-empty tensor on the compute device (it stays)."""
        if not isinstance(t, torch.Tensor) or not (is_fake(t) or type(t) in (torch.Tensor, torch.nn.Parameter)):
            return t  # a tensor subclass keeps its own storage rules
        if t.numel() == 0 or t.layout != torch.strided or not t.is_contiguous() or t.device.type != self.device.type:
            return t
        self._settle()
        p = Parked(t.shape, t.dtype, t.device, t.requires_grad, t.numel() * t.element_size(), is_fake(t), tensor=t)
        if not p.fake:
            self._start_write(p)
        self._pending.append(p)
        self._unsettled = p
        return p

    def _start_write(self, p: Parked) -> None:
        t = p.tensor
        assert t is not None
        if t.device.type == "cuda":
            p.host = torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
            side = self._side_stream()
            side.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(side):
                p.host.copy_(t, non_blocking=True)
                p.copied = torch.cuda.Event()
                p.copied.record(side)
        if self.store is not None:
            p.path = self.store.new_path()
            src, event, store, path = (p.host if p.host is not None else t), p.copied, self.store, p.path

            def write() -> None:
                if event is not None:
                    event.synchronize()
                store.write(path, src)
            p.write = self._worker.submit(write)

    def _settle(self) -> None:
        """The previous park's bytes leave now: wait for its copy, drop the resident tensor."""
        p, self._unsettled = self._unsettled, None
        if p is None or p.tensor is None:
            return
        if p.write is not None:
            self.wait_s += p.write.wait()
            p.write = None
            p.host = None  # on disk now
        elif p.copied is not None:
            p.copied.synchronize()
        p.tensor = None
        self._add_parked(p.nbytes)
        self.parked_total_bytes += p.nbytes

    # -- backward ------------------------------------------------------------------

    def restore(self, p: Parked) -> torch.Tensor:
        """``p``'s tensor on the compute device (exact bytes, its requires_grad), and the
        read of the input parked just before it started. Call inside the replay."""
        with outside_selective_cache():
            return self._restore(p)

    def _restore(self, p: Parked) -> torch.Tensor:
        idx = next((i for i, q in enumerate(self._pending) if q is p), None)
        if idx is None:
            raise RuntimeError("checkpointing.offload: a region's input was already brought back this step "
                               "(a second backward through one forward, retain_graph=True?); train with "
                               "checkpointing.offload = 'none' for that")
        t = self._take(p)
        del self._pending[idx]
        if idx > 0:
            self._prefetch(self._pending[idx - 1])
        return t

    def _take(self, p: Parked) -> torch.Tensor:
        if p.tensor is not None:  # never left: the last region of the forward
            t, p.tensor = p.tensor, None
            if self._unsettled is p:
                self._unsettled = None
            p.host = None
            if p.write is not None:  # let the write end here: the I/O thread must not drop the last reference
                self.wait_s += p.write.wait()
                p.write = None
            if p.path is not None and self.store is not None:
                self.store.discard(p.path)
            return t
        if p.back is None:
            self._prefetch(p)
        if p.read is not None:
            self.wait_s += p.read.wait()
            p.read = None
        t, p.back = p.back, None
        assert t is not None
        if p.device.type == "cuda":
            if p.path is not None:  # disk: the file came into pinned memory; now onto the device
                t.copy_(p.host, non_blocking=True)
            else:  # cpu tier: the side stream's copy must land before use
                torch.cuda.current_stream(p.device).wait_event(p.copied)
            p.copied = p.host = None
        return t.requires_grad_(p.requires_grad)

    def _prefetch(self, p: Parked) -> None:
        if p.back is not None or p.tensor is not None:
            return
        # Allocated here, on the main thread, where the tracker counts it: the bytes are back.
        p.back = self._advise(torch.empty(p.shape, dtype=p.dtype, device=p.device))
        self._add_parked(-p.nbytes)
        if p.fake:
            return
        if p.device.type == "cuda" and p.path is None:  # cpu tier: host -> device on the side stream
            side = self._side_stream()
            side.wait_stream(torch.cuda.current_stream(p.device))
            with torch.cuda.stream(side):
                p.back.copy_(p.host, non_blocking=True)
                p.copied = torch.cuda.Event()
                p.copied.record(side)
            return
        dest = p.back if p.device.type == "cpu" else torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
        if p.device.type == "cuda":
            p.host = dest
        path, store = p.path, self.store
        assert path is not None and store is not None
        p.read = self._worker.submit(lambda: store.read_into(path, dest))

    # -- step and run ----------------------------------------------------------------

    def end_step(self) -> None:
        """Forget what this step parked and never brought back (an aborted step): wait for
        its I/O and remove its files. Zeroes the per-step counters."""
        for p in self._pending:
            for job in (p.write, p.read):
                if job is not None:
                    try:
                        job.wait()
                    except ValueError:
                        pass  # the step that met it reported it
            if p.path is not None and self.store is not None:
                self.store.discard(p.path)
        self._pending, self._unsettled = [], None
        self._add_parked(-self.parked_bytes)
        self.parked_peak_bytes = self.parked_total_bytes = self.parked_count = 0
        self.wait_s = 0.0

    def close(self) -> None:
        """End the I/O thread and remove the files and the folder. Idempotent."""
        self.end_step()
        self._worker.close()
        if self.store is not None:
            self.store.close()

    def metrics(self) -> dict[str, Any]:
        """``act_offload`` (tier), ``act_offload_peak_bytes`` (most bytes parked at once
        this step), ``act_offload_bytes`` (every byte parked this step: each is written out
        and read back once), ``act_offload_count`` (inputs parked), ``time_act_offload_wait_s``
        (main-thread seconds waiting for I/O)."""
        return {"act_offload": self.tier, "act_offload_peak_bytes": self.parked_peak_bytes,
                "act_offload_bytes": self.parked_total_bytes,
                "act_offload_count": self.parked_count, "time_act_offload_wait_s": self.wait_s}

    def _add_parked(self, delta: int) -> None:
        if delta == 0:
            return
        self.parked_bytes += delta
        if delta > 0:
            self.parked_count += 1
            self.parked_peak_bytes = max(self.parked_peak_bytes, self.parked_bytes)
        if self._report is not None:
            self._report(self.tier, self.parked_bytes)

    def _side_stream(self):
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side
