"""The Redis prefix index on a real redis-server: worker events in, per-worker prefix overlap and
load out, incarnations, TTL purge, shared in-flight counters, and Redis going away."""

from __future__ import annotations

import time
from collections import deque

import pytest
import redis
from baton.control.prefix_index import IndexPublisher, PrefixIndex, index_key
from baton.control.redis_server import EmbeddedRedis
from baton.control.registry import WorkerRecord
from baton.engine.block_hash import hash_blocks, namespace_for
from baton.engine.kv_cache import CLEARED, EVICTED, STORED

NS = namespace_for("fp")


@pytest.fixture(scope="module")
def server():
    with EmbeddedRedis() as r:
        yield r


@pytest.fixture
def client(server):
    c = redis.Redis.from_url(server.url, socket_timeout=1)
    c.flushdb()
    return c


def rec(worker_id, incarnation="i1"):
    return WorkerRecord(worker_id, "prefill", "127.0.0.1:1", "fp", incarnation)


def publisher(client, worker_id, incarnation="i1", ttl_s=5.0):
    events = deque()
    load = [0, 0, 90, 100]
    pub = IndexPublisher(client, worker_id, incarnation, events, lambda: load, ttl_s=ttl_s)
    return pub, events, load


def test_overlap_counts_leading_blocks_per_worker(client):
    prompt = hash_blocks(list(range(64)), 4, NS)  # 16 blocks
    a, ev_a, load_a = publisher(client, "a")
    b, ev_b, _ = publisher(client, "b")
    ev_a.extend((STORED, h) for h in prompt[:10])
    ev_b.extend((STORED, h) for h in prompt[:3])
    load_a[:] = [2, 5, 40, 100]
    a.flush()
    b.flush()
    index = PrefixIndex(client, "r1")
    sa, sb, sc = index.signals(prompt, [rec("a"), rec("b"), rec("c")])
    assert (sa.hit_blocks, sb.hit_blocks, sc.hit_blocks) == (10, 3, 0)
    assert (sa.waiting, sa.running, sa.free_blocks, sa.total_blocks) == (2, 5, 40, 100)
    assert sc.waiting is None and sc.inflight == 0  # c never published
    ev_a.extend([(EVICTED, prompt[9]), (EVICTED, prompt[8]), (STORED, prompt[9])])
    ev_a.append((EVICTED, prompt[9]))
    a.flush()  # net effect: blocks 8 and 9 gone (evicted tail first, as the engine does)
    assert index.signals(prompt, [rec("a")])[0].hit_blocks == 8
    for depth in range(17):  # every depth, found by galloping and bisecting
        c, ev_c, _ = publisher(client, f"c{depth}")
        ev_c.extend((STORED, h) for h in prompt[:depth])
        c.flush()
        assert index.signals(prompt, [rec(f"c{depth}")])[0].hit_blocks == depth
        assert index.signals(prompt[:5], [rec(f"c{depth}")])[0].hit_blocks == min(depth, 5)
    ev_a.append((CLEARED, None))
    a.flush()
    assert index.signals(prompt, [rec("a")])[0].hit_blocks == 0
    assert client.scard(index_key("a", "i1")) == 0
    index.close()


def test_salts_and_models_share_nothing(client):
    tokens = list(range(32))
    pub, events, _ = publisher(client, "a")
    events.extend((STORED, h) for h in hash_blocks(tokens, 4, namespace_for("fp", "tenant-1")))
    pub.flush()
    index = PrefixIndex(client, "r1")
    hit = lambda ns: index.signals(hash_blocks(tokens, 4, ns), [rec("a")])[0].hit_blocks  # noqa
    assert hit(namespace_for("fp", "tenant-1")) == 8
    assert hit(namespace_for("fp", "tenant-2")) == 0
    assert hit(namespace_for("fp")) == 0
    assert hit(namespace_for("other-model", "tenant-1")) == 0
    index.close()


def test_new_incarnation_starts_clean_and_dead_entries_expire(client):
    prompt = hash_blocks(list(range(16)), 4, NS)
    old, events, _ = publisher(client, "a", "i1", ttl_s=1.0)
    events.extend((STORED, h) for h in prompt)
    old.flush()
    index = PrefixIndex(client, "r1")
    assert index.signals(prompt, [rec("a", "i1")])[0].hit_blocks == 4
    # the worker restarts: same id, new incarnation, nothing cached yet
    new, _, _ = publisher(client, "a", "i2", ttl_s=1.0)
    new.flush()
    s = index.signals(prompt, [rec("a", "i2")])[0]
    assert s.hit_blocks == 0 and s.total_blocks == 100
    # the old incarnation stopped refreshing: its set is gone within the TTL
    end = time.monotonic() + 3
    while client.exists(index_key("a", "i1")) and time.monotonic() < end:
        time.sleep(0.1)
    assert not client.exists(index_key("a", "i1"))
    # a drained worker deletes its own keys
    new.stop(withdraw=True)
    assert not client.exists(index_key("a", "i2"))
    index.close()


def test_publisher_thread_resends_everything_after_an_outage(tmp_path):
    server = EmbeddedRedis().start()
    port = server.port
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5,
                         socket_connect_timeout=0.5)
    prompt = hash_blocks(list(range(40)), 4, NS)
    pub, events, _ = publisher(client, "a")
    pub.interval_s = 0.01
    pub.start()
    events.extend((STORED, h) for h in prompt[:5])
    key = index_key("a", "i1")
    _wait(lambda: client.scard(key) == 5)
    server.stop()  # Redis goes away (and comes back empty)
    events.extend((STORED, h) for h in prompt[5:])
    _wait(lambda: pub.num_errors > 0)
    server = EmbeddedRedis(port=port).start()
    try:
        _wait(lambda: client.scard(key) == 10)
        assert client.smembers(key) == set(prompt)
        assert client.pttl(key) > 0
    finally:
        pub.stop()
        server.stop()


def test_inflight_counts_are_shared_released_and_expire(client):
    w = [rec("a"), rec("b")]
    r1, r2 = PrefixIndex(client, "r1", inflight_ttl_s=1.0), PrefixIndex(client, "r2")
    r1.claim("q1", ["a", "b"])
    r2.claim("q2", ["a"])
    r1.flush()
    r2.flush()
    assert [s.inflight for s in r2.signals([], w)] == [2, 1]
    r2.release("q2")
    r2.flush()
    assert [s.inflight for s in r1.signals([], w)] == [1, 1]
    # r1 "dies" with q1 in flight (its re-arm thread stops): the entries expire by TTL
    r1.close()
    end = time.monotonic() + 4
    while r2.signals([], w)[0].inflight and time.monotonic() < end:
        time.sleep(0.1)
    assert [s.inflight for s in r2.signals([], w)] == [0, 0]
    r2.close()


def test_a_router_counts_its_own_claims_before_they_are_written(client):
    w = [rec("a"), rec("b")]
    r1 = PrefixIndex(client, "r1", write_delay_s=0.5)  # a batch waits half a second
    r2 = PrefixIndex(client, "r2")
    r1.claim("q1", ["a"])
    r1.claim("q2", ["a", "b"])
    assert [s.inflight for s in r1.signals([], w)] == [2, 1]  # at once, from its own count
    assert [s.inflight for s in r2.signals([], w)] == [0, 0]  # not written yet
    r1.flush()
    assert [s.inflight for s in r2.signals([], w)] == [2, 1]
    assert [s.inflight for s in r1.signals([], w)] == [2, 1]  # written: not counted twice
    r1.release("q2")
    assert [s.inflight for s in r1.signals([], w)] == [1, 0]
    r1.flush()
    assert [s.inflight for s in r2.signals([], w)] == [1, 0]
    assert [s.inflight for s in r1.signals([], w)] == [1, 0]
    assert not r1._pending
    r1.close()
    r2.close()


def test_inflight_claims_outlive_their_ttl_while_the_router_lives(client):
    r = PrefixIndex(client, "r1", inflight_ttl_s=1.0)
    r.claim("q1", ["a"])
    time.sleep(2.0)  # two TTLs: re-armed every third of one
    assert r.signals([], [rec("a")])[0].inflight == 1
    r.release("q1")
    r.flush()
    assert r.signals([], [rec("a")])[0].inflight == 0
    r.close()


def test_redis_down_means_none_not_an_error():
    server = EmbeddedRedis().start()
    client = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=0.5,
                         socket_connect_timeout=0.5)
    index = PrefixIndex(client, "r1", retry_s=0.2)
    assert index.signals([], [rec("a")]) is not None
    port = server.port
    server.stop()
    assert index.signals([b"x" * 32], [rec("a")]) is None
    assert not index.available and index.num_outages == 1
    # within retry_s no read is even tried (the window is pinned open here, so a slow machine
    # cannot close it between two lines)
    index._down_until = time.monotonic() + 3600
    reads: list = []
    script = index._script
    index._script = lambda *a, **k: reads.append(a) or script(*a, **k)
    assert index.signals([], [rec("a")]) is None and reads == []
    index.claim("q", ["a"])  # no error either
    index.release("q")
    server = EmbeddedRedis(port=port).start()
    try:
        index._down_until = 0.0  # retry_s passed: the next read tries again, and succeeds
        assert index.signals([], [rec("a")]) is not None and index.available and reads
    finally:
        index.close()
        server.stop()


def _wait(cond, timeout=60.0):
    """Until ``cond()``; the bound is a hang detector (a publish attempt against a stopped Redis
    waits out redis-py's connect timeouts and retries, for seconds on a loaded machine), not a
    timing assertion."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.02)


class _Pool:  # the router's WorkerPool as RoutingPolicy sees it: the registry's records
    def __init__(self, records, inflight=None):
        self.records, self._inflight = records, inflight or {}

    def workers(self, role=None):
        return [w for w in self.records if role is None or w.role in (role, "both")]

    def inflight(self, address):
        return self._inflight.get(address, 0)


def test_a_saturated_prefill_worker_leaves_only_short_prompts_to_the_decode_worker():
    from baton.services.router.routing import MANY_NEW_TOKENS, PREFILL_SATURATED, RoutingPolicy

    d = WorkerRecord("d1", "decode", "127.0.0.1:1", "fp", "i1")
    p = WorkerRecord("p1", "prefill", "127.0.0.1:2", "fp", "i1")

    def decide(n, inflight, **kw):
        policy = RoutingPolicy(_Pool([d, p], {p.address: inflight}), None,
                               mode="least-loaded", prefill_saturation=8, **kw)
        got = policy.decide(list(range(n)), b"", set())
        return got.path, got.reason

    assert decide(200, 8) == ("local", PREFILL_SATURATED)
    assert decide(256, 8) == ("local", PREFILL_SATURATED)
    # longer prompts wait for the prefill worker: prefilled here, they would stall the streams
    assert decide(257, 8) == ("remote", MANY_NEW_TOKENS)
    assert decide(2000, 8, saturated_local_max_tokens=-1) == ("local", PREFILL_SATURATED)
    assert decide(200, 7) == ("remote", MANY_NEW_TOKENS)  # not saturated


def test_a_forced_choice_skips_the_index_and_a_real_choice_reads_it(client):
    from baton.services.router.routing import NO_PREFILL_WORKER, RoutingPolicy

    ids = list(range(200))
    hashes = b"".join(hash_blocks(ids[:192], 16, NS))
    pub, events, _ = publisher(client, "d2")
    events.extend((STORED, h) for h in hash_blocks(ids[:192], 16, NS)[:6])
    pub.flush()
    index = PrefixIndex(client, "r1")
    calls = []
    signals = index.signals
    index.signals = lambda *a: calls.append(a) or signals(*a)
    one = WorkerRecord("d1", "both", "127.0.0.1:1", "fp", "i1")
    d = RoutingPolicy(_Pool([one]), index).decide(ids, hashes, set())
    assert (d.decode, d.path, d.reason, d.used_index, calls) == (one, "local",
                                                                NO_PREFILL_WORKER, False, [])
    two = WorkerRecord("d2", "decode", "127.0.0.1:2", "fp", "i1")
    d = RoutingPolicy(_Pool([one, two]), index).decide(ids, hashes, set())
    # d2 holds 6 of the 12 blocks: it decodes; the 104 tokens it lacks are prefilled on d1
    assert len(calls) == 1 and d.used_index
    assert (d.decode, d.path, d.prefill) == (two, "remote", one)
    index.close()


def test_racing_decisions_of_one_router_see_each_other(client):
    """A burst's requests decide in parallel threads: each reads the in-flight counts before any
    of them has claimed its workers. Forced to read at the same moment (a barrier inside the
    real index read), six racers still balance two prefill workers, one of which another router
    already has a request on, because each pick adds the picks made since its read began
    (without that, all six saw p1 busier and piled onto p2)."""
    import threading

    from baton.services.router.routing import RoutingPolicy

    other = PrefixIndex(client, "r-other")
    other.claim("req-0", ["p1"])
    other.flush()
    index = PrefixIndex(client, "r-race")
    read = index.signals
    together = threading.Barrier(6)

    def signals(*a):
        out = read(*a)
        together.wait(timeout=10)  # nobody picks before everybody has read
        return out

    index.signals = signals
    d = WorkerRecord("d1", "decode", "127.0.0.1:1", "fp", "i1")
    ps = [WorkerRecord(f"p{i}", "prefill", f"127.0.0.1:{2 + i}", "fp", "i1") for i in (1, 2)]
    policy = RoutingPolicy(_Pool([d, *ps]), index, weights={"prefix": 3, "inflight": 1})
    ids = list(range(300))
    picks: list[str] = []

    def one():
        picks.append(policy.decide(ids, b"", set()).prefill.worker_id)

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    index.close()
    other.close()
    totals = {"p1": 1 + picks.count("p1"), "p2": picks.count("p2")}
    assert len(picks) == 6 and abs(totals["p1"] - totals["p2"]) <= 1, picks


def test_tier_events_publish_a_set_per_tier_and_signals_count_each_tier(client):
    """A worker's blocks in its pool, host tier and disk tier: the publisher keeps one set per
    place, and the index finds the runs into each (pool first, then host, then disk)."""
    prompt = hash_blocks(list(range(64)), 4, NS)  # 16 blocks
    a, ev, _ = publisher(client, "t")
    ev.extend((STORED, h) for h in prompt[:4])
    ev.extend(("stored:host", h) for h in prompt[4:7])
    ev.extend(("stored:disk", h) for h in prompt[2:12])  # inclusive: 2, 3 also in the pool
    a.flush()
    assert client.scard(index_key("t", "i1", "host")) == 3
    assert client.scard(index_key("t", "i1", "disk")) == 10
    index = PrefixIndex(client, "r1")
    (s,) = index.signals(prompt, [rec("t")])
    assert (s.hit_blocks, s.host_blocks, s.disk_blocks) == (4, 3, 5)
    ev.extend([("evicted:disk", prompt[11]), ("evicted:disk", prompt[10]),
               ("evicted:host", prompt[6])])
    a.flush()
    (s,) = index.signals(prompt, [rec("t")])
    assert (s.hit_blocks, s.host_blocks, s.disk_blocks) == (4, 2, 4)
    ev.append(("cleared:disk", None))
    a.flush()
    assert not client.exists(index_key("t", "i1", "disk"))
    (s,) = index.signals(prompt, [rec("t")])
    assert (s.hit_blocks, s.host_blocks, s.disk_blocks) == (4, 2, 0)
    a.stop(withdraw=True)
    assert not client.exists(index_key("t", "i1", "host")) and not client.exists(
        index_key("t", "i1"))
    index.close()


def test_tier_aware_scoring_prefers_pool_over_host_over_disk_over_a_miss(client):
    """Four prefill workers holding the same 12 of a prompt's 12 reusable blocks, in the pool, in
    the host tier, on disk, and nowhere: the scorer picks them in that order as each better one
    leaves; with equal tiers, the one holding more blocks wins even from a slower tier."""
    from baton.services.router.routing import RoutingPolicy

    ids = list(range(200))
    chain = hash_blocks(ids[:192], 16, NS)
    hashes = b"".join(chain)
    for wid, kind in (("pool", STORED), ("host", "stored:host"), ("disk", "stored:disk")):
        pub, ev, _ = publisher(client, wid)
        ev.extend((kind, h) for h in chain)
        pub.flush()
    index = PrefixIndex(client, "r-tiers")
    d = WorkerRecord("dec", "decode", "127.0.0.1:9", "fp", "i1")
    ws = {w: WorkerRecord(w, "prefill", f"127.0.0.1:{10 + i}", "fp", "i1")
          for i, w in enumerate(("pool", "host", "disk", "none"))}
    policy = RoutingPolicy(_Pool([d, *ws.values()]), index,
                           weights={"prefix": 1}, tier_weights={"host": 0.9, "disk": 0.6},
                           local_max_new_tokens=0)
    picks = []
    left = set()
    for _ in range(3):
        got = policy.decide(ids, hashes, {ws[w].address for w in left})
        picks.append(got.prefill.worker_id)
        assert got.cached_tokens == 192  # a tier's blocks load: all count as held
        left.add(got.prefill.worker_id)
    assert picks == ["pool", "host", "disk"]
    # 12 blocks on disk (0.6 each) beat 6 in the pool (1 each)
    pub, ev, _ = publisher(client, "half")
    ev.extend((STORED, h) for h in chain[:6])
    pub.flush()
    half = WorkerRecord("half", "prefill", "127.0.0.1:20", "fp", "i1")
    policy = RoutingPolicy(_Pool([d, ws["disk"], half]), index, weights={"prefix": 1},
                           tier_weights={"host": 0.9, "disk": 0.6}, local_max_new_tokens=0)
    assert policy.decide(ids, hashes, set()).prefill.worker_id == "disk"
    index.close()
