"""The router's RoutingPolicy on constructed cases: which worker and which path it picks, from
the load it sees and the prefix index (a real redis-server)."""

from __future__ import annotations

from baton.control.prefix_index import PrefixIndex, prefill_key
from baton.control.registry import WorkerRecord
from baton.engine.block_hash import hash_blocks
from baton.engine.kv_cache import STORED

from tests.support.index import NS, Pool, publisher


def test_a_saturated_prefill_worker_leaves_only_short_prompts_to_the_decode_worker():
    from baton.services.router.routing import MANY_NEW_TOKENS, PREFILL_SATURATED, RoutingPolicy

    d = WorkerRecord("d1", "decode", "127.0.0.1:1", "fp", "i1")
    p = WorkerRecord("p1", "prefill", "127.0.0.1:2", "fp", "i1")

    def decide(n, inflight, **kw):
        policy = RoutingPolicy(Pool([d, p], {p.address: inflight}), None,
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
    d = RoutingPolicy(Pool([one]), index).decide(ids, hashes, set())
    assert (d.decode, d.path, d.reason, d.used_index, calls) == (one, "local",
                                                                NO_PREFILL_WORKER, False, [])
    two = WorkerRecord("d2", "decode", "127.0.0.1:2", "fp", "i1")
    d = RoutingPolicy(Pool([one, two]), index).decide(ids, hashes, set())
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
    policy = RoutingPolicy(Pool([d, *ps]), index, weights={"prefix": 3, "inflight": 1})
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
    policy = RoutingPolicy(Pool([d, *ws.values()]), index,
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
    policy = RoutingPolicy(Pool([d, ws["disk"], half]), index, weights={"prefix": 1},
                           tier_weights={"host": 0.9, "disk": 0.6}, local_max_new_tokens=0)
    assert policy.decide(ids, hashes, set()).prefill.worker_id == "disk"
    index.close()


def test_a_short_prompt_goes_past_a_worker_busy_with_a_long_prefill(client):
    """Two colocated workers: ``a`` has fewer requests in flight but is prefilling a
    1,900-token prompt (its published count), ``b`` only decodes. By request count ``a`` is the
    less loaded; with the ``prefill`` scorer (a default) the short prompt goes to ``b``, where
    it does not wait behind that prefill. Where a candidate publishes no count (a worker of an
    earlier release, in a rolling upgrade) the decision leaves the term out: scored as idle on
    it, the old worker would draw the requests."""
    from baton.control.pd import DEFAULT_SCORER_WEIGHTS
    from baton.services.router.routing import RoutingPolicy

    pubs = []
    for wid, left in (("a", 1900), ("b", 0)):
        pub, _, load = publisher(client, wid)
        load[:] = [0, 1, 90, 100, left]
        pub.flush()
        pubs.append(pub)
    index = PrefixIndex(client, "r-prefill")
    index.claim("q1", ["a"])
    index.claim("q2", ["b"])
    index.claim("q3", ["b"])
    index.flush()
    a = WorkerRecord("a", "both", "127.0.0.1:1", "fp", "i1")
    b = WorkerRecord("b", "both", "127.0.0.1:2", "fp", "i1")
    ids = list(range(100))

    def decode_worker(**kw) -> str:
        got = RoutingPolicy(Pool([a, b]), index, local_max_new_tokens=1 << 30,
                            **kw).decide(ids, b"", set())
        assert got.path == "local"  # colocated: it prefills where it decodes
        return got.decode.worker_id

    assert DEFAULT_SCORER_WEIGHTS["prefill"] > 0
    assert [decode_worker() for _ in range(3)] == ["b", "b", "b"]
    no_prefill = {k: v for k, v in DEFAULT_SCORER_WEIGHTS.items() if k != "prefill"}
    assert decode_worker(weights=no_prefill) == "a"
    # a of an earlier release publishes no count: by request count alone it wins (1 against 2)
    client.delete(prefill_key("a"))
    assert decode_worker() == "a"
    # with 3 in flight it loses to b's 2, though b has 1,900 tokens to prefill: scored as idle
    # on the term (1 against b's 0.35), the old worker would win (1.25 against 0.68 on the
    # in-flight and prefill terms)
    index.claim("q4", ["a"])
    index.claim("q5", ["a"])
    index.flush()
    client.set(prefill_key("b"), "i1 1900", px=5000)
    assert [decode_worker() for _ in range(2)] == ["b", "b"]
    client.set(prefill_key("a"), "i1 0", px=5000)  # upgraded: the term is back, and a wins
    assert decode_worker() == "a"
    index.close()
