"""Block-pool and KV-cache-manager scenarios pinning exact block ids, ref counts and eviction."""

import pytest
from baton.engine.block_hash import hash_block, namespace_for
from baton.engine.kv_cache import BlockPool, KVBlock, KVCacheManager
from baton.engine.params import SamplingParams
from baton.engine.request import Request

NS = namespace_for("fp-test")


def make_request(rid, tokens, block_size=4):
    return Request(rid, list(tokens), SamplingParams(), NS, block_size, max_tokens=16)


def run(kv, req, n):
    """Allocate and mark ``n`` more tokens computed, as one engine step would."""
    assert kv.allocate_slots(req, n) is not None
    req.num_computed_tokens += n
    kv.cache_computed_blocks(req)


def test_pool_allocates_in_order_and_returns_none_when_short():
    pool = BlockPool(4)
    a = pool.get_new_blocks(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    assert [b.ref_cnt for b in a] == [1, 1, 1]
    assert pool.get_new_blocks(2) is None  # not now; nothing changed
    assert pool.num_free_blocks == 1
    pool.free_blocks(a)
    assert list(pool.free_queue) == [3, 0, 1, 2]
    pool.check_integrity()


def test_double_free_is_a_bug():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([b])


def test_prefix_hit_reuses_blocks_and_counts_refs():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", range(10))  # 2 full blocks + 2 tokens
    run(kv, a, 10)
    assert kv.block_ids("a") == [0, 1, 2]
    assert [b.block_hash for b in kv.req_blocks["a"][:2]] == a.block_hashes[:2]
    assert kv.req_blocks["a"][0].block_hash == hash_block(None, NS, [0, 1, 2, 3])
    assert kv.req_blocks["a"][2].block_hash is None  # partial block is never cached

    b = make_request("b", [*range(8), 99, 98, 97])
    hit = kv.get_prefix_hit(b)
    assert [x.block_id for x in hit.blocks] == [0, 1] and hit.num_tokens == 8
    kv.allocate_slots(b, b.num_tokens - 8, hit)
    assert kv.block_ids("b") == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    kv.check_integrity()


def test_full_prompt_hit_leaves_last_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", range(8))
    run(kv, a, 8)
    kv.free("a")
    again = make_request("again", range(8))
    hit = kv.get_prefix_hit(again)
    assert hit.num_tokens == 4  # the second block holds the last token: must be recomputed


def test_lru_eviction_order_tail_blocks_first():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_request("a", range(12))
    run(kv, a, 12)  # blocks 0,1,2 all full and cached
    kv.free("a")
    # free order: [3,4,5] were never used, then a's blocks tail-first: 2,1,0
    assert list(kv.pool.free_queue) == [3, 4, 5, 2, 1, 0]
    b = make_request("b", range(100, 116))  # needs 4 blocks: takes 3,4,5 then evicts block 2
    assert kv.allocate_slots(b, 16) is not None
    assert kv.block_ids("b") == [3, 4, 5, 2]
    assert kv.pool.num_evictions == 1
    assert kv.pool.blocks[2].block_hash is None
    # a's first two blocks are still findable
    hit = kv.get_prefix_hit(make_request("a2", range(12)))
    assert [x.block_id for x in hit.blocks] == [0, 1]
    kv.check_integrity()


def test_reviving_a_free_cached_block_counts_against_free_space():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", range(8))
    run(kv, a, 8)
    kv.free("a")
    b = make_request("b", [*range(4), 50, 51, 52, 53, 54, 55, 56, 57])  # 3 blocks
    hit = kv.get_prefix_hit(b)
    assert [x.block_id for x in hit.blocks] == [0]
    # needs 2 new blocks + reviving block 0 = 3 free blocks: fits exactly
    assert kv.allocate_slots(b, b.num_tokens - 4, hit) is not None
    assert kv.pool.num_free_blocks == 0
    c = make_request("c", range(200, 204))
    assert kv.allocate_slots(c, 4) is None
    assert "c" not in kv.req_blocks
    kv.check_integrity()


def test_free_is_idempotent_and_integrity_holds():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", range(6))
    run(kv, a, 6)
    kv.free("a")
    kv.free("a")
    assert kv.pool.num_free_blocks == 4
    kv.check_integrity()


def test_cache_salt_isolates_tenants():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", range(9))
    run(kv, a, 9)
    other = Request("x", list(range(9)), SamplingParams(cache_salt="t2"),
                    namespace_for("fp-test", "t2"), 4, 16)
    assert kv.get_prefix_hit(other).num_tokens == 0


def test_events_follow_what_the_prefix_cache_can_find():
    from baton.engine.kv_cache import CLEARED, EVICTED, STORED

    kv = KVCacheManager(num_blocks=3, block_size=4, record_events=True)
    a = make_request("a", range(9))  # two full blocks and one token
    run(kv, a, 9)
    ha = a.block_hashes
    assert list(kv.pool.events) == [(STORED, ha[0]), (STORED, ha[1])]
    kv.pool.events.clear()
    kv.free("a")  # freed blocks stay findable: no event
    assert not kv.pool.events
    b = make_request("b", range(100, 108))  # needs 2 blocks: the free one, then a's tail
    run(kv, b, 8)
    # a's blocks are freed tail first, so a's last block is evicted before its first
    assert list(kv.pool.events) == [(EVICTED, ha[1]), (STORED, b.block_hashes[0]),
                                    (STORED, b.block_hashes[1])]
    assert set(kv.pool.cached) == {ha[0], *b.block_hashes}
    kv.free("b")
    kv.pool.events.clear()
    assert kv.pool.reset_prefix_cache()
    assert list(kv.pool.events) == [(CLEARED, None)]
    assert KVCacheManager(2, 4).pool.events is None  # off by default


def test_scatter_reorders_the_free_blocks_and_keeps_the_cache():
    """A scattered pool (as `baton profile` times decode on) hands out the same free blocks in
    a seeded random order; a cached free block stays findable and integrity holds."""
    def scattered(seed: int) -> tuple[BlockPool, KVBlock, list[int]]:
        pool = BlockPool(64)
        [cached] = pool.get_new_blocks(1)
        pool.cache_block(cached, b"h")
        pool.free_blocks([cached])
        before = list(pool.free_queue)
        pool.scatter(seed)
        assert sorted(pool.free_queue) == sorted(before) and list(pool.free_queue) != before
        return pool, cached, list(pool.free_queue)

    pool, cached, order = scattered(3)
    assert scattered(3)[2] == order and scattered(4)[2] != order  # seeded
    pool.check_integrity()
    assert pool.get_cached_block(b"h") is cached
    taken = [b.block_id for b in pool.get_new_blocks(8)]
    assert taken == order[:8] and taken != sorted(taken)  # allocation follows the new order
    pool.free_blocks(pool.blocks[i] for i in taken)
    pool.unscatter()  # a fresh pool's order again: blocks side by side, the cache kept
    assert list(pool.free_queue) == sorted(order) and pool.get_cached_block(b"h") is cached
    pool.check_integrity()
    assert [b.block_id for b in pool.get_new_blocks(3)] == sorted(order)[:3]
