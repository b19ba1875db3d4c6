"""The prefix-cache index and the shared load counters, in Redis.

Three kinds of keys, all with TTLs, so nothing outlives the process that owns it::

    baton:pc:<worker id>:<incarnation>  SET of 32-byte block hashes the worker's KV cache holds
                                        (baton.engine.block_hash: they commit to the model
                                        fingerprint, the cache salt and every earlier token)
    baton:load:<worker id>              HASH incarnation, waiting, running, free, total
    baton:inflight:<worker id>          ZSET "<router id>:<request id>" -> expiry (ms since epoch)

Workers write the first two (:class:`IndexPublisher`): the engine's block pool records what its
prefix cache gains and loses, and a publisher thread sends the net change every few milliseconds
in one pipeline, refreshing the TTL (``--registry-ttl``) each time. A worker that dies stops
refreshing, so its entries vanish within the TTL, as its registry entry does; a restarted worker
has a new incarnation and so a new, empty set; a draining worker deletes its keys. If Redis goes
away the publisher keeps its own copy of the set and rewrites it whole when Redis is back.

Routers read all three in one round trip (:meth:`PrefixIndex.signals`, one Lua script): for a
prompt's chain of block hashes, how many leading blocks each candidate holds, plus its queue, KV
usage and requests in flight. Routers write the third: a request is added to its workers'
in-flight sets when routed and removed when it ends; each router re-arms its own entries'
expiry every few seconds, so the entries of a router that dies expire within
``inflight_ttl_s`` instead of counting forever. Redis being down is never a routing error:
:meth:`PrefixIndex.signals` returns ``None`` and the router routes on its own counts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from baton.engine.kv_cache import CLEARED, EVICTED, STORED
from redis.exceptions import RedisError

log = logging.getLogger("baton.control")

INDEX_PREFIX = "baton:pc:"
LOAD_PREFIX = "baton:load:"
INFLIGHT_PREFIX = "baton:inflight:"
_CHUNK = 1000  # members per SADD when a whole set is rewritten


def index_key(worker_id: str, incarnation: str) -> str:
    return f"{INDEX_PREFIX}{worker_id}:{incarnation}"


def load_key(worker_id: str) -> str:
    return LOAD_PREFIX + worker_id


def inflight_key(worker_id: str) -> str:
    return INFLIGHT_PREFIX + worker_id


# ------------------------------------------------------------------------------------------------
# Worker side
# ------------------------------------------------------------------------------------------------


class IndexPublisher:
    """Publishes one worker's prefix-cache events and load to Redis from a background thread.

    ``events`` is the engine's ``BlockPool.events`` deque (appended on the engine thread, popped
    here); ``load()`` returns ``(waiting, running, free blocks, total blocks)`` and may be called
    from this thread (it only reads counters).
    """

    def __init__(self, client, worker_id: str, incarnation: str, events: deque, load,
                 ttl_s: float = 10.0, interval_s: float = 0.02) -> None:
        self.redis, self.worker_id, self.incarnation = client, worker_id, incarnation
        self.events, self.load, self.ttl_s, self.interval_s = events, load, ttl_s, interval_s
        self.key, self.load_key = index_key(worker_id, incarnation), load_key(worker_id)
        self.held: set[bytes] = set()  # what the index should say: resent whole after an outage
        self.num_flushes = self.num_errors = 0
        self._dirty = True  # the first flush writes the (empty) set and its TTL
        self._last_load: tuple | None = None
        self._refreshed = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prefix-index", daemon=True)

    def start(self) -> IndexPublisher:
        self._thread.start()
        return self

    def _run(self) -> None:
        backoff = self.interval_s
        while not self._stop.wait(backoff):
            try:
                self.flush()
                backoff = self.interval_s
            except (RedisError, OSError) as e:
                self.num_errors += 1
                if not self._dirty:
                    log.warning("prefix index: Redis unavailable (%s); will resend the whole set "
                                "when it is back", e)
                self._dirty = True
                backoff = min(1.0, max(backoff * 2, 0.1))

    def flush(self) -> None:
        """Send the events seen since the last flush (and the load if it changed) in one
        pipeline. Raises RedisError if Redis cannot be reached (nothing is lost: ``held``)."""
        stored: set[bytes] = set()
        evicted: set[bytes] = set()
        while True:
            try:
                kind, h = self.events.popleft()
            except IndexError:
                break
            if kind == STORED:
                self.held.add(h)
                stored.add(h)
                evicted.discard(h)
            elif kind == EVICTED:
                self.held.discard(h)
                evicted.add(h)
                stored.discard(h)
            elif kind == CLEARED:
                self.held.clear()
                self._dirty = True
        load = tuple(self.load())
        now = time.monotonic()
        keepalive = now - self._refreshed > self.ttl_s / 3
        if not (stored or evicted or self._dirty or keepalive or load != self._last_load):
            return
        ttl_ms = int(self.ttl_s * 1000)
        pipe = self.redis.pipeline(transaction=self._dirty)
        if self._dirty:  # rewrite the whole set (first flush, after an outage, after a clear)
            pipe.delete(self.key)
            held = list(self.held)
            for i in range(0, len(held), _CHUNK):
                pipe.sadd(self.key, *held[i : i + _CHUNK])
        else:
            if stored:
                pipe.sadd(self.key, *stored)
            if evicted:
                pipe.srem(self.key, *evicted)
        pipe.pexpire(self.key, ttl_ms)
        waiting, running, free, total = load
        pipe.hset(self.load_key, mapping={"incarnation": self.incarnation, "waiting": waiting,
                                          "running": running, "free": free, "total": total})
        pipe.pexpire(self.load_key, ttl_ms)
        pipe.execute()
        if self._dirty and self.num_errors:
            log.info("prefix index: Redis is back; resent %d block hashes", len(self.held))
        self._dirty, self._last_load, self._refreshed = False, load, now
        self.num_flushes += 1

    def stop(self, withdraw: bool = True) -> None:
        """Stop publishing; ``withdraw`` deletes this worker's keys (a clean drain)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)
        if withdraw:
            try:
                self.redis.delete(self.key, self.load_key)
            except (RedisError, OSError) as e:
                log.warning("could not delete the prefix index of %s: %s (it expires in %.0fs)",
                            self.worker_id, e, self.ttl_s)


# ------------------------------------------------------------------------------------------------
# Router side
# ------------------------------------------------------------------------------------------------

# KEYS: 3 per candidate (index set, load hash, in-flight zset). ARGV[1]: now in ms; ARGV[2..]: the
# prompt's block hashes in order. Returns per candidate {leading blocks held, in flight, waiting,
# running, free, total, incarnation} (missing load fields as false -> None).
_SIGNALS = """
local n = #ARGV - 1
local out = {}
for w = 0, #KEYS / 3 - 1 do
  local hit = 0
  if n > 0 then
    local flags = redis.call('SMISMEMBER', KEYS[3 * w + 1], unpack(ARGV, 2))
    while hit < n and flags[hit + 1] == 1 do hit = hit + 1 end
  end
  local infl = KEYS[3 * w + 3]
  redis.call('ZREMRANGEBYSCORE', infl, '-inf', ARGV[1])
  local load = redis.call('HMGET', KEYS[3 * w + 2], 'waiting', 'running', 'free', 'total',
                          'incarnation')
  out[w + 1] = {hit, redis.call('ZCARD', infl), load[1], load[2], load[3], load[4], load[5]}
end
return out
"""


@dataclass
class Signals:
    """What the index says about one candidate worker for one prompt."""

    hit_blocks: int = 0  # leading blocks of the prompt its KV cache holds
    inflight: int = 0  # requests routed to it and not finished, by every router
    waiting: int | None = None  # its engine's queue (None: not published yet)
    running: int | None = None
    free_blocks: int | None = None
    total_blocks: int | None = None


@dataclass
class _Claim:
    keys: list[str]
    member: str
    expires_ms: int = field(default=0)


class PrefixIndex:
    """A router's view of the index and its share of the in-flight counters.

    ``client`` should have short socket timeouts: a Redis that hangs must not stall routing.
    While Redis is unreachable, calls return ``None`` at once and one retry is made every
    ``retry_s``; ``num_unavailable`` counts requests routed without the index.
    """

    def __init__(self, client, router_id: str, inflight_ttl_s: float = 30.0,
                 retry_s: float = 1.0) -> None:
        self.redis, self.router_id = client, router_id
        self.inflight_ttl_s, self.retry_s = inflight_ttl_s, retry_s
        self._script = client.register_script(_SIGNALS)
        self._claims: dict[str, _Claim] = {}
        self._lock = threading.Lock()
        self._down_until = 0.0
        self.available = True
        self.num_unavailable = 0
        self.num_outages = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._rearm, name="inflight-rearm", daemon=True)
        self._thread.start()

    # ---- reads -----------------------------------------------------------------------------------

    def signals(self, hashes: list[bytes], workers) -> list[Signals] | None:
        """One :class:`Signals` per worker record (same order), or ``None`` if Redis is down."""
        if not self._usable():
            return None
        keys = []
        for w in workers:
            keys += [index_key(w.worker_id, w.incarnation), load_key(w.worker_id),
                     inflight_key(w.worker_id)]
        try:
            rows = self._script(keys=keys, args=[_now_ms(), *hashes])
        except (RedisError, OSError) as e:
            self._went_down(e)
            return None
        self._came_back()
        out = []
        for w, (hit, infl, waiting, running, free, total, inc) in zip(workers, rows):
            if inc is not None and inc.decode() != w.incarnation:  # an older incarnation's load
                waiting = running = free = total = None
            out.append(Signals(int(hit), int(infl), _int(waiting), _int(running), _int(free),
                               _int(total)))
        return out

    # ---- in-flight counters ----------------------------------------------------------------------

    def claim(self, request_key: str, worker_ids: list[str]) -> None:
        """Count a request as in flight on ``worker_ids`` until :meth:`release`."""
        claim = _Claim([inflight_key(w) for w in worker_ids], f"{self.router_id}:{request_key}")
        with self._lock:
            self._claims[request_key] = claim
        if self._usable():
            self._write([claim])

    def release(self, request_key: str) -> None:
        with self._lock:
            claim = self._claims.pop(request_key, None)
        if claim is None or not self._usable():
            return
        try:
            pipe = self.redis.pipeline(transaction=False)
            for k in claim.keys:
                pipe.zrem(k, claim.member)
            pipe.execute()
        except (RedisError, OSError) as e:
            self._went_down(e)

    def _write(self, claims: list[_Claim]) -> None:
        expires = _now_ms() + int(self.inflight_ttl_s * 1000)
        try:
            pipe = self.redis.pipeline(transaction=False)
            for c in claims:
                for k in c.keys:
                    pipe.zadd(k, {c.member: expires})
                    pipe.pexpire(k, int(self.inflight_ttl_s * 1000) + 1000)
            pipe.execute()
        except (RedisError, OSError) as e:
            self._went_down(e)
            return
        self._came_back()

    def _rearm(self) -> None:
        """Push this router's live claims' expiry forward (every third of the TTL); after an
        outage this also restores them."""
        while not self._stop.wait(self.inflight_ttl_s / 3):
            with self._lock:
                claims = list(self._claims.values())
            if claims and self._usable():
                self._write(claims)

    def close(self) -> None:
        self._stop.set()

    # ---- availability ----------------------------------------------------------------------------

    def _usable(self) -> bool:
        if self.available or time.monotonic() >= self._down_until:
            return True
        self.num_unavailable += 1
        return False

    def _went_down(self, e: BaseException) -> None:
        if self.available:
            self.num_outages += 1
            log.warning("prefix index unavailable (%s): routing on load only, retrying every "
                        "%.1fs", e, self.retry_s)
        self.available = False
        self.num_unavailable += 1
        self._down_until = time.monotonic() + self.retry_s

    def _came_back(self) -> None:
        if not self.available:
            log.info("prefix index available again: cache-aware routing resumed")
            self.available = True


def _now_ms() -> int:
    return int(time.time() * 1000)


def _int(v) -> int | None:
    return None if v is None else int(v)
