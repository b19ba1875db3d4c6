"""The reader's side of a hand-off (a decode worker): handshake, NIXL READ, lease release.

A pull walks through :class:`TransferState` in order; any failure lands in ``FAILED`` with a
typed :class:`TransferError`, and the caller frees the blocks it reserved (the reader never
frees anything itself: it only fills blocks it was given).

Streaming layer by layer (room left for it): the pool is block-major, so a block's layers are
contiguous and a hand-off reads whole blocks after the prefill finished. To overlap the transfer
with a long prefill, the holder would grant the lease when the request is scheduled (not when it
finishes) and publish per-chunk progress (``num_computed_tokens``) on the lease; the reader would
READ each block as soon as it is full and computed, chunk by chunk, and the final release still
decides ``intact``. The protocol (lease, index lists, release) stays as it is; only the moment the
holder grants and a progress field are new.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field

import grpc
from baton.transfer import cluster_secret
from baton.transfer.agent import KVAgent
from baton.transfer.errors import (
    ChecksumMismatchError,
    FingerprintMismatchError,
    LeaseLostError,
    PeerUnavailableError,
    TransferDeadlineError,
    TransferError,
    kv_dtype_mismatch,
    kv_dtype_name,
)
from baton.transfer.handle import KVHandle
from baton.transfer.lease_client import LeaseClient
from baton.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("baton.transfer")


class TransferState(enum.IntEnum):
    BOOTSTRAPPING = 0  # handshake with the holder (first contact, or it restarted)
    TRANSFERRING = 1  # NIXL READ in flight
    RELEASING = 2  # asking the holder whether the lease held
    SUCCESS = 3
    FAILED = 4


@dataclass
class PullResult:
    state: TransferState = TransferState.BOOTSTRAPPING
    bytes: int = 0
    blocks_read: int = 0
    blocks_local: int = 0
    handshake_s: float = 0.0
    read_s: float = 0.0
    release_s: float = 0.0
    transports: str = ""
    error: TransferError | None = field(default=None, repr=False)


@dataclass
class _Peer:
    address: str
    channel: grpc.Channel
    stub: worker_pb2_grpc.KVSourceStub
    worker_id: str = ""
    incarnation: str = ""
    agent_name: str = ""
    # UCX transports seen once the first READ from this peer set its protocols up; read from
    # UCX's log once per peer, not per hand-off
    transports: str = ""
    lease_port: int = 0  # its lease channel (transfer/lease_client.py); 0: none


class KVReader:
    """Pulls leased KV blocks from holders into this worker's pool.

    Thread-safe; pulls for different requests run concurrently. Peers are keyed by address; a
    handle naming a new incarnation (the holder restarted) re-handshakes, and any peer failure
    drops the peer so the next pull starts afresh: no manual reconnect, ever.
    """

    def __init__(self, agent: KVAgent, fingerprint: str, reader_id: str,
                 fault_delay_release_s: float = 0.0, leases: LeaseClient | None = None) -> None:
        self.agent, self.fingerprint, self.reader_id = agent, fingerprint, reader_id
        self.leases = leases or LeaseClient(channel=self._channel)
        self.fault_delay_release_s = fault_delay_release_s  # tests only: widen the lease race
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._peer_locks: dict[str, threading.Lock] = {}
        self.pulling = 0  # hand-offs in progress (Info reports it)
        self._pulling_lock = threading.Lock()

    @property
    def num_peers(self) -> int:
        return len(self._peers)

    def pull(self, handle: KVHandle, local_block_ids: tuple[int, ...], num_local: int,
             deadline: float) -> PullResult:
        """Fill ``local_block_ids[num_local:]`` with the holder's blocks and release the lease.

        ``deadline`` is ``time.monotonic()`` seconds. Raises a :class:`TransferError` subclass;
        on return the blocks hold exactly the KV the holder prefilled.
        """
        res = PullResult(blocks_local=num_local)
        assert len(local_block_ids) == len(handle.block_ids)
        with self._pulling_lock:
            self.pulling += 1
        try:
            self._read_and_release(handle, local_block_ids, num_local, deadline, res)
            return res
        except TransferError as e:
            # give the lease back early if the holder may still hold it
            if not isinstance(e, LeaseLostError | PeerUnavailableError) and (
                    res.state != TransferState.RELEASING):
                self.leases.release_quietly(handle, timeout=1.0)
            res.state, res.error = TransferState.FAILED, e
            raise
        finally:
            with self._pulling_lock:
                self.pulling -= 1

    def _read_and_release(self, handle: KVHandle, local_block_ids: tuple[int, ...],
                          num_local: int, deadline: float, res: PullResult) -> None:
        """:meth:`pull`'s steps, recorded in ``res`` (its state says how far it got)."""
        ours = kv_dtype_name(self.agent.kv)
        if handle.kv_dtype and handle.kv_dtype != ours:  # said as such: both element types
            raise FingerprintMismatchError(
                self.fingerprint, handle.fingerprint, handle.worker_id,
                kv_dtype_mismatch(handle.worker_id, handle.kv_dtype, self.reader_id, ours))
        if handle.fingerprint != self.fingerprint:
            raise FingerprintMismatchError(self.fingerprint, handle.fingerprint,
                                           handle.worker_id)
        if handle.kv_layout:  # a pair that cannot map fails here, before any byte moves
            self.agent.plan(handle.kv_layout, self.agent.block_nbytes)
        t0 = time.monotonic()
        peer = self._peer(handle, deadline)
        res.handshake_s = time.monotonic() - t0
        res.state = TransferState.TRANSFERRING
        remote = list(handle.block_ids[num_local:])
        local = list(local_block_ids[num_local:])
        t0 = time.monotonic()
        try:
            self.agent.read(peer.agent_name, remote, local, deadline)
        except PeerUnavailableError:
            self._drop(peer)
            raise
        res.read_s = time.monotonic() - t0
        res.blocks_read, res.bytes = len(remote), len(remote) * self.agent.block_nbytes
        if handle.block_crc32 and self.agent.block_crc32(local) != tuple(
                handle.block_crc32[num_local:]):
            res.state = TransferState.RELEASING
            self._release(peer, handle, deadline)
            raise ChecksumMismatchError(
                f"blocks read from {handle.worker_id} differ from the holder's checksums")
        if self.fault_delay_release_s:
            time.sleep(self.fault_delay_release_s)
        res.state = TransferState.RELEASING
        t0 = time.monotonic()
        intact, reason = self._release(peer, handle, deadline)
        res.release_s = time.monotonic() - t0
        if not intact:
            raise LeaseLostError(handle.lease_id, handle.worker_id, reason)
        peer.transports = peer.transports or self.agent.transports()
        res.transports = peer.transports
        res.state = TransferState.SUCCESS

    # ---- peers ---------------------------------------------------------------------------------

    def connect(self, address: str, deadline: float, probe_block: int | None = None) -> str:
        """Handshake with a holder ahead of any hand-off (a decode worker does this for its
        configured peers before it reports ready). ``probe_block``: also READ that one block into
        our block of the same index, so the transports are known now; only safe while the
        local block is unused (at start-up). Returns the transports in use."""
        with self._peer_lock(address):
            peer = self._peers.get(address) or self._handshake(address, deadline)
        if probe_block is not None:
            try:
                self.agent.read(peer.agent_name, [probe_block], [probe_block], deadline)
            except PeerUnavailableError:
                self._drop(peer)
                raise
            peer.transports = self.agent.transports()
        return peer.transports

    def _peer_lock(self, address: str) -> threading.Lock:
        """One lock per holder address: concurrent first hand-offs share one handshake."""
        with self._lock:
            return self._peer_locks.setdefault(address, threading.Lock())

    def _peer(self, handle: KVHandle, deadline: float) -> _Peer:
        with self._peer_lock(handle.address):
            peer = self._peers.get(handle.address)
            if peer is not None and peer.incarnation == handle.incarnation:
                return peer
            if peer is not None:  # the holder restarted: its old agent and leases are gone
                log.info("holder %s at %s restarted (%s -> %s); reconnecting", handle.worker_id,
                         handle.address, peer.incarnation, handle.incarnation)
                self._drop(peer)
            peer = self._handshake(handle.address, deadline)
            if peer.incarnation != handle.incarnation:
                raise LeaseLostError(handle.lease_id, handle.worker_id,
                                     f"the holder restarted (now {peer.incarnation}); the "
                                     "handle's blocks are gone")
            return peer

    def _handshake(self, address: str, deadline: float) -> _Peer:
        channel = cluster_secret.channel(address)
        peer = _Peer(address, channel, worker_pb2_grpc.KVSourceStub(channel))
        try:
            ours = kv_dtype_name(self.agent.kv)
            layout = self.agent.layout.to_wire() if self.agent.layout is not None else ""
            resp = peer.stub.Handshake(
                worker_pb2.HandshakeRequest(fingerprint=self.fingerprint,
                                            reader_id=self.reader_id, kv_dtype=ours,
                                            kv_layout=layout),
                timeout=_left(deadline, address, "handshake"))
            # belt and braces: the holder checks both too
            if resp.kv_dtype and resp.kv_dtype != ours:
                raise FingerprintMismatchError(self.fingerprint, resp.fingerprint, address,
                                               kv_dtype_mismatch(address, resp.kv_dtype,
                                                                 self.reader_id, ours))
            if resp.fingerprint != self.fingerprint:
                raise FingerprintMismatchError(self.fingerprint, resp.fingerprint, address)
            peer.agent_name = self.agent.add_peer(resp.agent_metadata, resp.kv_base_address,
                                                  resp.block_nbytes, resp.num_blocks,
                                                  resp.kv_mem_type or "DRAM",
                                                  resp.kv_device_id, resp.kv_layout)
        except grpc.RpcError as e:
            channel.close()
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:  # the holder's words
                raise FingerprintMismatchError(self.fingerprint, "?", address,
                                               f"{address} refused: {e.details()}") from e
            raise _rpc_error(e, address, "handshake") from e
        except TransferError:
            channel.close()
            raise
        except Exception as e:  # NIXL's own (a bad metadata blob, a backend that refused it)
            channel.close()
            raise PeerUnavailableError(f"handshake with {address}: NIXL did not take the "
                                       f"peer: {e}") from e
        peer.worker_id, peer.incarnation = resp.worker_id, resp.incarnation
        peer.lease_port = resp.lease_port
        # open the lease channel now rather than on the first release; where it cannot be
        # reached, releases go over gRPC (the LeaseClient decides, each time)
        if resp.lease_port and not self.leases.connect(address, resp.lease_port, deadline):
            log.info("lease channel of %s (port %d) unreachable: releasing over gRPC", address,
                     resp.lease_port)
        self._peers[address] = peer
        log.info("handshake with %s (%s, incarnation %s): %d blocks of %d bytes", address,
                 resp.worker_id, resp.incarnation, resp.num_blocks, resp.block_nbytes)
        return peer

    def _release(self, peer: _Peer, handle: KVHandle, deadline: float) -> tuple[bool, str]:
        try:
            return self.leases.release(handle, deadline)
        except TransferError:
            self._drop(peer)
            raise

    def _channel(self, address: str) -> grpc.Channel:
        """The gRPC channel to a holder: the handshake's while it lives (LeaseClient's
        fallback), else a cached one of the lease client's."""
        peer = self._peers.get(address)
        return peer.channel if peer is not None else self.leases.own_channel(address)

    def _drop(self, peer: _Peer) -> None:
        with self._lock:
            if self._peers.get(peer.address) is peer:
                del self._peers[peer.address]
        if peer.agent_name:
            self.agent.remove_peer(peer.agent_name)
        if peer.lease_port:
            self.leases.forget(peer.address, peer.lease_port)
        peer.channel.close()

    def close(self) -> None:
        for peer in list(self._peers.values()):
            self._drop(peer)
        self.leases.close()


def _left(deadline: float, address: str, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferDeadlineError(f"no time left for the {what} with {address}")
    return left


def _rpc_error(e: grpc.RpcError, address: str, what: str) -> TransferError:
    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TransferDeadlineError(f"{what} with {address} passed its deadline")
    return PeerUnavailableError(f"{what} with {address} failed: {e.code().name}: {e.details()}")
