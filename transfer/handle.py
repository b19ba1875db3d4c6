"""The KV handle: what a prefill worker returns and a decode worker needs to pull the blocks.

Opaque to the router (it passes the protobuf message through). See ARCHITECTURE.md, "KV handle".
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class KVHandle:
    worker_id: str  # the holder
    incarnation: str  # the holder process's start-up id: a restart makes a new peer
    address: str  # the holder's gRPC address (KVSource)
    lease_id: str
    block_ids: tuple[int, ...]  # in the holder's pool, in prompt order
    num_tokens: int  # prompt tokens whose KV the blocks hold
    fingerprint: str
    expires_at: float  # unix seconds
    block_crc32: tuple[int, ...] = ()  # only when the holder computes checksums
    lease_port: int = 0  # the holder's lease channel on its host (0: release over gRPC only)
    kv_dtype: str = ""  # the holder's KV element type ("" from older holders)
    kv_layout: str = ""  # the holder's pool layout (engine/kv_layout.py, to_wire)

    def seconds_left(self, now: float | None = None) -> float:
        return self.expires_at - (time.time() if now is None else now)

    def to_proto(self):
        from baton.v1 import worker_pb2

        return worker_pb2.KVHandle(
            worker_id=self.worker_id, incarnation=self.incarnation, address=self.address,
            lease_id=self.lease_id, block_ids=self.block_ids, num_tokens=self.num_tokens,
            fingerprint=self.fingerprint, expires_at=self.expires_at,
            block_crc32=self.block_crc32, lease_port=self.lease_port, kv_dtype=self.kv_dtype,
            kv_layout=self.kv_layout)

    @classmethod
    def from_proto(cls, m) -> KVHandle:
        return cls(m.worker_id, m.incarnation, m.address, m.lease_id, tuple(m.block_ids),
                   m.num_tokens, m.fingerprint, m.expires_at, tuple(m.block_crc32), m.lease_port,
                   m.kv_dtype, m.kv_layout)
