"""The holder's side of a hand-off (a prefill worker): leases on pinned blocks, the KVSource
RPCs a reader calls (handshake, lease release), and the lease channel.

The lease channel is a plain TCP listener on the holder's host: a reader keeps one connection
per holder and releases a lease with one line, ``R <incarnation> <lease id>\n``, answered by
``1\n`` (intact) or ``0 <reason>\n``. It gives exactly the ReleaseLease answer, because it is the
same call; it exists because a release sits on the critical path of every hand-off, and a gRPC
round trip from Python costs ~1.3 ms on a small machine against ~0.05 ms for a socket.

The holder never pushes anything: the reader pulls with one-sided NIXL READs, so a slow or dead
reader costs the holder nothing but the lease's blocks until it expires.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
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
    """CRC32 of each block's bytes (a debugging option, off by default; a GPU pool's blocks are
    copied to the host for it)."""
    return tuple(zlib.crc32(kv[b].view(torch.uint8).cpu().numpy()) for b in block_ids)


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
        self._lease_server: socketserver.ThreadingTCPServer | None = None
        self.lease_port = 0

    def grant(self, request_id: str, block_ids: tuple[int, ...], num_tokens: int) -> KVHandle:
        self.agent.stage_out(block_ids)  # a staged pool: readers READ the host mirror
        lease = self.leases.grant(request_id, block_ids)
        self.agent.wake()  # a read is coming, maybe over a connection not set up yet
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
        if self._lease_server is not None:
            self._lease_server.shutdown()
            self._lease_server.server_close()
        for lease in self.leases.revoke_all("the holder shut down"):
            self._free(lease.request_id)

    def release(self, lease_id: str, incarnation: str) -> tuple[bool, str]:
        """End a lease for its reader; (intact, reason). Frees the blocks if it still held them."""
        if incarnation != self.incarnation:
            return False, (f"the holder restarted (incarnation {self.incarnation}, lease from "
                           f"{incarnation})")
        result = self.leases.release(lease_id)
        if result.lease is not None:
            self._free(result.lease.request_id)
        return result.intact, result.reason

    def serve_lease_channel(self, host: str) -> int:
        """Start the lease channel on ``host``; returns its port."""
        holder = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for line in self.rfile:
                    parts = line.decode(errors="replace").split()
                    if len(parts) != 3 or parts[0] != "R":
                        self.wfile.write(b"0 malformed lease release\n")
                        continue
                    intact, reason = holder.release(parts[2], parts[1])
                    self.wfile.write(b"1\n" if intact else f"0 {reason}\n".encode())

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._lease_server = Server((host, 0), Handler)
        threading.Thread(target=self._lease_server.serve_forever, name="lease-channel",
                         daemon=True).start()
        self.lease_port = self._lease_server.server_address[1]
        return self.lease_port

    # ---- KVSource RPCs ---------------------------------------------------------------------------

    def Handshake(self, request, context):
        if request.fingerprint != self.fingerprint:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"model fingerprint mismatch: holder {self.worker_id} has "
                          f"{self.fingerprint[:16]}..., reader {request.reader_id} has "
                          f"{request.fingerprint[:16]}...")
        self.agent.wake()  # the reader connects next
        return worker_pb2.HandshakeResponse(
            worker_id=self.worker_id, incarnation=self.incarnation, fingerprint=self.fingerprint,
            agent_metadata=self.agent.metadata(), kv_base_address=self.agent.base,
            block_nbytes=self.agent.block_nbytes, num_blocks=self.agent.num_blocks,
            transports=self.agent.transports(), lease_port=self.lease_port,
            kv_mem_type=self.agent.mem_type, kv_device_id=self.agent.device_id)

    def ReleaseLease(self, request, context):
        intact, reason = self.release(request.lease_id, request.incarnation)
        return worker_pb2.ReleaseLeaseResponse(intact=intact, reason=reason)
