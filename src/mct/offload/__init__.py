"""Offload: fp32 master shards, optimizer state, gradient shards and stage-3 parameter
shards kept in host memory or on disk between uses, streamed through a small pool of
buffers for the optimizer step (see docs/stages.md, "offload").

  store.py   where records live: HostStore (pinned on CUDA), DiskStore (one file, preadv/pwritev)
  stream.py  ChunkStream: reusable buffer pool + one background I/O thread (+ CUDA side stream)
  state.py   OffloadedState: what each unit keeps resident, the chunked optimizer step
  init.py    building a model one unit at a time from the meta device (no full model)
"""

from mct.offload.state import OffloadedState
from mct.offload.store import DiskStore, HostStore, make_store
from mct.offload.stream import ChunkStream, Item

__all__ = ["ChunkStream", "DiskStore", "HostStore", "Item", "OffloadedState", "make_store"]
