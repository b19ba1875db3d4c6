"""The holder's side of a hand-off (a prefill worker): leases on pinned blocks, and the KVSource
RPCs a reader calls (handshake, lease release).

The holder never pushes anything: the reader pulls with one-sided NIXL READs, so a slow or dead
reader costs the holder nothing but the lease's blocks until it expires.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable

import grpc
import torch
from baton.transfer.agent import KVAgent
from baton.transfer.handle import KVHandle
from baton.transfer.lease import LeaseTable
from baton.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("baton.transfer")


def block_crc32(kv: torch.Tensor, block_ids) -> tuple[int, ...]:
    """CRC32 of each block's bytes (a debugging option, off by default; CPU pools)."""
    return tuple(zlib.crc32(kv[b].view(torch.uint8).numpy()) for b in block_ids)


class KVHolder(worker_pb2_grpc.KVSourceServicer):
    """Grants leases on prefilled blocks and answers the readers.

    ``free(request_id)`` unpins a request's blocks in the engine; it is called when a lease ends
    (released or expired) and must be safe to call from any thread (the worker posts it to the
    engine thread). ``grant`` is called with the engine's hand-off right after prefill.
    """

    def __init__(self, *, worker_id: str, incarnation: str, address: str, fingerprint: str,
                 agent: KVAgent, leases: LeaseTable, free: Callable[[str], None],
                 checksums: bool = False) -> None:
        self.worker_id, self.incarnation, self.address = worker_id, incarnation, address
        self.fingerprint, self.agent, self.leases = fingerprint, agent, leases
        self._free, self.checksums = free, checksums

    def grant(self, request_id: str, block_ids: tuple[int, ...], num_tokens: int) -> KVHandle:
        lease = self.leases.grant(request_id, block_ids)
        crc = block_crc32(self.agent.kv, block_ids) if self.checksums else ()
        return KVHandle(self.worker_id, self.incarnation, self.address, lease.lease_id,
                        tuple(block_ids), num_tokens, self.fingerprint, lease.expires_at, crc)

    def sweep(self) -> int:
        """Free the blocks of every expired lease; returns how many ended."""
        expired = self.leases.pop_expired()
        for lease in expired:
            log.warning("lease %s (request %s, %d blocks) expired unreleased; blocks freed",
                        lease.lease_id, lease.request_id, len(lease.block_ids))
            self._free(lease.request_id)
        return len(expired)

    def shutdown(self) -> None:
        for lease in self.leases.revoke_all("the holder shut down"):
            self._free(lease.request_id)

    # ---- KVSource RPCs ---------------------------------------------------------------------------

    def Handshake(self, request, context):
        if request.fingerprint != self.fingerprint:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"model fingerprint mismatch: holder {self.worker_id} has "
                          f"{self.fingerprint[:16]}..., reader {request.reader_id} has "
                          f"{request.fingerprint[:16]}...")
        return worker_pb2.HandshakeResponse(
            worker_id=self.worker_id, incarnation=self.incarnation, fingerprint=self.fingerprint,
            agent_metadata=self.agent.metadata(), kv_base_address=self.agent.base,
            block_nbytes=self.agent.block_nbytes, num_blocks=self.agent.num_blocks,
            transports=self.agent.transports())

    def ReleaseLease(self, request, context):
        if request.incarnation != self.incarnation:
            return worker_pb2.ReleaseLeaseResponse(
                intact=False, reason=f"the holder restarted (incarnation {self.incarnation}, "
                                     f"lease from {request.incarnation})")
        result = self.leases.release(request.lease_id)
        if result.lease is not None:
            self._free(result.lease.request_id)
        return worker_pb2.ReleaseLeaseResponse(intact=result.intact, reason=result.reason)
