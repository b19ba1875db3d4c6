"""A decode worker's hand-off when something goes wrong between reserving blocks and committing
them: a READ NIXL cannot cancel (its blocks are quarantined), an error that is not a
TransferError (the request still ends and frees everything), a holder whose lease channel
cannot be reached (the release goes over gRPC). Real engine, real engine loop, real NIXL
agents in this process; the one fake is a NIXL agent whose READ never ends (a stuck transfer
cannot be made on purpose), and the test says where it stands in."""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from baton.engine.params import SamplingParams
from baton.services.common import tracing
from baton.services.common.metrics import WorkerMetrics
from baton.services.common.process import make_server
from baton.services.worker.decode_role import DecodeService
from baton.services.worker.engine_loop import EngineLoop
from baton.transfer.agent import KVAgent, configure_ucx
from baton.transfer.errors import PeerUnavailableError, ReadInFlightError
from baton.transfer.handle import KVHandle
from baton.transfer.holder import KVHolder
from baton.transfer.lease import LeaseTable
from baton.transfer.reader import KVReader
from baton.v1 import worker_pb2_grpc

from tests.support.processes import free_port

PROMPT = list(range(5, 30))  # 25 tokens: 7 blocks of 4


class Ended(Exception):
    """What a servicer context's abort raises."""


class Context:
    """The parts of a grpc.ServicerContext a decode servicer's hand-off uses."""

    code = details = None
    trailing = ()

    def abort(self, code, details):
        self.code, self.details = code, details
        raise Ended(details)

    def set_trailing_metadata(self, md) -> None:
        self.trailing = md

    def is_active(self) -> bool:
        return True


class StuckNixl:
    """Stands in for a nixl_agent whose READ toward "peer" stays in progress and whose handle
    cannot be released while it does (NIXL's answer when it cannot cancel a transfer); every
    other call goes to the real agent. ``state`` is what the transfer reports."""

    def __init__(self, real) -> None:
        self.real, self.state, self.released = real, "PROC", []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def make_prepped_xfer(self, *args):
        return "stuck-read"

    def transfer(self, h):
        return "PROC"

    def check_xfer_state(self, h):
        return self.state

    def release_xfer_handle(self, h):
        if self.state == "PROC":
            raise RuntimeError("nixlInProgError: cannot release a transfer in progress")
        self.released.append(h)

    def release_dlist_handle(self, h):
        if h != "peer-dlist":
            self.real.release_dlist_handle(h)

    def remove_remote_agent(self, name):
        if name != "peer":
            self.real.remove_remote_agent(name)


class ReadOnly:
    """A reader whose pull is the real agent's READ of the blocks it was given."""

    def __init__(self, agent: KVAgent) -> None:
        self.agent = agent

    def pull(self, handle, local_ids, num_local, deadline):
        self.agent.read("peer", list(handle.block_ids[num_local:]), list(local_ids[num_local:]),
                        deadline)


class Raising:
    """A reader whose pull fails with an error that is not a TransferError."""

    def pull(self, handle, local_ids, num_local, deadline):
        raise RuntimeError("nixlBackendError: add_remote_agent failed")


@pytest.fixture
def decode(tiny_engine):
    engine = tiny_engine(num_kv_blocks=16)
    loop = EngineLoop(engine)
    made = []

    def build(reader) -> DecodeService:
        service = DecodeService(loop, reader, "d", "inc", 5.0, metrics=WorkerMetrics(engine,
                                                                                     "decode"))
        made.append(service)
        loop.start()
        return service

    yield build
    loop.stop()


def handle_for(slots) -> KVHandle:
    return KVHandle("h", "inc", "127.0.0.1:1", "lease", tuple(range(len(slots.block_ids))),
                    len(PROMPT), "fp", time.time() + 60)


def reserve(service, rid: str, n_tokens: int):
    return service.loop.run(service.engine.reserve_handoff, rid, list(range(5, 5 + n_tokens)),
                            7, SamplingParams(max_tokens=4))


def gauge(service) -> float:
    return service.metrics.registry.get_sample_value("baton_worker_kv_blocks_quarantined")


def test_a_read_that_cannot_be_cancelled_keeps_its_blocks_quarantined_until_it_ends(decode):
    """Bug: past its deadline, a READ NIXL could not cancel went on writing into blocks the
    decode worker had already freed; the next request that got them decoded corrupted KV."""
    configure_ucx()
    agent = KVAgent("stuck-reader", torch.zeros(16, 4, 8))
    nixl = agent.agent = StuckNixl(agent.agent)
    agent._remote["peer"] = "peer-dlist"
    agent._plans["peer"] = ([(0, 0)], agent.num_blocks)  # the same geometry as ours
    try:
        service = decode(ReadOnly(agent))
        engine = service.engine
        slots = reserve(service, "r1", len(PROMPT))
        ctx = Context()
        with pytest.raises(Ended):
            service._pull("r1", handle_for(slots), slots, time.monotonic() - 1, ctx,
                          tracing.NO_SPAN)
        stats = service.loop.run(engine.stats)
        assert "r1" not in engine.requests  # the request ended...
        assert stats.free_blocks == 16 - 7 and stats.quarantined_blocks == 7  # ...its blocks not
        assert ctx.code == grpc.StatusCode.DEADLINE_EXCEEDED and "quarantined" in ctx.details
        assert gauge(service) == 7
        # the 9 free blocks are all a new hand-off can get: the quarantined 7 are handed out
        # to no one while the READ may still write them
        assert reserve(service, "r2", 40) is None  # 10 blocks
        nine = reserve(service, "r3", 36)
        assert nine is not None and not set(nine.block_ids) & set(slots.block_ids)
        service.loop.run(engine.abort, "r3")
        service.loop.run(engine.check_integrity)
        # NIXL reports the READ ended: the next tick frees the blocks
        seen = service.loop.frees
        nixl.state = "DONE"
        service.loop.wake()
        while service.loop.run(engine.stats).quarantined_blocks:
            seen = service.loop.wait_for_frees(seen, 120)
        assert nixl.released == ["stuck-read"]
        assert gauge(service) == 0
        assert reserve(service, "r2", 40) is not None
        service.loop.run(engine.abort, "r2")
        service.loop.run(engine.check_integrity)
        assert service.loop.run(engine.stats).free_blocks == 16
    finally:
        agent.close()


def test_a_stuck_read_settles_when_its_peer_is_removed():
    configure_ucx()
    agent = KVAgent("stuck-reader-2", torch.zeros(4, 4, 8))
    agent.agent = StuckNixl(agent.agent)
    agent._remote["peer"] = "peer-dlist"
    agent._plans["peer"] = ([(0, 0)], agent.num_blocks)  # the same geometry as ours
    try:
        with pytest.raises(ReadInFlightError) as e:
            agent.read("peer", [0, 1], [2, 3], time.monotonic() - 1)
        read = e.value.read
        assert read.local_ids == (2, 3) and not read.settled()
        agent.remove_peer("peer")
        assert read.settled()
    finally:
        agent.close()


def test_an_error_that_is_not_a_transfer_error_still_ends_the_request(decode):
    """Bug: _pull caught only TransferError; anything else (NIXL's own error from add_peer)
    left the request RESERVED for ever, with its blocks and its --max-num-seqs slot."""
    service = decode(Raising())
    engine = service.engine
    slots = reserve(service, "r1", len(PROMPT))
    ctx = Context()
    with pytest.raises(Ended):
        service._pull("r1", handle_for(slots), slots, time.monotonic() + 30, ctx,
                      tracing.NO_SPAN)
    assert ctx.code == grpc.StatusCode.INTERNAL and "nixlBackendError" in ctx.details
    assert "r1" not in engine.requests
    assert service.loop.run(engine.stats).free_blocks == 16
    service.loop.run(engine.check_integrity)


@pytest.fixture
def holder():
    """A holder in this process: a real NIXL agent on a pool of random blocks, its KVSource on
    gRPC and its lease channel."""
    configure_ucx()
    agent = KVAgent("holder-h", torch.rand(8, 4, 8))
    server = make_server(max_workers=4)
    port = server.add_insecure_port("127.0.0.1:0")
    freed: list[str] = []
    h = KVHolder(worker_id="h", incarnation="inc1", address=f"127.0.0.1:{port}",
                 fingerprint="fp", agent=agent, leases=LeaseTable(ttl_s=60), free=freed.append)
    worker_pb2_grpc.add_KVSourceServicer_to_server(h, server)
    server.start()
    h.serve_lease_channel("127.0.0.1")
    h.freed = freed
    yield h
    h.shutdown()
    server.stop(None)
    agent.close()


def test_a_holder_whose_lease_channel_cannot_be_reached_hands_off_over_grpc(holder):
    """Bug: the handshake failed as a whole when the lease channel it advertised could not be
    reached (behind --advertise-port, or a port a firewall drops), although the gRPC release
    would have worked."""
    holder.lease_port = free_port()  # what it advertises: nothing listens there
    agent = KVAgent("reader-r", torch.zeros(8, 4, 8))
    reader = KVReader(agent, "fp", "reader")
    try:
        reader.connect(holder.address, time.monotonic() + 30)
        handle = holder.grant("a", (1, 2), 8)
        res = reader.pull(handle, (5, 6), 0, time.monotonic() + 30)
        assert res.blocks_read == 2 and holder.freed == ["a"]
        assert torch.equal(agent.kv[5:7], holder.agent.kv[1:3])
        assert reader.leases.fallbacks == 1
    finally:
        reader.close()
        agent.close()


def test_nixl_refusing_a_peer_is_a_typed_transfer_error(holder):
    agent = KVAgent("reader-n", torch.zeros(8, 4, 8))

    def refuse(*args, **kwargs):
        raise RuntimeError("nixlBackendError: add_remote_agent failed")

    agent.add_peer = refuse
    reader = KVReader(agent, "fp", "reader")
    try:
        with pytest.raises(PeerUnavailableError, match="NIXL did not take the peer"):
            reader.pull(holder.grant("a", (1, 2), 8), (5, 6), 0,
                        time.monotonic() + 30)
        assert reader.num_peers == 0
    finally:
        reader.close()
        agent.close()
