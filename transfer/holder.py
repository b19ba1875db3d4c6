"""The holder's side of a hand-off (a prefill worker): leases on pinned blocks, the KVSource
RPCs a reader calls (handshake, lease release), and the lease channel.

The lease channel is a TCP listener on the holder's host, the fast way to give a lease back
(protocol and client: ``baton.transfer.lease_client``). A connection's first line is a greeting
with the cluster secret; after ``OK`` each line ``R <incarnation> <lease id>`` is answered
exactly as the ``ReleaseLease`` RPC answers it (it is the same call). The listener serves at most
``max_connections`` at once and closes a connection that does not greet within
``greeting_timeout_s``.

The holder never pushes anything: the reader pulls with one-sided NIXL READs, so a slow or dead
reader costs the holder nothing but the lease's blocks until it expires.
"""

from __future__ import annotations

import hmac
import logging
import socket
import socketserver
import threading
from collections.abc import Callable

import grpc
from baton.engine.kv_layout import KVLayout, LayoutMismatch
from baton.transfer import cluster_secret
from baton.transfer.agent import KVAgent
from baton.transfer.errors import kv_dtype_mismatch, kv_dtype_name
from baton.transfer.handle import KVHandle
from baton.transfer.lease import LeaseTable
from baton.transfer.lease_client import greeting
from baton.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("baton.transfer")


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
        self._lease_server: _LeaseChannel | None = None
        self.lease_port = 0
        self.kv_layout = agent.layout.to_wire() if agent.layout is not None else ""

    def grant(self, request_id: str, block_ids: tuple[int, ...], num_tokens: int) -> KVHandle:
        self.agent.stage_out(block_ids)  # a staged pool: readers READ the host mirror
        lease = self.leases.grant(request_id, block_ids)
        self.agent.wake()  # a read is coming, maybe over a connection not set up yet
        crc = self.agent.block_crc32(block_ids) if self.checksums else ()
        return KVHandle(self.worker_id, self.incarnation, self.address, lease.lease_id,
                        tuple(block_ids), num_tokens, self.fingerprint, lease.expires_at, crc,
                        self.lease_port, kv_dtype_name(self.agent.kv), self.kv_layout)

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

    def serve_lease_channel(self, host: str, secret: str | None = None,
                            max_connections: int = 256, greeting_timeout_s: float = 5.0) -> int:
        """Start the lease channel on ``host``; returns its port. ``secret``: the cluster secret
        a greeting must carry (default: this process's; none set: any greeting is taken)."""
        self._lease_server = _LeaseChannel((host, 0), self.release,
                                           secret if secret is not None
                                           else cluster_secret.current(),
                                           max_connections, greeting_timeout_s)
        threading.Thread(target=self._lease_server.serve_forever, name="lease-channel",
                         daemon=True).start()
        self.lease_port = self._lease_server.server_address[1]
        return self.lease_port

    # ---- KVSource RPCs ---------------------------------------------------------------------------

    def Handshake(self, request, context):
        ours = kv_dtype_name(self.agent.kv)
        if request.kv_dtype and request.kv_dtype != ours:  # named before the fingerprint, which
            # differs too but says nothing a person can act on
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          kv_dtype_mismatch(self.worker_id, ours, request.reader_id,
                                            request.kv_dtype))
        if request.fingerprint != self.fingerprint:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"model fingerprint mismatch: holder {self.worker_id} has "
                          f"{self.fingerprint[:16]}..., reader {request.reader_id} has "
                          f"{request.fingerprint[:16]}...")
        if request.kv_layout and self.agent.layout is not None:  # before any byte moves
            try:
                KVLayout.from_wire(request.kv_layout).read_pairs(self.agent.layout)
            except LayoutMismatch as e:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"holder {self.worker_id}, reader {request.reader_id}: {e}")
        self.agent.wake()  # the reader connects next
        return worker_pb2.HandshakeResponse(
            worker_id=self.worker_id, incarnation=self.incarnation, fingerprint=self.fingerprint,
            agent_metadata=self.agent.metadata(), kv_base_address=self.agent.base,
            block_nbytes=self.agent.block_nbytes, num_blocks=self.agent.num_blocks,
            transports=self.agent.transports(), lease_port=self.lease_port,
            kv_mem_type=self.agent.mem_type, kv_device_id=self.agent.device_id, kv_dtype=ours,
            kv_layout=self.kv_layout)

    def ReleaseLease(self, request, context):
        intact, reason = self.release(request.lease_id, request.incarnation)
        return worker_pb2.ReleaseLeaseResponse(intact=intact, reason=reason)


class _LeaseChannel(socketserver.ThreadingTCPServer):
    """The lease channel's listener: a thread per connection, at most ``max_connections``
    (more are closed at once: their readers release over gRPC), each greeted first."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, release: Callable[[str, str], tuple[bool, str]],
                 secret: str | None, max_connections: int, greeting_timeout_s: float) -> None:
        self.release, self.greeting = release, greeting(secret)
        self.max_connections, self.greeting_timeout_s = max_connections, greeting_timeout_s
        self._open: set = set()  # the accepted connections' sockets
        self._count = threading.Lock()
        super().__init__(address, _LeaseLines)

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def verify_request(self, request, client_address) -> bool:
        with self._count:
            if len(self._open) >= self.max_connections:
                log.warning("lease channel: %d connections open, refusing %s",
                            len(self._open), client_address[0])
                return False
            self._open.add(request)
            return True

    def close_request(self, request) -> None:
        """Every connection ends here, refused ones too: only an accepted one frees a place."""
        super().close_request(request)
        with self._count:
            self._open.discard(request)


class _LeaseLines(socketserver.StreamRequestHandler):
    server: _LeaseChannel

    def handle(self) -> None:
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connection.settimeout(self.server.greeting_timeout_s)
        try:
            hello = self.rfile.readline()
        except OSError:  # no greeting in time
            return
        if not hmac.compare_digest(hello, self.server.greeting):
            self.wfile.write(b"NO the lease channel requires the cluster secret\n")
            return
        self.connection.settimeout(None)
        self.wfile.write(b"OK\n")
        for line in self.rfile:
            parts = line.decode(errors="replace").split()
            if len(parts) != 3 or parts[0] != "R":
                self.wfile.write(b"0 malformed lease release\n")
                continue
            intact, reason = self.server.release(parts[2], parts[1])
            self.wfile.write(b"1\n" if intact else f"0 {reason}\n".encode())
