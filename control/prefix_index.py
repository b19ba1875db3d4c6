"""The prefix-cache index and the shared load counters, in Redis.

Four kinds of keys, all with TTLs, so nothing outlives the process that owns it::

    baton:pc:<worker id>:<incarnation>  SET of 32-byte block hashes the worker's KV cache holds
                                        (baton.engine.block_hash: they commit to the model
                                        fingerprint, the cache salt and every earlier token)
    baton:pc:<worker id>:<incarnation>:<tier>
                                        the same for each KV tier under the pool (host, disk:
                                        baton.engine.kv_tiers), loaded back on a hit
    baton:load:<worker id>              "<incarnation> <waiting> <running> <free> <total>"
    baton:prefill:<worker id>           "<incarnation> <prompt tokens it has still to compute>"
    baton:inflight:<worker id>          ZSET "<router id>:<request id>" -> expiry (ms since epoch)

(The prompt tokens have a key of their own, not a sixth field of the load string: a router of an
earlier release reads that string as exactly four numbers after the incarnation, and ignores a
key it does not know.)

Workers write the first three (:class:`IndexPublisher`): the engine's block pool records what its
prefix cache gains and loses, and a publisher thread sends the net change every few milliseconds
in one pipeline, refreshing the TTL (``--registry-ttl``) each time. A worker that dies stops
refreshing, so its entries vanish within the TTL, as its registry entry does; a restarted worker
has a new incarnation and so a new, empty set; a draining worker deletes its keys. If Redis goes
away the publisher keeps its own copy of the set and rewrites it whole when Redis is back; a Redis
that comes back empty without the connection noticing gets it whole too: each keep-alive flush
(a third of the TTL) checks with an EXISTS ahead of its writes that the set is still there.

Routers read all four in one round trip (:meth:`PrefixIndex.signals`, one Lua script): for a
prompt's chain of block hashes, how many leading blocks each candidate holds, plus its queue, KV
usage, prompt tokens to compute and requests in flight. Routers write the last: a request is
added to its workers' in-flight sets when routed and removed when it ends (in batches, by a
background thread, off the request path; a router adds its own claims not yet written to what it
reads); each router re-arms its own entries' expiry every few seconds, so the entries of a router
that dies expire within ``inflight_ttl_s`` instead of counting forever. All keys of one lookup
must live on one Redis (no Redis Cluster slot routing). Redis being down is never a
routing error: :meth:`PrefixIndex.signals` returns ``None`` and the router routes on its own
counts.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

from baton.engine.kv_cache import CLEARED, EVICTED, STORED
from redis.exceptions import RedisError

log = logging.getLogger("baton.control")

INDEX_PREFIX = "baton:pc:"
LOAD_PREFIX = "baton:load:"
INFLIGHT_PREFIX = "baton:inflight:"
PREFILL_PREFIX = "baton:prefill:"
_CHUNK = 1000  # members per SADD when a whole set is rewritten


TIERS = ("host", "disk")  # baton.engine.kv_tiers' tiers, fastest first


def index_key(worker_id: str, incarnation: str, tier: str = "pool") -> str:
    base = f"{INDEX_PREFIX}{worker_id}:{incarnation}"
    return base if tier == "pool" else f"{base}:{tier}"


def load_key(worker_id: str) -> str:
    return LOAD_PREFIX + worker_id


def prefill_key(worker_id: str) -> str:
    return PREFILL_PREFIX + worker_id


def inflight_key(worker_id: str) -> str:
    return INFLIGHT_PREFIX + worker_id


# ------------------------------------------------------------------------------------------------
# Worker side
# ------------------------------------------------------------------------------------------------


class IndexPublisher:
    """Publishes one worker's prefix-cache events and load to Redis from a background thread.

    ``events`` is the engine's ``BlockPool.events`` deque (appended on the engine thread, popped
    here); ``load()`` returns ``(waiting, running, free blocks, total blocks[, prompt tokens to
    compute])`` and may be called from this thread (it only reads counters).
    """

    def __init__(self, client, worker_id: str, incarnation: str, events: deque, load,
                 ttl_s: float = 10.0, interval_s: float = 0.02,
                 idle_interval_s: float = 0.1) -> None:
        self.redis, self.worker_id, self.incarnation = client, worker_id, incarnation
        self.events, self.load, self.ttl_s, self.interval_s = events, load, ttl_s, interval_s
        # while the engine holds no request (its last load: none waiting, none running) it
        # looks every idle_interval_s instead: an idle worker's changes are a new request's
        # arrival (the routers count their own in flight at once) and lease or tier moves,
        # and its looks at 50 a second cost ~1% of a core per worker
        self.idle_interval_s = idle_interval_s
        self.load_key, self.prefill_key = load_key(worker_id), prefill_key(worker_id)
        self.keys = {t: index_key(worker_id, incarnation, t) for t in ("pool", *TIERS)}
        # what the index should say, per place (pool, host, disk): resent whole after an outage
        self.held_by: dict[str, set[bytes]] = {t: set() for t in self.keys}
        self.num_flushes = self.num_errors = self.num_resends = 0
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
                idle = self._last_load is not None and not any(self._last_load[:2])
                backoff = self.idle_interval_s if idle else self.interval_s
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
        changes = self._drain_events()
        load = tuple(self.load())
        now = time.monotonic()
        keepalive = now - self._refreshed > self.ttl_s / 3
        if not (any(a or b for a, b in changes.values()) or self._dirty or keepalive
                or load != self._last_load):
            return
        ttl_ms = int(self.ttl_s * 1000)
        pipe = self.redis.pipeline(transaction=self._dirty)
        checked = []  # pipeline positions of EXISTS on sets that should be there already
        for place, key in self.keys.items():
            stored, evicted = changes[place]
            if keepalive and not self._dirty and len(self.held_by[place]) > len(stored):
                checked.append(len(pipe))
                pipe.exists(key)
            if self._dirty:  # rewrite the whole set (first flush, after an outage, a clear)
                pipe.delete(key)
                held = list(self.held_by[place])
                for i in range(0, len(held), _CHUNK):
                    pipe.sadd(key, *held[i : i + _CHUNK])
            else:
                if stored:
                    pipe.sadd(key, *stored)
                if evicted:
                    pipe.srem(key, *evicted)
            if place == "pool" or self.held_by[place] or evicted:
                pipe.pexpire(key, ttl_ms)
        pipe.set(self.load_key, " ".join(map(str, (self.incarnation, *load[:4]))), px=ttl_ms)
        if len(load) > 4:
            pipe.set(self.prefill_key, f"{self.incarnation} {load[4]}", px=ttl_ms)
        replies = pipe.execute()
        if self._dirty and self.num_errors:
            log.info("prefix index: Redis is back; resent %d block hashes",
                     sum(map(len, self.held_by.values())))
        self._dirty, self._last_load, self._refreshed = False, load, now
        self.num_flushes += 1
        if any(not replies[i] for i in checked):  # a set that should be there was gone: a
            # Redis that came back empty (restart, failover) without our connection noticing
            self._dirty = True
            self.num_resends += 1
            log.warning("prefix index: Redis lost this worker's block set (restarted empty?); "
                        "resending it whole")

    def _drain_events(self) -> dict[str, tuple[set[bytes], set[bytes]]]:
        """The engine's events since the last flush, applied to ``held_by``: per place (pool,
        host, disk) the hashes stored and evicted since then (a hash stored then evicted counts
        as evicted, and the reverse). Tier events are ``"stored:<tier>"`` and so on."""
        out: dict[str, tuple[set[bytes], set[bytes]]] = {p: (set(), set()) for p in self.keys}
        while True:
            try:
                kind, h = self.events.popleft()
            except IndexError:
                return out
            kind, _, place = kind.partition(":")
            place = place or "pool"
            if place not in out:
                continue
            stored, evicted = out[place]
            if kind == STORED:
                self.held_by[place].add(h)
                stored.add(h)
                evicted.discard(h)
            elif kind == EVICTED:
                self.held_by[place].discard(h)
                evicted.add(h)
                stored.discard(h)
            elif kind == CLEARED:
                self.held_by[place].clear()
                self._dirty = True

    def stop(self, withdraw: bool = True) -> None:
        """Stop publishing; ``withdraw`` deletes this worker's keys (a clean drain)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)
        if withdraw:
            try:
                self.redis.delete(*self.keys.values(), self.load_key, self.prefill_key)
            except (RedisError, OSError) as e:
                log.warning("could not delete the prefix index of %s: %s (it expires in %.0fs)",
                            self.worker_id, e, self.ttl_s)


# ------------------------------------------------------------------------------------------------
# Router side
# ------------------------------------------------------------------------------------------------

# KEYS: 6 per candidate (index set, load string, in-flight zset, host-tier set, disk-tier set,
# prefill string). ARGV[1]: now in ms; ARGV[2]: the prompt's block hashes in order, concatenated
# (32 bytes each). Returns one string, a line per candidate: "<leading blocks in the pool>
# <leading blocks in the pool or host tier> <leading blocks anywhere> <in flight>|<load
# string>|<prefill string>" (either string empty where its key is not there; one bulk reply
# parses fast).
#
# A worker's pool set is prefix-closed: the engine frees a request's blocks tail first and revives
# a cached block only together with every block before it, so a block is always evicted before its
# parent. The leading run is therefore found by bisection: block 1, block n, then ~log2(n)
# lookups (about 11 per worker for 512 blocks instead of 512; each lookup costs ~1 us in Redis).
# The tiers receive a request's blocks tail first and drop them least recently used first, so
# the union of pool and tiers is prefix-closed too, short of a block that failed its checksum:
# the same bisection finds the runs into the tiers (a worker with no tier set skips it).
_SIGNALS = """
local blob = ARGV[2]
local n = #blob / 32
local out = {}
local function run(held)
  if n == 0 or not held(1) then return 0 end
  if held(n) then return n end
  local lo, hi = 1, n - 1  -- blocks 1..lo held, block hi + 1 not
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    if held(mid) then lo = mid else hi = mid - 1 end
  end
  return lo
end
for w = 0, #KEYS / 6 - 1 do
  local pool, host, disk = KEYS[6 * w + 1], KEYS[6 * w + 4], KEYS[6 * w + 5]
  local function has(key, i)
    return redis.call('SISMEMBER', key, string.sub(blob, 32 * i - 31, 32 * i)) == 1
  end
  local p = run(function(i) return has(pool, i) end)
  local ph, all = p, p
  local tiered = p < n and redis.call('EXISTS', host, disk) > 0
  if tiered then
    ph = run(function(i) return has(pool, i) or has(host, i) end)
    all = run(function(i) return has(pool, i) or has(host, i) or has(disk, i) end)
    if ph < p then ph = p end
    if all < ph then all = ph end
  end
  -- unexpired entries only (expired ones are pruned by the routers' writer threads)
  out[w + 1] = p .. ' ' .. ph .. ' ' .. all .. ' ' ..
    redis.call('ZCOUNT', KEYS[6 * w + 3], ARGV[1], '+inf')
end
local strings = {}
for w = 0, #KEYS / 6 - 1 do
  strings[2 * w + 1], strings[2 * w + 2] = KEYS[6 * w + 2], KEYS[6 * w + 6]
end
strings = redis.call('MGET', unpack(strings))
for w = 1, #out do
  out[w] = out[w] .. '|' .. (strings[2 * w - 1] or '') .. '|' .. (strings[2 * w] or '')
end
return table.concat(out, '\\n')
"""


@dataclass
class Signals:
    """What the index says about one candidate worker for one prompt."""

    hit_blocks: int = 0  # leading blocks of the prompt its KV pool holds
    host_blocks: int = 0  # the blocks after those its host tier holds
    disk_blocks: int = 0  # the blocks after those its disk tier holds
    inflight: int = 0  # requests routed to it and not finished, by every router
    waiting: int | None = None  # its engine's queue (None: not published yet)
    running: int | None = None
    free_blocks: int | None = None
    total_blocks: int | None = None
    prefill_tokens: int | None = None  # prompt tokens its engine has still to compute


@dataclass
class _Claim:
    member: str  # "<router id>:<request key>" in each worker's in-flight set
    worker_ids: list[str]


class PrefixIndex:
    """A router's view of the index and its share of the in-flight counters.

    ``client`` should have short socket timeouts: a Redis that hangs must not stall routing.
    While Redis is unreachable, calls return ``None`` at once and one retry is made every
    ``retry_s``; ``num_outages`` counts the times it became unreachable.
    """

    def __init__(self, client, router_id: str, inflight_ttl_s: float = 30.0,
                 retry_s: float = 1.0, write_delay_s: float = 0.002) -> None:
        self.redis, self.router_id = client, router_id
        self.inflight_ttl_s, self.retry_s = inflight_ttl_s, retry_s
        self.write_delay_s = write_delay_s
        # this router's claims (+1) and releases (-1) per worker not yet written: added to what
        # Redis says, so its own count is exact while a batch waits
        self._pending: dict[str, int] = {}
        self._script = client.register_script(_SIGNALS)
        self._claims: dict[str, _Claim] = {}
        self._keys: dict[tuple[str, str], tuple[str, str, str]] = {}
        self._lock = threading.Lock()
        self._down_until = 0.0
        self.available = True
        self.num_outages = 0
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._writer, name="inflight-writer",
                                        daemon=True)
        self._thread.start()

    # ---- reads -----------------------------------------------------------------------------------

    def signals(self, hashes: bytes | list[bytes], workers) -> list[Signals] | None:
        """One :class:`Signals` per worker record (same order), or ``None`` if Redis is down.
        ``hashes``: the prompt's block hashes, as a list or concatenated."""
        if not self._usable():
            return None
        keys = []
        for w in workers:
            k = self._keys.get((w.worker_id, w.incarnation))
            if k is None:
                if len(self._keys) > 4096:
                    self._keys.clear()
                k = self._keys[w.worker_id, w.incarnation] = (
                    index_key(w.worker_id, w.incarnation), load_key(w.worker_id),
                    inflight_key(w.worker_id), *(index_key(w.worker_id, w.incarnation, t)
                                                 for t in TIERS), prefill_key(w.worker_id))
            keys += k
        # this router's unwritten claims, taken before Redis is read: a batch the writer thread
        # writes meanwhile is then counted twice for a moment (harmless: it only leans away from
        # that worker), where a snapshot taken after the read could miss it entirely (written
        # after the read, dropped from the pending counts before the snapshot) and let a burst
        # pile onto one worker
        with self._lock:
            pending = dict(self._pending)
        try:
            blob = hashes if isinstance(hashes, bytes) else b"".join(hashes)
            reply = self._script(keys=keys, args=[_now_ms(), blob])
        except (RedisError, OSError) as e:
            self._went_down(e)
            return None
        self._came_back()
        out = []
        for w, line in zip(workers, reply.decode().split("\n")):
            head, load, prefill = line.split("|")
            hit, host, anywhere, infl = map(int, head.split(" "))
            s = Signals(hit, host - hit, anywhere - host,
                        max(0, infl + pending.get(w.worker_id, 0)))
            load, prefill = load.split(" "), prefill.split(" ")
            if load[0] == w.incarnation:  # not an older incarnation's load
                s.waiting, s.running, s.free_blocks, s.total_blocks = map(int, load[1:5])
            if prefill[0] == w.incarnation:  # a worker of an earlier release writes none
                s.prefill_tokens = int(prefill[1])
            out.append(s)
        return out

    # ---- in-flight counters ----------------------------------------------------------------------

    def claim(self, request_key: str, worker_ids: list[str]) -> None:
        """Count a request as in flight on ``worker_ids`` until :meth:`release`. Written to
        Redis by a background thread (batched with other routes' claims and releases), so it
        adds no round trip to the request."""
        claim = _Claim(f"{self.router_id}:{request_key}", list(worker_ids))
        with self._lock:
            self._claims[request_key] = claim
            self._count(claim, 1)
        self._ops.put(("add", claim))

    def release(self, request_key: str) -> None:
        with self._lock:
            claim = self._claims.pop(request_key, None)
            if claim is not None:
                self._count(claim, -1)
        if claim is not None:
            self._ops.put(("rem", claim))

    def _count(self, claim: _Claim, d: int) -> None:  # under self._lock
        for w in claim.worker_ids:
            n = self._pending[w] = self._pending.get(w, 0) + d
            if n == 0:
                del self._pending[w]

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until the claims and releases made so far are written (tests, benchmarks)."""
        done = threading.Event()
        self._ops.put(("sync", done))
        done.wait(timeout)

    def _writer(self) -> None:
        """Writes claims and releases in batches, ``write_delay_s`` after the first of a batch
        (so the write runs while the request's workers compute, not on its way in or out);
        every third of the TTL pushes the expiry of this router's live claims forward (after an
        outage that also restores them)."""
        period = self.inflight_ttl_s / 3
        next_rearm = time.monotonic() + period
        while not self._stop.is_set():
            try:
                ops = [self._ops.get(timeout=max(0.0, next_rearm - time.monotonic()))]
            except queue.Empty:
                ops = []
            if ops and ops[0][0] != "sync" and self.write_delay_s > 0:
                time.sleep(self.write_delay_s)
            while True:
                try:
                    ops.append(self._ops.get_nowait())
                except queue.Empty:
                    break
            if time.monotonic() >= next_rearm:
                with self._lock:
                    ops += [("rearm", c) for c in self._claims.values()]
                ops.append(("prune", None))
                next_rearm = time.monotonic() + period
            self._write(ops)

    def _write(self, ops: list) -> None:
        writes = [op for op in ops if op[0] != "sync"]
        if writes and self._usable():
            expires = _now_ms() + int(self.inflight_ttl_s * 1000)
            key_ttl = int(self.inflight_ttl_s * 1000) + 1000
            try:
                pipe = self.redis.pipeline(transaction=False)
                for kind, c in writes:
                    if kind == "prune":  # drop expired entries (a dead router's) for good
                        for k in self.redis.scan_iter(match=INFLIGHT_PREFIX + "*", count=500):
                            pipe.zremrangebyscore(k, "-inf", _now_ms())
                        continue
                    for k in map(inflight_key, c.worker_ids):
                        if kind != "rem":  # add, rearm
                            pipe.zadd(k, {c.member: expires})
                            pipe.pexpire(k, key_ttl)
                        else:
                            pipe.zrem(k, c.member)
                pipe.execute()
            except (RedisError, OSError) as e:
                self._went_down(e)
            else:
                self._came_back()
        with self._lock:  # written (or, with Redis down, dropped: rearmed when it is back)
            for kind, c in writes:
                if kind in ("add", "rem"):
                    self._count(c, 1 if kind == "rem" else -1)
        for op in ops:
            if op[0] == "sync":
                op[1].set()

    def close(self) -> None:
        """Stop the writer as a router that dies would: its claims still written expire by TTL."""
        self._stop.set()
        self._ops.put(("sync", threading.Event()))

    def retire(self, timeout: float = 2.0) -> None:
        """A router leaving gracefully: release the claims it still holds, write every claim and
        release made so far (within ``timeout``), then stop. Without it the releases of the
        last requests it finished could die with the process and count those requests in
        flight on their workers, for every router, until the TTL ran out."""
        with self._lock:
            keys = list(self._claims)
        for k in keys:
            self.release(k)
        self.flush(timeout)
        self.close()

    # ---- availability ----------------------------------------------------------------------------

    def _usable(self) -> bool:
        return self.available or time.monotonic() >= self._down_until

    def _went_down(self, e: BaseException) -> None:
        if self.available:
            self.num_outages += 1
            log.warning("prefix index unavailable (%s): routing on load only, retrying every "
                        "%.1fs", e, self.retry_s)
        self.available = False
        self._down_until = time.monotonic() + self.retry_s

    def _came_back(self) -> None:
        if not self.available:
            log.info("prefix index available again: cache-aware routing resumed; re-arming "
                     "this router's in-flight counts")
            self.available = True
            with self._lock:  # a Redis back empty has lost them: write them again now
                for c in self._claims.values():
                    self._ops.put(("rearm", c))


def _now_ms() -> int:
    return int(time.time() * 1000)

