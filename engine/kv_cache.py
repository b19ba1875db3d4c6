"""Paged KV-cache bookkeeping: a block pool with prefix caching, and per-request block tables.

Pure Python, no tensors: the model runner owns the KV tensor and uses the block ids decided here.

Block life cycle::

    free (no hash) --allocate--> in use (ref>0) --request done, ref 0--> free queue tail
         ^                           |  full block computed: gets a hash,            |
         |                           |  becomes findable in the prefix cache         |
         +------- evicted (hash dropped) when popped from the free-queue head -------+

A freed block keeps its hash and stays findable until it is evicted, so a later request with the
same prefix revives it (``touch``) instead of recomputing it. The free queue is LRU: blocks are
taken from the head, and freed blocks join the tail; a request's blocks are freed tail-first, so
the end of a sequence is evicted before its (more shareable) beginning.
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from baton.engine.request import Request

# prefix-cache events (BlockPool.events)
STORED, EVICTED, CLEARED = "stored", "evicted", "cleared"


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class BlockPool:
    """Fixed set of ``num_blocks`` blocks with ref counts, an LRU free queue and a hash map.

    ``get_new_blocks`` returns ``None`` when there are not enough free blocks ("not now"); misuse
    such as freeing a block twice is a bug and trips an assertion.

    With ``record_events`` the pool appends what the prefix cache gains and loses to ``events``
    (a deque another thread may pop from): ``(STORED, hash)`` when a block becomes findable,
    ``(EVICTED, hash)`` when it stops being findable, ``(CLEARED, None)`` when every hash goes.
    A worker publishes them to the Redis prefix index (``baton.control.prefix_index``).

    ``on_evict(block_ids, hashes)``, when set, is called with the cached blocks a
    ``get_new_blocks`` call evicts, before it returns (so before anything overwrites them): the
    engine copies them into its KV tiers (``baton.engine.kv_tiers``).
    """

    def __init__(self, num_blocks: int, record_events: bool = False) -> None:
        assert num_blocks > 0, num_blocks
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # block_id -> block, ordered from least to most recently freed
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.num_evictions = 0
        self.events: deque[tuple[str, bytes | None]] | None = deque() if record_events else None
        self.on_evict: Callable[[list[int], list[bytes]], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVBlock] | None:
        """Take ``n`` blocks from the head of the free queue, evicting their cached contents."""
        if n > len(self.free_queue):
            return None
        out = []
        evicted_ids: list[int] = []
        evicted: list[bytes] = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            assert block.ref_cnt == 0, block
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                if self.events is not None:
                    self.events.append((EVICTED, block.block_hash))
                evicted_ids.append(block.block_id)
                evicted.append(block.block_hash)
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted_ids, evicted)
        return out

    def scatter(self, seed: int = 0) -> None:
        """Put the free queue in a random (seeded) order: the allocation order of a pool long in
        service, whose blocks come back in the order requests end, so a sequence's blocks lie
        all over the pool instead of side by side. ``baton profile`` times decode steps on such
        a pool (on a 2-vCPU Zen 4 a step of 12 requests at 768 tokens of context took ~25%
        longer than on a fresh pool, 4 requests ~13%)."""
        items = list(self.free_queue.items())
        random.Random(seed).shuffle(items)
        self.free_queue = OrderedDict(items)

    def unscatter(self) -> None:
        """Put the free queue in block-id order, as a fresh pool hands its blocks out (each
        sequence's side by side): ``baton profile`` times the fresh and the scattered pool in
        turn, so both see the machine at the same moments."""
        self.free_queue = OrderedDict(sorted(self.free_queue.items()))

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits, reviving them from the free queue if needed."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block, in the given order (it becomes the eviction order)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Make a full, computed block findable by its hash (first block with a hash wins)."""
        assert block.ref_cnt > 0, block
        if block.block_hash is not None:
            assert block.block_hash == block_hash, (block, block_hash.hex())
            return
        if block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block
            if self.events is not None:
                self.events.append((STORED, block_hash))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.append((CLEARED, None))
        return True

    def check_integrity(self) -> None:
        """Assert the pool's invariants; used by tests and when the engine goes idle."""
        for block in self.blocks:
            assert block.ref_cnt >= 0, block
            assert (block.ref_cnt == 0) == (block.block_id in self.free_queue), block
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, block
        for h, block in self.cached.items():
            assert block.block_hash == h, (block, h.hex())
        assert len(self.free_queue) == len(set(self.free_queue)), "duplicate in free queue"


@dataclass
class PrefixHit:
    """Result of a prefix-cache lookup: pool blocks to reuse, then blocks a KV tier holds
    (``tier_hashes[i]`` in tier ``tier_names[i]``: loaded into fresh blocks on allocation), and
    the tokens they all cover. ``allocate_slots`` shortens the tier part in place when a tier
    block fails to load (its tokens are then computed)."""

    blocks: list[KVBlock]
    num_tokens: int
    tier_hashes: tuple[bytes, ...] = ()
    tier_names: tuple[str, ...] = ()
    block_size: int = field(default=0, repr=False)

    def tokens_by_tier(self) -> dict[str, int]:
        """Reused tokens per place: ``pool`` and each tier's name."""
        out = {"pool": self.num_tokens - len(self.tier_hashes) * self.block_size}
        for name in self.tier_names:
            out[name] = out.get(name, 0) + self.block_size
        return out

    def truncated(self, max_blocks: int) -> PrefixHit:
        """The same hit cut to its first ``max_blocks`` blocks."""
        pool = self.blocks[:max_blocks]
        k = max(0, max_blocks - len(self.blocks))
        hs, ns = self.tier_hashes[:k], self.tier_names[:k]
        return PrefixHit(pool, (len(pool) + len(hs)) * self.block_size, hs, ns, self.block_size)


class KVCacheManager:
    """Block tables per request on top of a :class:`BlockPool`.

    A request's table covers positions ``[0, num_computed_tokens + num_new_tokens)``; block ``i``
    holds positions ``[i * block_size, (i + 1) * block_size)``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 record_events: bool = False):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, record_events)
        self.enable_prefix_caching = enable_prefix_caching
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_num_hashed: dict[str, int] = {}
        # blocks of ended requests that something outside the engine may still write (a NIXL
        # READ that could not be cancelled): held, never handed out, until released
        self.quarantined: dict[str, list[KVBlock]] = {}
        self.tiers = None  # baton.engine.kv_tiers.TierStore, set by the engine when it has tiers

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def get_prefix_hit(self, request: Request) -> PrefixHit:
        """Longest run of leading full blocks already in the cache.

        At most ``num_tokens - 1`` tokens are reused: the last token must run through the model so
        there are logits to sample from.
        """
        if not self.enable_prefix_caching:
            return PrefixHit([], 0, block_size=self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for h in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        tier = None
        if self.tiers is not None and len(hits) < max_blocks:
            rest = request.block_hashes[len(hits):max_blocks]
            # a block the pool holds further on is not loaded twice: the tier run stops there
            stop = next((i for i, h in enumerate(rest) if h in self.pool.cached), len(rest))
            tier = self.tiers.lookup(rest[:stop])
        if not tier or not tier.hashes:
            return PrefixHit(hits, len(hits) * self.block_size, block_size=self.block_size)
        return PrefixHit(hits, (len(hits) + len(tier.hashes)) * self.block_size, tier.hashes,
                         tier.tiers, self.block_size)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, prefix: PrefixHit | None = None
    ) -> list[KVBlock] | None:
        """Grow the request's table to hold ``num_new_tokens`` more tokens.

        ``prefix`` (only for a request with no blocks yet) is reused before anything is allocated.
        Returns the newly allocated blocks, or ``None`` (and changes nothing) if the pool cannot
        provide them now. A prefix with tier blocks::

            | pool hits (touched) | tier blocks (new, loaded) | new tokens (new, computed) |
            0                 len(blocks)            prefix.num_tokens     + num_new_tokens

        The tier blocks are loaded before this returns; when one fails to load, it and the rest
        of the tier part become tokens to compute (``prefix`` is shortened in place, and the
        request then needs more steps than ``num_new_tokens``: chunked prefill continues it).
        """
        blocks = self.req_blocks.setdefault(request.request_id, [])
        hit = prefix.blocks if prefix else []
        assert not (hit and blocks), "prefix hits are only for a request's first allocation"
        num_computed = request.num_computed_tokens + (prefix.num_tokens if prefix else 0)
        need = self.blocks_needed(num_computed + num_new_tokens) - len(blocks) - len(hit)
        # reviving a cached block that sits in the free queue uses up one free block
        revived = sum(1 for b in hit if b.ref_cnt == 0)
        if need + revived > self.pool.num_free_blocks:
            if not blocks:
                del self.req_blocks[request.request_id]
            return None
        self.pool.touch(hit)
        blocks.extend(hit)
        new = self.pool.get_new_blocks(max(need, 0)) or []
        blocks.extend(new)
        reused = len(hit)
        if prefix is not None and prefix.tier_hashes:
            reused += self._load_tier_blocks(prefix, new, reused)
        if reused:
            self.req_num_hashed[request.request_id] = reused
        return new

    def _load_tier_blocks(self, prefix: PrefixHit, new: list[KVBlock], pool_hits: int) -> int:
        """Load the prefix's tier blocks into the first of the ``new`` blocks and make them
        findable; returns how many loaded. A failed load shortens ``prefix`` to what loaded."""
        tiered = new[: len(prefix.tier_hashes)]
        got = self.tiers.load(prefix.tier_hashes, [b.block_id for b in tiered])
        loaded = len(got)
        for block, h in zip(tiered[:loaded], prefix.tier_hashes):
            self.pool.cache_block(block, h)
        prefix.tier_names = tuple(got)  # where each came from (a block may have moved)
        if loaded < len(prefix.tier_hashes):
            prefix.tier_hashes = prefix.tier_hashes[:loaded]
            prefix.num_tokens = (pool_hits + loaded) * self.block_size
        return loaded

    def cache_computed_blocks(self, request: Request) -> None:
        """Give every full block whose KV is now computed its hash (makes it findable)."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_blocks.get(request.request_id)
        if not blocks:
            return
        start = self.req_num_hashed.get(request.request_id, 0)
        end = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.req_num_hashed[request.request_id] = max(start, end)

    def free(self, request_id: str) -> None:
        """Release every block of a request (tail first). Safe to call twice."""
        blocks = self.req_blocks.pop(request_id, None)
        self.req_num_hashed.pop(request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def quarantine(self, request_id: str) -> int:
        """Take a request's blocks out of its table but keep holding them (nothing gets them
        until :meth:`release_quarantine`); returns how many."""
        blocks = self.req_blocks.pop(request_id, [])
        self.req_num_hashed.pop(request_id, None)
        self.quarantined[request_id] = blocks
        return len(blocks)

    def release_quarantine(self, request_id: str) -> None:
        """Free the blocks :meth:`quarantine` held for ``request_id`` (tail first)."""
        blocks = self.quarantined.pop(request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    @property
    def num_quarantined_blocks(self) -> int:
        return sum(len(b) for b in list(self.quarantined.values()))

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for blocks in [*self.req_blocks.values(), *self.quarantined.values()]:
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), (block, refs.get(block.block_id))
