"""One lease path (baton.transfer.lease_client): a real holder's gRPC KVSource and lease channel
on loopback, in this process, and the LeaseClient that readers and routers release through.
The holder here has no NIXL agent: a release never touches one."""

from __future__ import annotations

import socket
import time

import pytest
import torch
from baton.services.common.process import make_server
from baton.transfer.errors import PeerUnavailableError
from baton.transfer.holder import KVHolder
from baton.transfer.lease import LeaseTable
from baton.transfer.lease_client import LeaseClient
from baton.v1 import worker_pb2_grpc

from tests.support.processes import free_port


class Holder:
    """A KVHolder serving KVSource over gRPC and its lease channel on 127.0.0.1."""

    def __init__(self, secret: str | None = None, max_connections: int = 256,
                 greeting_timeout_s: float = 5.0) -> None:
        self.freed: list[str] = []
        self.server = make_server(max_workers=4)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.holder = KVHolder(worker_id="h", incarnation="inc1", address=f"127.0.0.1:{port}",
                               fingerprint="fp", agent=_NoAgent(), leases=LeaseTable(ttl_s=60),
                               free=self.freed.append)
        worker_pb2_grpc.add_KVSourceServicer_to_server(self.holder, self.server)
        self.server.start()
        self.holder.serve_lease_channel("127.0.0.1", secret=secret or "",
                                        max_connections=max_connections,
                                        greeting_timeout_s=greeting_timeout_s)

    def grant(self, rid: str):
        return self.holder.grant(rid, (1, 2), 8)

    def stop(self) -> None:
        self.holder.shutdown()
        self.server.stop(None)


class _NoAgent:
    kv = torch.empty(0)  # no pool: only its element type is asked (for the handle)
    layout = None  # and no layout: the handle names none

    def stage_out(self, block_ids) -> None:
        pass

    def wake(self) -> None:
        pass


@pytest.fixture
def holder():
    h = Holder()
    yield h
    h.stop()


def deadline(s: float = 30.0) -> float:
    return time.monotonic() + s


def test_a_release_over_the_channel_frees_the_blocks_and_answers_as_grpc_does(holder):
    client = LeaseClient(secret="")
    try:
        first, second = holder.grant("a"), holder.grant("b")
        assert first.lease_port == holder.holder.lease_port > 0
        assert client.release(first, deadline()) == (True, "")
        assert holder.freed == ["a"]
        again = client.release(first, deadline())  # released already: not intact, with why
        assert again == (False, "released")
        assert client.fallbacks == 0
        # the same answers over gRPC (a handle without a lease port)
        from dataclasses import replace
        assert client.release(replace(second, lease_port=0), deadline()) == (True, "")
        grpc_again = client.release(replace(second, lease_port=0), deadline())
        assert grpc_again == (False, "released")
        assert holder.freed == ["a", "b"]
        assert client.fallbacks == 0
    finally:
        client.close()


def test_an_unreachable_lease_channel_falls_back_to_grpc(holder):
    """Bug: a lease channel the reader could not reach (a holder behind --advertise-port, a
    port a firewall drops) failed the hand-off although the gRPC release would work."""
    from dataclasses import replace

    closed = free_port()  # nothing listens there
    client = LeaseClient(secret="")
    try:
        handle = replace(holder.grant("a"), lease_port=closed)
        assert client.connect(handle.address, closed, deadline()) is False
        assert client.release(handle, deadline()) == (True, "")
        assert holder.freed == ["a"] and client.fallbacks == 1
        # not tried again at once: the next release goes straight to gRPC
        assert client.release(replace(holder.grant("b"), lease_port=closed),
                              deadline()) == (True, "")
        assert holder.freed == ["a", "b"] and client.fallbacks == 2
    finally:
        client.close()


def test_the_channel_requires_the_cluster_secret():
    h = Holder(secret="s3cret")
    try:
        with socket.create_connection(("127.0.0.1", h.holder.lease_port), timeout=30) as s:
            f = s.makefile("rb")
            s.sendall(b"B1 wrong\nR inc1 x\n")
            assert f.readline().startswith(b"NO ")
            assert f.readline() == b""  # closed: no release was answered
        wrong = LeaseClient(secret="wrong")
        right = LeaseClient(secret="s3cret")
        try:
            assert wrong.connect(h.holder.address, h.holder.lease_port, deadline()) is False
            # the test's gRPC server has no secret gate: the fallback answers
            assert wrong.release(h.grant("a"), deadline()) == (True, "")
            assert wrong.fallbacks == 1
            assert right.release(h.grant("b"), deadline()) == (True, "")
            assert right.fallbacks == 0
            assert h.freed == ["a", "b"]
        finally:
            wrong.close()
            right.close()
    finally:
        h.stop()


def test_the_listener_is_bounded():
    h = Holder(max_connections=1, greeting_timeout_s=0.5)
    try:
        first = LeaseClient(secret="")
        assert first.connect(h.holder.address, h.holder.lease_port, deadline())
        # the one slot is taken: the next connection is closed at once, its client uses gRPC
        second = LeaseClient(secret="")
        assert second.release(h.grant("a"), deadline()) == (True, "")
        assert second.fallbacks == 1
        # a refused connection frees no place: another is refused too
        third = LeaseClient(secret="")
        assert third.connect(h.holder.address, h.holder.lease_port, deadline()) is False
        assert h.holder._lease_server.open_connections == 1
        third.close()
        assert first.release(h.grant("b"), deadline()) == (True, "")
        assert first.fallbacks == 0
        first.close()
        second.close()
    finally:
        h.stop()


def test_a_connection_that_never_greets_is_closed():
    h = Holder(greeting_timeout_s=0.5)
    try:
        with socket.create_connection(("127.0.0.1", h.holder.lease_port), timeout=30) as s:
            s.settimeout(60)  # hang detector: the holder closes it after 0.5 s
            assert s.recv(64) == b""
    finally:
        h.stop()


def test_a_holder_that_cannot_be_reached_at_all_is_a_typed_error():
    port = free_port()
    from baton.transfer.handle import KVHandle

    handle = KVHandle("h", "inc", f"127.0.0.1:{port}", "l", (1,), 4, "fp", time.time() + 60,
                      lease_port=free_port())
    client = LeaseClient(secret="")
    try:
        with pytest.raises(PeerUnavailableError, match="lease release"):
            client.release(handle, deadline(5.0))
    finally:
        client.close()


def test_forgetting_one_holder_keeps_the_channels_to_others_on_its_host():
    a, b = Holder(), Holder()
    client = LeaseClient(secret="")
    try:
        for h in (a, b):
            assert client.connect(h.holder.address, h.holder.lease_port, deadline())
        kept = client._conns[("127.0.0.1", b.holder.lease_port)]
        client.forget(a.holder.address, a.holder.lease_port)  # a restarted
        assert client._conns.get(("127.0.0.1", b.holder.lease_port)) is kept  # b's stays open
        assert ("127.0.0.1", a.holder.lease_port) not in client._conns
        assert client.release(b.grant("x"), deadline()) == (True, "")
        assert client.release(a.grant("y"), deadline()) == (True, "")  # reconnects
        assert client.fallbacks == 0 and b.freed == ["x"] and a.freed == ["y"]
        assert len(client._conns) == 2
    finally:
        client.close()
        a.stop()
        b.stop()
