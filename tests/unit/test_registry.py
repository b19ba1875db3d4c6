"""The worker registry on a real redis-server (the embedded one Baton starts itself)."""

from __future__ import annotations

import time

import pytest
from baton.control.redis_server import EmbeddedRedis
from baton.control.registry import Registration, RouterRecord, WorkerRecord, WorkerRegistry


@pytest.fixture(scope="module")
def redis_url():
    with EmbeddedRedis() as r:
        yield r.url


@pytest.fixture
def registry(redis_url):
    reg = WorkerRegistry.from_url(redis_url, ttl_s=1.0)
    reg.redis.flushdb()
    return reg


def rec(worker_id, role, port=1):
    return WorkerRecord(worker_id, role, f"127.0.0.1:{port}", "fp", "inc-" + worker_id, "m")


def test_roles_and_records(registry):
    for r in (rec("p0", "prefill", 1), rec("d0", "decode", 2), rec("b0", "both", 3)):
        registry.put(r)
    ids = lambda role: [w.worker_id for w in registry.workers(role)]  # noqa: E731
    assert ids("prefill") == ["b0", "p0"]  # a colocated worker serves both roles
    assert ids("decode") == ["b0", "d0"]
    assert ids("both") == ["b0"]
    assert ids(None) == ["b0", "d0", "p0"]
    (d0,) = [w for w in registry.workers("decode") if w.worker_id == "d0"]
    assert (d0.address, d0.fingerprint, d0.incarnation, d0.model) == (
        "127.0.0.1:2", "fp", "inc-d0", "m")
    assert abs(d0.started_at - time.time()) < 5
    registry.remove("p0")
    assert ids("prefill") == ["b0"]
    with pytest.raises(ValueError, match="role='router'"):
        rec("x", "router")


def test_routers_register_apart_and_newer_fields_are_ignored(registry):
    import json

    beat = Registration(registry, RouterRecord("r0", "127.0.0.1:50051", "127.0.0.1:8000",
                                               "m", tls=True)).start()
    registry.put(rec("d0", "decode"))
    (r0,) = registry.routers()
    assert (r0.router_id, r0.http_address, r0.tls) == ("r0", "127.0.0.1:8000", True)
    assert [w.worker_id for w in registry.workers()] == ["d0"]  # routers are not workers
    # a record written by a newer Baton, with a field this one does not know
    registry.redis.set("baton:worker:d1", json.dumps(
        {"worker_id": "d1", "role": "decode", "address": "h:1", "fingerprint": "fp",
         "incarnation": "i", "metrics_address": "h:2", "gpu": "H100"}))
    d1 = [w for w in registry.workers() if w.worker_id == "d1"][0]
    assert d1.metrics_address == "h:2"
    beat.withdraw()
    assert registry.routers() == []


def test_entries_expire_without_heartbeat_and_live_with_it(registry):
    registry.put(rec("gone", "prefill"))
    beat = Registration(registry, rec("alive", "decode")).start()
    time.sleep(1.6)  # past the 1 s TTL: only the heart-beating one is left
    assert [w.worker_id for w in registry.workers()] == ["alive"]
    beat.withdraw()
    assert registry.workers() == []  # withdrawn at once, not at expiry


def test_workers_advertise_a_reachable_host():
    import argparse
    import socket

    from baton.services.common.process import advertised_host

    ns = argparse.Namespace
    assert advertised_host(ns(host="127.0.0.1", advertise_host=None)) == "127.0.0.1"
    assert advertised_host(ns(host="0.0.0.0", advertise_host="10.1.2.3")) == "10.1.2.3"
    # bound to every interface and nothing given: this host's address, never 0.0.0.0
    got = advertised_host(ns(host="0.0.0.0", advertise_host=None))
    assert got == socket.gethostbyname(socket.gethostname()) and got != "0.0.0.0"


def test_a_router_pool_reads_the_registry_on_first_use_however_long_its_refresh(registry):
    # the first read must not depend on how long the machine has been up (time.monotonic()
    # starts near 0 on a freshly booted one, which once hid every worker for refresh_s)
    from baton.services.router.server import WorkerPool

    registry.put(rec("d0", "decode"))
    pool = WorkerPool(registry, refresh_s=1e12)
    assert [w.worker_id for w in pool.workers()] == ["d0"]
    registry.put(rec("d1", "decode", 2))
    assert [w.worker_id for w in pool.workers()] == ["d0"]  # cached until refresh_s
    assert pool.forget()
    assert [w.worker_id for w in pool.workers()] == ["d0", "d1"]


def test_a_registration_made_while_redis_is_down_lands_when_it_answers():
    # a worker starts while Redis is down: start() does not raise, the heartbeat registers it
    # as soon as Redis answers, and registers it again after Redis comes back empty
    from tests.support.processes import free_port

    port = free_port()
    registry = WorkerRegistry.from_url(f"redis://127.0.0.1:{port}/0", ttl_s=1.0)
    reg = Registration(registry, WorkerRecord("w", "decode", "127.0.0.1:1", "fp", "i")).start()
    assert reg.down_since is not None and reg.num_failures == 1
    server = EmbeddedRedis(port=port).start()
    try:
        _until(lambda: [w.worker_id for w in registry.workers()] == ["w"])
        assert reg.down_since is None
        registry.redis.flushall()  # back empty
        _until(lambda: [w.worker_id for w in registry.workers()] == ["w"])
    finally:
        reg.withdraw()
        server.stop()


def _until(check, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end
        time.sleep(0.05)


def test_credentials_redis_refuses_are_an_error_not_an_outage():
    from redis.exceptions import AuthenticationError

    server = EmbeddedRedis(password="right-pw").start()
    try:
        wrong = WorkerRegistry.from_url(server.url.replace(":right-pw@", ""), ttl_s=1.0)
        reg = Registration(wrong, WorkerRecord("w", "decode", "127.0.0.1:1", "fp", "i"))
        with pytest.raises(AuthenticationError):
            reg.start()
    finally:
        server.stop()
