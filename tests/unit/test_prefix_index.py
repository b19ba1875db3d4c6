"""The Redis prefix index on a real redis-server: worker events in, per-worker prefix overlap and
load out, incarnations, TTL purge, shared in-flight counters, and Redis going away."""

from __future__ import annotations

import time
from collections import deque

import redis
from baton.control.prefix_index import (
    IndexPublisher,
    PrefixIndex,
    index_key,
    inflight_key,
    load_key,
    prefill_key,
)
from baton.control.redis_server import EmbeddedRedis
from baton.engine.block_hash import hash_blocks, namespace_for
from baton.engine.kv_cache import CLEARED, EVICTED, STORED

from tests.support.index import NS, publisher, rec


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


def test_a_redis_that_came_back_empty_between_flushes_gets_the_whole_set(client):
    # no connection error seen (FLUSHALL: a restart the client reconnected through, a failover
    # to a replica that had not caught up): a keep-alive flush's EXISTS finds no set, so the
    # next flush writes it whole
    prompt = hash_blocks(list(range(40)), 4, NS)
    pub, events, _ = publisher(client, "a")
    events.extend((STORED, h) for h in prompt[:6])
    pub.flush()
    key = index_key("a", "i1")
    assert client.scard(key) == 6
    client.flushall()
    events.extend((STORED, h) for h in prompt[6:8])
    pub._refreshed = 0.0  # the next flush is a keep-alive one (a third of the TTL on)
    pub.flush()  # writes the two new ones; its EXISTS found the set was gone
    assert pub.num_resends == 1 and client.scard(key) == 2
    pub.flush()
    assert client.smembers(key) == set(prompt[:8]) and client.pttl(key) > 0


def test_the_prompt_tokens_a_worker_has_left_reach_the_routers_under_its_incarnation(client):
    """A worker publishes the prompt tokens its engine has still to compute beside its load; a
    worker of an earlier release publishes none (the scorer then reads None), a restarted one's
    count is not read under the old incarnation, and a drained worker's is deleted."""
    a, _, load_a = publisher(client, "a")
    b, _, _ = publisher(client, "b")  # four numbers: an earlier release's load
    load_a[:] = [1, 1, 80, 100, 1900]
    a.flush()
    b.flush()
    assert client.get(load_key("a")) == b"i1 1 1 80 100"  # the string earlier routers parse
    index = PrefixIndex(client, "r1")
    sa, sb = index.signals([], [rec("a"), rec("b")])
    assert (sa.prefill_tokens, sa.waiting, sa.total_blocks) == (1900, 1, 100)
    assert sb.prefill_tokens is None and sb.total_blocks == 100
    (restarted,) = index.signals([], [rec("a", incarnation="i2")])
    assert restarted.prefill_tokens is None and restarted.waiting is None
    a.stop()
    assert client.get(prefill_key("a")) is None
    (gone,) = index.signals([], [rec("a")])
    assert gone.prefill_tokens is None
    b.stop()
    index.close()


def test_an_idle_worker_looks_less_often_and_a_change_still_goes_out(client):
    """With nothing waiting or running, the publisher looks every idle_interval_s (each gap
    at least that: a lower bound, no timing race); a request arriving is published, and while
    the engine holds one it looks every interval_s again."""
    events, load, looks = deque(), [0, 0, 90, 100], []

    def read_load():
        looks.append(time.monotonic())
        return list(load)

    pub = IndexPublisher(client, "a", "i1", events, read_load, ttl_s=60.0, interval_s=0.001,
                         idle_interval_s=0.3)
    pub.start()
    try:
        _wait(lambda: len(looks) >= 4)
        idle = list(looks)
        assert all(b - a >= 0.3 for a, b in zip(idle[1:], idle[2:]))  # after the first flush
        load[:3] = [1, 0, 80]  # a request arrived
        _wait(lambda: client.get(load_key("a")) == b"i1 1 0 80 100")
        _wait(lambda: len(looks) >= len(idle) + 40)  # busy: looks at interval_s
        busy = looks[len(idle) + 1:]
        assert sum(b - a for a, b in zip(busy, busy[1:])) < 0.3 * (len(busy) - 1)
    finally:
        pub.stop()


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


def test_a_router_that_retires_leaves_no_claims_behind(client):
    # a router stopped gracefully right after its last requests finished: their releases (and
    # a claim still held) must reach Redis, not count those requests on the workers for a TTL
    w = [rec("a"), rec("b")]
    r1 = PrefixIndex(client, "r1", inflight_ttl_s=60.0, write_delay_s=0.5)
    r2 = PrefixIndex(client, "r2")
    r1.claim("q1", ["a"])
    r1.claim("q2", ["a", "b"])
    r1.flush()
    assert [s.inflight for s in r2.signals([], w)] == [2, 1]
    r1.release("q1")  # not written yet: the batch waits half a second
    r1.retire()
    assert client.zcard(inflight_key("a")) == client.zcard(inflight_key("b")) == 0
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


