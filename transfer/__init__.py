"""KV-block transfer between engines: NIXL agents, the lease protocol, handles.

Two roles, as in every hand-off:

* the **holder** (a prefill worker) pins a finished prompt's blocks under a :class:`Lease`
  (:mod:`baton.transfer.lease`), and answers handshakes and lease releases;
* the **reader** (a decode worker) allocates its own blocks, NIXL-READs the holder's blocks into
  them (:class:`baton.transfer.reader.KVReader`), then releases the lease. Only if the release
  says the lease stayed intact does it decode from what it read.

Both register their whole KV pool with NIXL once at start-up
(:class:`baton.transfer.agent.KVAgent`); a pool is chunks of (KV head, block), or of block in a
block-major pool (``engine/kv_layout.py``), so a hand-off is one descriptor per chunk it needs,
and NIXL merges runs of consecutive chunks: one region per (head, run of blocks).
"""

from baton.transfer.errors import (
    FingerprintMismatchError,
    LeaseLostError,
    PeerUnavailableError,
    TransferDeadlineError,
    TransferError,
)
from baton.transfer.handle import KVHandle
from baton.transfer.lease import Lease, LeaseTable

__all__ = [
    "FingerprintMismatchError", "KVHandle", "Lease", "LeaseLostError", "LeaseTable",
    "PeerUnavailableError", "TransferDeadlineError", "TransferError",
]
