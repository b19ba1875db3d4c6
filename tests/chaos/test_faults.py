"""Faults under load on a real cluster (see harness.py for the checks each one passes): the
network between the router and a decode worker cut, delayed and stalled (a proxy on loopback),
decode workers SIGKILLed mid-transfer and mid-stream (requests migrate) and SIGSTOPped, the
prefill worker SIGKILLed and SIGSTOPped while it holds leased blocks, the router SIGKILLed,
Redis SIGKILLed and SIGSTOPped, and clients that drop their calls at every phase. Killed
processes are restarted and rejoin without restarting the others."""

from __future__ import annotations

import signal
import threading
import time

import pytest
from baton.engine.engine import LLMEngine
from baton_client.v1 import api_pb2, api_pb2_grpc

from tests.chaos.harness import Load, chaos_cluster, check, reference
from tests.support.cluster import Cluster, info
from tests.support.reference import REFERENCE_POOL

pytestmark = [pytest.mark.slow, pytest.mark.chaos]

# long enough that a stream picked with `left` tokens still to come is running when the signal
# lands (with 40 and 12 left, a float32 decode fast enough finished them first)
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def faults(start_cluster):
    c, proxy = chaos_cluster(start_cluster)
    yield c, proxy
    proxy.close()


@pytest.fixture(scope="module")
def cluster(faults):
    return faults[0]


@pytest.fixture(scope="module")
def proxy(faults):
    return faults[1]


@pytest.fixture(autouse=True)
def _isolated(cluster):
    yield
    cluster.after_test()


@pytest.fixture(scope="module")
def want():
    return reference(LLMEngine.from_path(None, REFERENCE_POOL), MAX_TOKENS)


def streaming_on(workers, load: Load, timeout: float = 180.0,
                 want: list[list[int]] | None = None, left: int = 0) -> int:
    """Index in ``workers`` of one whose requests' tokens are reaching their clients: it runs a
    request while every request in flight has had tokens (a fixed wait raced slow prefills)
    and, given ``want``, has ``left`` more to come (a stream about to end may finish before a
    signal lands, and then nothing on that worker is left to move). ``timeout`` is a hang
    bound: on a loaded 2-core machine such a moment took longer than 30 s to come once."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if load.streaming(want, left):
            for k, w in enumerate(workers):
                if w.info().running_requests > 0:
                    return k
        time.sleep(0.02)
    raise AssertionError(f"none of {[w.worker_id for w in workers]} got streaming")


def pids(cluster: Cluster) -> dict[str, int]:
    return {w.worker_id: w.pid for w in (cluster.router, *cluster.prefill, *cluster.decode)}


def rejoined(cluster: Cluster, worker_id: str, field: str, timeout=30.0) -> None:
    """Rounds of 4 concurrent requests with fresh prompts until ``worker_id`` serves one (as
    ``field`` of the final message). Each prompt starts with its own number: prompts sharing a
    leading block would be drawn by the prefix index to whichever worker served the first one,
    and the rejoined worker might never get one."""
    stub = api_pb2_grpc.BatonStub(cluster.router.channel)
    end, n = time.monotonic() + timeout, 0
    nonce = time.time_ns()  # prompts no earlier call cached anywhere
    while True:
        finals = []

        def one(k: int, finals=finals) -> None:
            req = api_pb2.GenerateRequest(text=f"{k} [{nonce}] Tell me a fact about {k}.",
                                          params=api_pb2.SamplingParams(max_tokens=8))
            finals.append(list(stub.Generate(req, timeout=60))[-1].final)

        threads = [threading.Thread(target=one, args=(n + i,)) for i in range(4)]
        n += 4
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(finals) == 4 and all(f.finish_reason for f in finals)
        if any(getattr(f, field) == worker_id for f in finals):
            return
        assert time.monotonic() < end, f"{worker_id} served nothing after its restart"


def test_network_cut_between_router_and_a_decode_worker(cluster, proxy, want):
    proxied = cluster.decode[1]
    load = Load(cluster, clients=4, max_tokens=MAX_TOKENS).start()
    load.wait_for(2)
    streaming_on([proxied], load)
    proxy.cut()  # its streams break (RST); new connections are refused
    try:
        load.wait_more(4)
    finally:
        proxy.heal()
    load.wait_more(4)
    outs = load.stop()
    # streams it had started move to the other worker; calls that could not reach it retry
    counts = check("network cut router-decode", outs, want, allowed=set())
    assert counts["OK"] == len(outs)
    assert any(o.final.migrations for o in outs), "no stream was cut"
    cluster.assert_quiet()  # it saw its streams end and freed their blocks
    rejoined(cluster, proxied.worker_id, "decode_worker")


def test_network_delay_and_stall_between_router_and_a_decode_worker(cluster, proxy, want):
    proxied = cluster.decode[1]
    load = Load(cluster, clients=4, deadline=20.0, max_tokens=MAX_TOKENS).start()
    proxy.delay(0.02)  # every chunk 20 ms late, both ways: slow, not failing
    load.wait_for(4)
    streaming_on([proxied], load)
    proxy.stall()  # a partition: nothing moves, connections stay open
    try:
        n = len(load.outcomes)
        time.sleep(5)  # longer than the router's --stall-timeout
        load.wait_for(n + 2)
    finally:
        proxy.heal()
    load.wait_more(4)
    outs = load.stop()
    # streams past their first token move on after --stall-timeout (the SIGSTOP test pins
    # that); a call still waiting for its first token waits for the partition to heal
    counts = check("network delay+stall router-decode", outs, want,
                   allowed={"DEADLINE_EXCEEDED"})
    assert counts["OK"] >= len(outs) - 2
    cluster.assert_quiet()


def test_decode_sigkill_mid_stream_migrates_without_losing_a_token(cluster, want):
    load = Load(cluster, clients=4, max_tokens=MAX_TOKENS).start()
    load.wait_for(2)
    k = streaming_on(cluster.decode, load, want=want, left=24)
    victim = cluster.decode[k]
    others = {w: p for w, p in pids(cluster).items() if w != victim.worker_id}
    victim.kill()
    load.wait_more(6)
    outs = load.stop()
    counts = check("decode SIGKILL mid-stream", outs, want, allowed=set())
    assert any(o.code == "OK" and o.final.migrations for o in outs), \
        "no request was streaming on the killed worker"
    for o in outs:
        if o.code == "OK" and o.final.migrations:
            assert o.final.path == "migrated"
            assert list(o.final.migrated_from) == [victim.worker_id]
            assert o.final.usage.completion_tokens == len(o.ids)
    assert counts["OK"] == len(outs)
    cluster.decode[k] = cluster.start_worker("decode")  # a replacement joins; nothing else
    # restarts
    assert {w: p for w, p in pids(cluster).items() if w in others} == others
    rejoined(cluster, cluster.decode[k].worker_id, "decode_worker")
    cluster.assert_quiet()


def test_decode_sigkill_mid_transfer(cluster, want):
    # a third decode worker that keeps each lease 1 s after its read: a wide transfer window
    slow = cluster.start_extra("decode", "--faults", "delay_release=1.0")
    # a salt per request: the routing spreads them over all three by load (with one salt a
    # prompt would stay with the worker that first cached it, maybe never the slow one)
    load = Load(cluster, clients=4, max_tokens=MAX_TOKENS, salt_each=True).start()
    end = time.monotonic() + 60
    while info(slow).handoffs_in_flight == 0:
        assert time.monotonic() < end, "no hand-off reached the slow worker"
        time.sleep(0.01)
    assert cluster.prefill[0].info().active_leases > 0
    slow.kill()  # mid-transfer: it read blocks the prefill worker still holds under a lease
    load.wait_more(6)
    outs = load.stop()
    # nothing had reached those clients: their requests are retried on the other workers
    counts = check("decode SIGKILL mid-transfer", outs, want, allowed=set())
    assert counts["OK"] == len(outs)
    assert any(o.final.retries for o in outs), "no request was retried"
    cluster.assert_quiet()  # the orphaned lease expires, its blocks free


def test_prefill_sigkill_while_holding_leases(cluster, want):
    load = Load(cluster, clients=4, max_tokens=MAX_TOKENS).start()
    load.wait_for(3)
    end = time.monotonic() + 20  # kill it while it holds blocks leased to a reader
    while cluster.prefill[0].info().active_leases == 0 and time.monotonic() < end:
        time.sleep(0.01)
    cluster.prefill[0].kill()
    load.wait_more(6)
    outs = load.stop()
    # requests it was prefilling, or whose blocks a decode worker was reading, are retried:
    # the decode workers prefill them themselves while no prefill worker is left
    check("prefill SIGKILL holding leases", outs, want, allowed={"UNAVAILABLE"})
    assert any(o.final.path == "local" for o in outs if o.code == "OK")
    cluster.prefill[0] = cluster.start_worker("prefill")
    rejoined(cluster, cluster.prefill[0].worker_id, "prefill_worker")
    cluster.assert_quiet()


def test_decode_sigstop_mid_stream_moves_its_streams_elsewhere(cluster, want):
    # deadline: room for a stream to stall (3 s), then finish elsewhere
    load = Load(cluster, clients=4, deadline=20.0, max_tokens=MAX_TOKENS).start()
    load.wait_for(2)
    k = streaming_on(cluster.decode, load, want=want, left=24)
    stopped = cluster.decode[k]
    stopped.proc.send_signal(signal.SIGSTOP)
    try:
        load.wait_more(6, timeout=60)  # the other decode worker carries on
    finally:
        stopped.proc.send_signal(signal.SIGCONT)
    outs = load.stop()
    # streams it had started move on after --stall-timeout; calls it took but never answered
    # (routed to it before its registry entry lapsed) end at their deadline
    counts = check("decode SIGSTOP", outs, want, allowed={"DEADLINE_EXCEEDED"})
    assert counts["OK"] >= 6
    assert any(o.final.migrations for o in outs if o.code == "OK"), "no stream moved on"
    cluster.assert_quiet()  # it resumes, sees its calls cancelled, frees all
    rejoined(cluster, stopped.worker_id, "decode_worker")


def test_prefill_sigstop_while_holding_leases(cluster, want):
    load = Load(cluster, clients=4, deadline=30.0, max_tokens=MAX_TOKENS).start()
    load.wait_for(2)
    end = time.monotonic() + 20
    while cluster.prefill[0].info().active_leases == 0 and time.monotonic() < end:
        time.sleep(0.01)
    cluster.prefill[0].proc.send_signal(signal.SIGSTOP)
    try:
        # hand-offs from it time out on the decode side (--transfer-timeout 5) and are retried;
        # once its registry entry lapses, decode workers prefill new requests themselves
        time.sleep(8)
    finally:
        cluster.prefill[0].proc.send_signal(signal.SIGCONT)
    load.wait_more(4)
    outs = load.stop()
    # a prompt it was prefilling when stopped finishes after it resumes, or at its deadline
    counts = check("prefill SIGSTOP holding leases", outs, want, allowed={"DEADLINE_EXCEEDED"})
    assert counts["OK"] >= 6
    cluster.assert_quiet()  # leases whose reader gave up expire or are freed
    rejoined(cluster, cluster.prefill[0].worker_id, "prefill_worker")


def test_router_sigkill_and_restart(cluster, want):
    load = Load(cluster, clients=4, max_tokens=MAX_TOKENS).start()
    load.wait_for(2)
    streaming_on(cluster.decode, load)
    workers = {w.worker_id: w.pid for w in cluster.workers()}
    cluster.restart_router()  # SIGKILL, then a new router on a new port
    load.wait_more(6)
    outs = load.stop()
    counts = check("router SIGKILL", outs, want, allowed={"UNAVAILABLE", "CANCELLED"})
    assert counts["OK"] >= 6
    assert {w.worker_id: w.pid for w in cluster.workers()} == workers
    cluster.assert_quiet()  # the dead router's calls were cancelled


def test_redis_sigkill_and_restart(cluster, want):
    load = Load(cluster, clients=4, max_tokens=MAX_TOKENS).start()
    load.wait_for(2)
    port = cluster.redis.port
    cluster.redis.proc.kill()
    cluster.redis.proc.wait()
    load.wait_more(4)  # served on the workers the router saw last, routed on load only
    from baton.control.redis_server import EmbeddedRedis

    cluster.redis = EmbeddedRedis(port=port).start()  # back, and empty: workers re-register
    load.wait_more(4)
    outs = load.stop()
    counts = check("redis SIGKILL", outs, want, allowed={"UNAVAILABLE"})
    assert counts["OK"] >= 8
    cluster.assert_quiet()


def test_redis_sigstop_and_resume(cluster, want):
    load = Load(cluster, clients=4, max_tokens=MAX_TOKENS).start()
    load.wait_for(2)
    cluster.redis.proc.send_signal(signal.SIGSTOP)  # hangs instead of refusing: timeouts only
    try:
        load.wait_more(6)
    finally:
        cluster.redis.proc.send_signal(signal.SIGCONT)
    load.wait_more(2)
    outs = load.stop()
    counts = check("redis SIGSTOP", outs, want, allowed=set())
    assert counts["OK"] == len(outs)
    cluster.assert_quiet()


def test_clients_dropping_at_every_phase_leak_nothing(cluster, want):
    # 0: before routing; then during prefill, the hand-off, the first tokens, late in decode
    load = Load(cluster, clients=4, max_tokens=MAX_TOKENS,
                cancel_after=[0.0, 0.02, 0.1, 0.3, 0.8, 1.5, None]).start()
    load.wait_for(24, timeout=180)
    outs = load.stop()
    counts = check("client drops", outs, want, allowed={"CANCELLED"})
    assert counts["CANCELLED"] >= 6 and counts["OK"] >= 1
    cluster.assert_quiet(timeout=15)
