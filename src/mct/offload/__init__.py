"""Offload: fp32 master shards, optimizer state, gradient shards and stage-3 parameter
shards kept in host memory or on disk between uses, streamed through a small pool of
buffers for the optimizer step (see docs/stages.md, "offload").

  residency.py  Residency: where a rank's training state lives, chosen once (Resident here)
  offloaded.py  Offloaded: the residency over the offload runtime
  store.py   where records live: HostStore (pinned on CUDA), DiskStore (one file, preadv/pwritev)
  stream.py  ChunkStream: reusable buffer pool + one background I/O thread (+ CUDA side stream)
  runtime.py OffloadedState: the live offloaded state: what each unit keeps resident, the chunked step
  torch_format.py  its optimizer state in torch's Optimizer.state_dict() format
  persist.py its checkpoints, streamed; snapshot.py rollback snapshots that restore themselves
  protocols.py  what torch_format.py and persist.py may use of the runtime
"""

from mct.offload.runtime import OffloadedState
# record_init and InitProgram live in mct.task.init_program (what builds a model); kept here for callers
from mct.task.init_program import InitProgram, record_init  # noqa: E402
from mct.offload.store import DiskStore, HostStore, make_store
from mct.offload.stream import ChunkStream, Item

__all__ = ["ChunkStream", "DiskStore", "HostStore", "InitProgram", "Item", "OffloadedState", "make_store",
           "record_init"]
