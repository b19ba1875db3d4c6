"""Giving a lease back: the one path every reader of a hand-off (a decode worker after its READ,
a router abandoning a handle) uses.

A release sits on the critical path of every hand-off, so it goes over the holder's lease
channel when it can: one TCP connection per holder, kept open, one line per release (~0.05 ms on
loopback against ~1.3 ms for a gRPC round trip from Python on a small machine)::

    reader                                      holder (transfer/holder.py)
    B1 <cluster secret or ->\\n   ──connect──►   checks the secret (hmac), at most
                                 ◄───────────   OK\\n  (or "NO <reason>\\n" and closes)
    R <incarnation> <lease id>\\n ─────────────►  LeaseTable.release
                                 ◄───────────   1\\n (intact)  |  0 <reason>\\n

The channel carries the same cluster secret as the gRPC calls (in its greeting, once per
connection), and the holder bounds how many connections it serves. Where the channel cannot be
reached (a holder behind ``--advertise-port`` or NAT, a firewall that drops the port), cannot be
greeted, or breaks, the release goes over gRPC (``KVSource/ReleaseLease``) instead, within the
same deadline; an unreachable channel is not tried again for ``retry_s``. Both give exactly the
same answer, because the holder runs the same call for both.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from baton.transfer import cluster_secret
from baton.transfer.errors import PeerUnavailableError, TransferDeadlineError, TransferError

log = logging.getLogger("baton.transfer")

GREETING = "B1"  # the lease channel's protocol version, first word of the greeting


def greeting(secret: str | None) -> bytes:
    return f"{GREETING} {secret or '-'}\n".encode()


@dataclass
class _Conn:
    sock: socket.socket
    file: object
    lock: threading.Lock = field(default_factory=threading.Lock)

    def close(self) -> None:
        self.file.close()
        self.sock.close()


class LeaseClient:
    """Releases leases over each holder's lease channel, or over gRPC when the channel fails.

    Thread-safe; one per process side (a reader, a router). ``channel(address)`` gives the gRPC
    channel to a holder (default: a cached one per address carrying the cluster secret);
    ``secret`` defaults to this process's cluster secret.
    """

    def __init__(self, channel: Callable[[str], grpc.Channel] | None = None,
                 secret: str | None = None, retry_s: float = 30.0,
                 connect_timeout_s: float = 1.0) -> None:
        self._secret = secret if secret is not None else cluster_secret.current()
        self._own_channels: dict[str, grpc.Channel] = {}
        self._channel = channel or self.own_channel
        self._conns: dict[tuple[str, int], _Conn] = {}
        self._unreachable: dict[tuple[str, int], float] = {}  # -> when to try again
        self._lock = threading.Lock()
        self.retry_s, self.connect_timeout_s = retry_s, connect_timeout_s
        self.fallbacks = 0  # releases that went over gRPC though the holder has a channel

    def release(self, handle, deadline: float) -> tuple[bool, str]:
        """Give ``handle``'s lease back (a :class:`~baton.transfer.handle.KVHandle` or its
        protobuf message); ``(intact, reason)``: whether the lease held until now. Raises
        :class:`TransferDeadlineError` past ``deadline`` (``time.monotonic()``) and
        :class:`PeerUnavailableError` when the holder cannot be reached at all."""
        port = getattr(handle, "lease_port", 0)
        if port:
            key = (handle.address.rsplit(":", 1)[0], port)
            answer = self._over_channel(key, handle, deadline)
            if answer is not None:
                return answer
            self.fallbacks += 1
        return self._over_grpc(handle, deadline)

    def release_quietly(self, handle, timeout: float) -> None:
        """Best effort: give a lease back after a failed or abandoned hand-off, so the holder
        frees its blocks before the lease expires (it would anyway)."""
        try:
            self.release(handle, time.monotonic() + timeout)
        except TransferError as e:
            log.info("could not give lease %s back to %s: %s", handle.lease_id, handle.address,
                     e)

    def connect(self, address: str, port: int, deadline: float) -> bool:
        """Open (and greet) the lease channel of the holder at ``address`` ahead of its first
        release; False if it cannot be reached (releases will go over gRPC)."""
        return self._conn((address.rsplit(":", 1)[0], port), deadline) is not None

    def forget(self, address: str, port: int) -> None:
        """Close the lease channel to the holder at ``address`` (it restarted or went away);
        other holders on the same host keep theirs."""
        key = (address.rsplit(":", 1)[0], port)
        with self._lock:
            conn = self._conns.pop(key, None)
            self._unreachable.pop(key, None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
            channels, self._own_channels = list(self._own_channels.values()), {}
        for c in conns:
            c.close()
        for ch in channels:
            ch.close()

    # ---- the lease channel ---------------------------------------------------------------------

    def _over_channel(self, key, handle, deadline: float) -> tuple[bool, str] | None:
        """The answer over the channel, or None when the channel failed (use gRPC)."""
        conn = self._conn(key, deadline)
        if conn is None:
            return None
        line = f"R {handle.incarnation} {handle.lease_id}\n".encode()
        try:
            with conn.lock:
                conn.sock.settimeout(_left(deadline, handle.address))
                conn.sock.sendall(line)
                answer = conn.file.readline().decode(errors="replace")
        except TimeoutError as e:
            self._drop(key, conn)
            raise TransferDeadlineError(
                f"lease release with {handle.address} passed its deadline") from e
        except OSError as e:
            log.info("lease channel %s:%d broke (%s); releasing over gRPC", *key, e)
            self._drop(key, conn)
            return None
        if not answer.endswith("\n"):
            self._drop(key, conn)
            return None
        return answer.startswith("1"), answer[2:].strip()

    def _conn(self, key: tuple[str, int], deadline: float) -> _Conn | None:
        with self._lock:
            conn = self._conns.get(key)
            if conn is not None:
                return conn
            if self._unreachable.get(key, 0.0) > time.monotonic():
                return None
        conn = self._open(key, deadline)
        with self._lock:
            if conn is None:
                self._unreachable[key] = time.monotonic() + self.retry_s
                return None
            self._unreachable.pop(key, None)
            other = self._conns.setdefault(key, conn)
        if other is not conn:  # another thread connected first
            conn.close()
        return other

    def _open(self, key: tuple[str, int], deadline: float) -> _Conn | None:
        """Connect and greet within half the time left (the rest is for gRPC) and at most
        ``connect_timeout_s`` (a firewall that drops the port costs that once per ``retry_s``);
        None if either fails."""
        budget = min((deadline - time.monotonic()) / 2, self.connect_timeout_s)
        if budget <= 0:
            return None
        try:
            sock = socket.create_connection(key, timeout=budget)
        except OSError as e:
            log.info("lease channel %s:%d cannot be reached (%s); releases go over gRPC",
                     *key, e)
            return None
        conn = _Conn(sock, sock.makefile("rb"))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(greeting(self._secret))
            answer = conn.file.readline().decode(errors="replace").strip()
        except OSError as e:
            answer = f"NO {e}"
        if answer != "OK":
            log.warning("lease channel %s:%d refused the greeting (%s); releases go over gRPC",
                        *key, answer or "closed")
            conn.close()
            return None
        return conn

    def _drop(self, key, conn: _Conn) -> None:
        with self._lock:
            if self._conns.get(key) is conn:
                del self._conns[key]
        conn.close()

    # ---- gRPC ----------------------------------------------------------------------------------

    def own_channel(self, address: str) -> grpc.Channel:
        """This client's cached channel to ``address`` (carrying its secret)."""
        with self._lock:
            ch = self._own_channels.get(address)
            if ch is None:
                ch = self._own_channels[address] = cluster_secret.channel(
                    address, secret=self._secret)
            return ch

    def _over_grpc(self, handle, deadline: float) -> tuple[bool, str]:
        from baton.v1 import worker_pb2, worker_pb2_grpc

        stub = worker_pb2_grpc.KVSourceStub(self._channel(handle.address))
        try:
            resp = stub.ReleaseLease(
                worker_pb2.ReleaseLeaseRequest(lease_id=handle.lease_id,
                                               incarnation=handle.incarnation),
                timeout=_left(deadline, handle.address))
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TransferDeadlineError(
                    f"lease release with {handle.address} passed its deadline") from e
            raise PeerUnavailableError(f"lease release with {handle.address} failed: "
                                       f"{e.code().name}: {e.details()}") from e
        return resp.intact, resp.reason


def _left(deadline: float, address: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferDeadlineError(f"no time left for the lease release with {address}")
    return left
