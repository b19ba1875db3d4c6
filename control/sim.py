"""A discrete-event simulation of a Baton cluster: the engine's continuous batching on a cost
model (:class:`baton.control.profile.CostModel`), the router's prefill/decode decision, the KV
hand-off, queueing everywhere.

What one simulated engine does is what :class:`baton.engine.scheduler.Scheduler` does: each step
spends ``max_num_batched_tokens``, running requests first (a decode costs one token, an
unfinished prompt continues in chunks), then waiting requests in arrival order while the budget,
``max_num_seqs`` and free blocks allow. Work handed to an engine from outside (a new request, a
hand-off's reserve and commit) waits for the step in progress to end, as ``EngineLoop.run`` does.

A request's path, as the router takes it::

    every path:     arrive ─► a decode worker with fewer than max_num_seqs requests in flight
                    (least in flight); none: wait in the router's decode queue, first come
                    first served, until a request ends on one
    colocated:      ─► that worker: prefill ─► decode ─► done
    disaggregated:  arrive ─► prompt <= local_max tokens, or every prefill worker saturated
                       and prompt <= saturated_local_max tokens?
                       yes: decode worker prefills locally (as colocated)
                       no:  prefill worker ─► first token ─► decode worker: reserve blocks
                            ─► hand-off (profile) ─► commit: the client sees the first token
                            ─► decode ─► done

Prefix caching: each engine holds the full blocks of the prompts it prefilled or received
(least recently used out first, ``num_blocks`` of them; with tier sizes in :class:`Knobs`, what
the pool evicts goes to a host tier, then a disk tier), as the prefix index sees the workers.
The router scores candidates as it does with the index (its default weights: prefix hits, with
tier blocks discounted, requests in flight, queue, free KV, prompt tokens still to compute,
without the few milliseconds the workers' published counts lag); a hit is not computed again, a tier
hit costs its load time (the profile's ``tier_load``), and the P/D decision counts only the
tokens the chosen decode worker lacks. A worker's tensor-parallel size is its profile's: each
pool may have its own (:class:`Layout`'s ``prefill_tp``, ``decode_tp``).

Not modelled: preemption (a step that cannot get a block for a running request stops
admitting instead), network between machines (the profile's hand-off is whatever it measured),
blocks shared between a running request and the cache (the cache is bounded by the pool's size
on its own).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from baton.control.pd import (
    DEFAULT_SCORER_WEIGHTS,
    DEFAULT_TIER_WEIGHTS,
    pd_path,
    prefill_score,
    saturated_limit,
)
from baton.control.profile import CostModel, Profile
from baton.control.workload import Record, meets


@dataclass(frozen=True)
class Layout:
    """``prefill`` prefill workers and ``decode`` decode workers; ``prefill == 0`` with
    ``colocated`` is colocated serving (every worker prefills and decodes its own requests).
    ``prefill_tp``, ``decode_tp``: each pool's workers' tensor-parallel size (a worker is a
    group of that many ranks, costed by the profile measured at that size)."""

    prefill: int
    decode: int
    colocated: bool = False
    prefill_tp: int = 1
    decode_tp: int = 1

    @property
    def name(self) -> str:
        if self.colocated:
            return f"{self.decode} colocated" + (f" (TP{self.decode_tp})"
                                                  if self.decode_tp > 1 else "")
        if self.prefill_tp == self.decode_tp == 1:
            return f"{self.prefill}P+{self.decode}D"
        return f"{self.prefill}P(TP{self.prefill_tp})+{self.decode}D(TP{self.decode_tp})"

    @property
    def workers(self) -> int:
        return self.prefill + self.decode


@dataclass
class SimRequest(Record):
    """A request as the load generator records it (``sent`` = arrival, ``first`` = when the
    client sees the first token), plus the path the router took. Unfinished until
    :meth:`finish`."""

    error: str | None = "unfinished"
    path: str = ""
    keys: tuple = ()  # its prompt's full blocks, each keyed by the prefix up to its end
    # the first token's compute, from the prefill's first step to its end: the prefill worker's
    # (remote path: the router's "prefill" TTFT phase, its Prefill call less the worker's
    # queue) or the decode worker's (local path)
    prefill_s: float | None = None
    # the wait before that first step on the worker that computed it (the worker's ``queue_s``)
    queue_s: float | None = None
    sampling: tuple = ()  # its sampler's filters (() greedy): each token's row costs more

    def finish(self, t: float) -> None:
        self.end, self.output_tokens, self.error = t, self.max_tokens, None


@dataclass
class _Seq:
    """One request inside one simulated engine."""

    req: SimRequest
    prefill_only: bool = False
    computed: int = 0
    generated: int = 0
    blocks: int = 0
    on_done: Callable[[float], None] | None = None  # prefill-only: the first token is out
    load_s: float = 0.0  # tier blocks to load before its first chunk
    started: float | None = None  # the start of its first step
    submitted: float | None = None  # when it reached the engine's waiting line

    @property
    def num_tokens(self) -> int:
        return self.req.prompt_tokens + self.generated


class Sim:
    """The event queue, the tokens the cluster streams to its clients (the router and the
    clients relay them on the machine's cores: a prefill step's cost rises with their rate),
    and the engines (while the others run steps, a decode step's cost rises from the profile's
    idle decode factor toward its busy one, where they prefill (the relaying has no idle core
    to run on), and its decoding one, where they decode (the memory system is shared))."""

    STREAM_WINDOW_S = 1.0  # the rate is of the tokens streamed this long before
    BUSY_WINDOW_S = 1.0  # an engine's busy share is of this long before

    def __init__(self) -> None:
        self.now = 0.0
        self._rng = random.Random(0)  # the steps' noise: the same draws every run
        self._q: list = []
        self._n = itertools.count()
        self._streamed: deque[tuple[float, int]] = deque()
        self._streamed_n = 0
        self.engines: list[SimEngine] = []

    def others_busy(self, engine: SimEngine, t: float) -> tuple[float, float]:
        """The mean busy share of the engines other than ``engine`` over the window before
        ``t``, and the decode part of it ((0, 0) with none)."""
        others = [e.busy_share(t) for e in self.engines if e is not engine]
        if not others:
            return 0.0, 0.0
        return (sum(b for b, _ in others) / len(others),
                sum(d for _, d in others) / len(others))

    def streamed(self, t: float, n: int) -> None:
        """``n`` tokens went out to clients at ``t``."""
        if n:
            self._streamed.append((t, n))
            self._streamed_n += n

    def stream_rate(self, t: float) -> float:
        """Tokens a second streamed to clients over the window before ``t``."""
        while self._streamed and self._streamed[0][0] <= t - self.STREAM_WINDOW_S:
            self._streamed_n -= self._streamed.popleft()[1]
        return self._streamed_n / self.STREAM_WINDOW_S

    def noise(self, sigma: float) -> float:
        """A step's time over the model's: lognormal, mean 1, ``sigma`` the sd of its log."""
        return math.exp(self._rng.gauss(-sigma * sigma / 2, sigma)) if sigma > 0 else 1.0

    def at(self, t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self._q, (t, next(self._n), fn))

    def run(self) -> None:
        while self._q:
            self.now, _, fn = heapq.heappop(self._q)
            fn(self.now)


class PrefixCache:
    """The prompt blocks one engine holds: its pool, then its host and disk tiers (each least
    recently used out first, into the next)."""

    TIERS = ("pool", "host", "disk")

    def __init__(self, pool: int, host: int = 0, disk: int = 0) -> None:
        self.caps = dict(zip(self.TIERS, (pool, host, disk)))
        self.held: dict[str, OrderedDict] = {t: OrderedDict() for t in self.TIERS}

    def match(self, keys: Sequence) -> dict[str, int]:
        """Blocks of the longest held prefix of ``keys``, per tier."""
        out = dict.fromkeys(self.TIERS, 0)
        for k in keys:
            tier = next((t for t in self.TIERS if k in self.held[t]), None)
            if tier is None:
                break
            out[tier] += 1
        return out

    def insert(self, keys: Sequence) -> None:
        for k in keys:
            for t in self.TIERS[1:]:
                self.held[t].pop(k, None)
            self._put("pool", k)

    def _put(self, tier: str, k) -> None:
        held = self.held[tier]
        held[k] = None
        held.move_to_end(k)
        while len(held) > self.caps[tier]:
            old, _ = held.popitem(last=False)
            i = self.TIERS.index(tier)
            if i + 1 < len(self.TIERS) and self.caps[self.TIERS[i + 1]] > 0:
                self._put(self.TIERS[i + 1], old)


class SimEngine:
    def __init__(self, sim: Sim, cost: CostModel, p: Profile, name: str,
                 tiers: tuple[int, int] = (0, 0), local: bool = False) -> None:
        self.sim, self.cost, self.name = sim, cost, name
        self.local = local  # a decode worker: the prompts it prefills are the local path
        self.budget, self.max_seqs = p.max_num_batched_tokens, p.max_num_seqs
        self.bs = p.block_size
        self.num_blocks = p.num_blocks
        self.cache = PrefixCache(p.num_blocks, *tiers)
        self.free_blocks = p.num_blocks
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.ops: list[Callable[[float], None]] = []
        self.busy = False
        # (start, end, decode share by tokens) of recent steps
        self._steps: deque[tuple[float, float, float]] = deque()
        self._steps_s = 0.0  # their summed length
        self._steps_dec_s = 0.0  # and its decode part
        self.inflight = 0  # the router's count of its requests here
        self.on_free: Callable[[float], None] | None = None  # a decode slot freed
        sim.engines.append(self)

    def _forget(self, lo: float) -> None:
        """Drops the steps that ended by ``lo``."""
        while self._steps and self._steps[0][1] <= lo:
            a, b, f = self._steps.popleft()
            self._steps_s -= b - a
            self._steps_dec_s -= (b - a) * f

    def busy_share(self, t: float) -> tuple[float, float]:
        """The share of the window before ``t`` (:attr:`Sim.BUSY_WINDOW_S`) this engine spent
        in steps (a step still running counts up to ``t``), and the decode part of it (each
        step's time split by its tokens)."""
        lo = t - self.sim.BUSY_WINDOW_S
        self._forget(lo)
        if not self._steps:
            return 0.0, 0.0
        (a0, _, f0), (_, b1, f1) = self._steps[0], self._steps[-1]
        head, tail = max(0.0, lo - a0), max(0.0, b1 - t)  # the parts outside the window
        busy = self._steps_s - head - tail
        dec = self._steps_dec_s - head * f0 - tail * f1
        w = self.sim.BUSY_WINDOW_S
        busy = min(1.0, max(0.0, busy / w))
        return busy, min(busy, max(0.0, dec / w))

    def ended(self, t: float) -> None:
        """One of the router's requests here ended: its decode slot is free."""
        self.inflight -= 1
        if self.on_free is not None:
            self.on_free(t)

    # -- outside work, at the next step boundary --------------------------------------------------

    def run_op(self, t: float, fn: Callable[[float], None]) -> None:
        if self.busy:
            self.ops.append(fn)
        else:
            fn(t)
            self._start(t)

    def submit(self, t: float, seq: _Seq) -> None:
        seq.submitted = t
        self.run_op(t, lambda _t: self.waiting.append(seq))

    def prefill_tokens_left(self) -> int:
        """As the engine's scheduler counts them (``Scheduler.prefill_tokens_left``): the
        tokens each queued request has to compute, whole (the engine looks up its prefix hit
        when it admits it), and each running one's, where more than its next token."""
        n = sum(s.num_tokens for s in self.waiting if s.num_tokens > 1)
        for s in self.running:
            left = s.num_tokens - s.computed
            n += left if left > 1 else 0
        return n

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.bs)

    def take_blocks(self, seq: _Seq, tokens: int) -> bool:
        more = self.blocks_for(tokens) - seq.blocks
        if more > self.free_blocks:
            return False
        self.free_blocks -= max(0, more)
        seq.blocks += max(0, more)
        return True

    def release(self, seq: _Seq) -> None:
        self.free_blocks += seq.blocks
        seq.blocks = 0

    # -- stepping ---------------------------------------------------------------------------------

    def _schedule(self) -> list[tuple[_Seq, int]]:
        batch, budget = [], self.budget
        for seq in self.running:
            if budget <= 0:
                break
            n = min(seq.num_tokens - seq.computed, budget)
            if not self.take_blocks(seq, seq.computed + n):
                return batch  # memory is short: no admissions either
            batch.append((seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.computed, budget)  # a held prefix is not computed
            if not self.take_blocks(seq, seq.computed + n):
                break
            self.waiting.popleft()
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
        return batch

    def _start(self, t: float) -> None:
        ops, self.ops = self.ops, []
        for fn in ops:
            fn(t)
        batch = self._schedule()
        if not batch:
            self.busy = False
            return
        self.busy = True
        chunks = [(n, s.computed) for s, n in batch if s.computed < s.req.prompt_tokens]
        decodes = [s.computed for s, n in batch if s.computed >= s.req.prompt_tokens]
        loads = sum(s.load_s for s, _ in batch)
        for s, _ in batch:
            s.load_s = 0.0
            if s.started is None:
                s.started = t
                if s.submitted is not None:
                    s.req.queue_s = t - s.submitted
        # the others' busy share only where it moves the step: decodes at a profile whose
        # decode factors differ (a version-6 profile has one)
        busy, decoding = (self.sim.others_busy(self, t)
                          if decodes and self.cost.decode_factors_differ else (1.0, 0.0))
        # every row that ends this step with a token samples it (a prompt's last chunk too)
        # (none to sum, greedy, with a profile that timed no sampler)
        sampled = sum(self.cost.sample_row(s.req.sampling) for s, n in batch
                      if s.req.sampling and s.computed + n >= s.num_tokens
                      ) if self.cost.samples else 0.0
        step = self.cost.step(chunks, decodes, self.sim.stream_rate(t), self.local, busy,
                              decoding, sampled) * self.sim.noise(self.cost.step_noise)
        end = t + loads + step
        self._forget(t - self.sim.BUSY_WINDOW_S)  # bounded when nobody asks
        f = len(decodes) / max(1, len(decodes) + sum(c[0] for c in chunks))
        self._steps.append((t, end, f))
        self._steps_s += end - t
        self._steps_dec_s += (end - t) * f
        self.sim.at(end, lambda t2: self._end(batch, t2))

    def _end(self, batch: list[tuple[_Seq, int]], t: float) -> None:
        self.sim.streamed(t, sum(1 for seq, n in batch if not seq.prefill_only
                                 and seq.computed + n >= seq.num_tokens))
        for seq, n in batch:
            seq.computed += n
            if seq.computed < seq.num_tokens:
                continue  # a prompt chunk: no token yet
            seq.generated += 1
            if seq.generated == 1:
                self.cache.insert(seq.req.keys)
            if seq.generated == 1 and seq.prefill_only:
                self.running.remove(seq)  # blocks stay pinned until the hand-off frees them
                if seq.on_done is not None:
                    seq.on_done(t)
                continue
            if seq.generated == 1 and seq.req.first is None:
                seq.req.first = t
                if seq.req.path == "local":
                    seq.req.prefill_s = t - seq.started
            if seq.generated >= seq.req.max_tokens:
                seq.req.finish(t)
                self.running.remove(seq)
                self.release(seq)
                self.ended(t)
        self._start(t)


@dataclass(frozen=True)
class Knobs:
    """The router's settings that change the path (as `baton router` names them)."""

    local_prefill_max_tokens: int = 64
    prefill_saturation: int = 8
    saturated_local_max_tokens: int = 256  # < 0: any length
    rpc_s: float = 0.001  # one gRPC hop between processes on one machine
    # the router's scorer weights with the index, and its tier weights (its defaults)
    weights: tuple[tuple[str, float], ...] = tuple(DEFAULT_SCORER_WEIGHTS.items())
    tier_weights: tuple[tuple[str, float], ...] = tuple(DEFAULT_TIER_WEIGHTS.items())
    host_tier_blocks: int = 0  # each worker's --kv-host-tier-gb, in blocks
    disk_tier_blocks: int = 0  # each worker's --kv-disk-tier-gb, in blocks


class Cluster:
    """Simulated workers of one :class:`Layout` and the router's decisions. ``profiles``: the
    profile per tensor-parallel size, for pools whose size is not ``profile``'s."""

    def __init__(self, layout: Layout, profile: Profile, cost: CostModel | None = None,
                 knobs: Knobs | None = None, profiles: dict[int, Profile] | None = None) -> None:
        self.layout, self.p = layout, profile
        self.knobs = k = knobs or Knobs()
        self._saturated_local_max = saturated_limit(k.saturated_local_max_tokens)
        self.sim = Sim()
        by_tp = {profile.tensor_parallel_size: (profile, cost or CostModel(profile))}
        for tp, q in (profiles or {}).items():
            by_tp.setdefault(tp, (q, CostModel(q)))

        def engines(role: str, n: int, tp: int) -> list[SimEngine]:
            if tp not in by_tp:
                raise ValueError(f"no profile at tensor-parallel size {tp} for the {role} pool "
                                 f"(have {sorted(by_tp)})")
            q, c = by_tp[tp]
            return [SimEngine(self.sim, c, q, f"{role}-{i}",
                              (k.host_tier_blocks, k.disk_tier_blocks), role == "decode")
                    for i in range(n)]

        self.prefills = engines("prefill", layout.prefill, layout.prefill_tp)
        self.decodes = engines("decode", layout.decode, layout.decode_tp)
        for d in self.decodes:
            d.on_free = self._slot_freed
        self.decode_queue: deque[SimRequest] = deque()  # waiting for a decode slot
        self._turn = itertools.count()
        self._tier_w = dict(k.tier_weights)
        total = sum(w for _, w in k.weights)
        self._weights = {name: w / total for name, w in k.weights}

    def _score(self, e: SimEngine, hits: dict[str, int], n_blocks: int) -> float:
        """The router's score with the index (routing.SCORERS, its default weights)."""
        w = self._weights
        prefix = ((hits["pool"] + self._tier_w.get("host", 0) * hits["host"]
                   + self._tier_w.get("disk", 0) * hits["disk"]) / n_blocks if n_blocks else 0.0)
        return (w.get("prefix", 0) * prefix + w.get("inflight", 0) / (1 + e.inflight)
                + w.get("queue", 0) / (1 + len(e.waiting))
                + w.get("kv", 0) * e.free_blocks / max(1, e.num_blocks)
                + w.get("prefill", 0) * prefill_score(e.prefill_tokens_left()))

    def _best(self, engines: Sequence[SimEngine], keys: tuple) -> tuple[SimEngine, dict]:
        """The highest-scored engine (ties in turn) and its hits."""
        hits = [e.cache.match(keys) for e in engines]
        scores = [self._score(e, h, len(keys)) for e, h in zip(engines, hits)]
        top = max(scores)
        tied = [i for i, sc in enumerate(scores) if sc >= top - 1e-9]
        i = tied[next(self._turn) % len(tied)]
        return engines[i], hits[i]

    def run(self, reqs: Sequence[SimRequest]) -> list[SimRequest]:
        for r in reqs:
            self.sim.at(r.sent + self.p.router_s, lambda t, r=r: self._route(t, r))
        self.sim.run()
        return list(reqs)

    def _slot_freed(self, t: float) -> None:
        if self.decode_queue:
            self._route(t, self.decode_queue.popleft(), queued=True)

    def _seq(self, e: SimEngine, r: SimRequest, hits: dict[str, int], **kw) -> _Seq:
        """``r`` on ``e`` with its held prefix not computed again (a tier's blocks loaded);
        at least the last prompt token is computed, for the logits."""
        cached = min(sum(hits.values()) * e.bs, r.prompt_tokens - 1)
        load = 0.0
        for k in r.keys[:cached // e.bs]:  # the blocks used, in order: most recently used now
            tier = next(t for t in PrefixCache.TIERS if k in e.cache.held[t])
            e.cache.held[tier].move_to_end(k)
            load += e.cost.tier_load_s(tier) if tier != "pool" else 0.0
        r.cached_tokens = cached
        return _Seq(r, computed=cached, load_s=load, **kw)

    def _route(self, t: float, r: SimRequest, queued: bool = False) -> None:
        # as the router's DecodeQueue: a decode worker with room in its batch, else wait, in
        # arrival order (a newcomer joins the line behind anyone already waiting)
        room = [e for e in self.decodes if e.inflight < e.max_seqs]
        if not room or (self.decode_queue and not queued):
            self.decode_queue.append(r)
            return
        d, d_hits = self._best(room, r.keys)
        d.inflight += 1
        k = self.knobs
        saturated = all(e.inflight + len(e.waiting) >= k.prefill_saturation > 0
                        for e in self.prefills)
        path, _ = pd_path(r.prompt_tokens - sum(d_hits.values()) * d.bs,
                          bool(self.prefills) and not self.layout.colocated,
                          saturated, k.local_prefill_max_tokens, self._saturated_local_max)
        if path == "local":
            r.path = "local"
            d.submit(t, self._seq(d, r, d_hits))
            return
        r.path = "remote"
        p, p_hits = self._best(self.prefills, r.keys)
        p.inflight += 1
        seq = self._seq(p, r, p_hits, prefill_only=True)

        def prefilled(t1: float) -> None:
            p.inflight -= 1
            r.prefill_s = t1 - seq.started
            if r.max_tokens <= 1:  # the first token ends it: nothing to hand off
                p.release(seq)
                r.first = t1
                r.finish(t1)
                d.ended(t1)
                return
            self.sim.at(t1 + k.rpc_s, lambda t2: d.run_op(t2, lambda t3: self._reserve(
                t3, d, p, seq)))

        seq.on_done = prefilled
        p.submit(t, seq)

    def _reserve(self, t: float, d: SimEngine, p: SimEngine, src: _Seq) -> None:
        """Decode side of a hand-off: blocks for the prompt (waiting a step while the pool is
        full), the transfer, then the commit at a step boundary; the prefill side's blocks are
        free once the transfer ends."""
        r = src.req
        seq = _Seq(r, computed=r.prompt_tokens, generated=1)
        if not d.take_blocks(seq, r.prompt_tokens + 1):
            self.sim.at(t + 0.01, lambda t2: d.run_op(t2, lambda t3: self._reserve(
                t3, d, p, src)))
            return

        def transferred(t2: float) -> None:
            p.release(src)
            p.run_op(t2, lambda _t: None)  # freed blocks may let it admit

            def commit(t3: float) -> None:
                r.first = t3
                d.cache.insert(r.keys)
                if r.max_tokens <= 1:
                    r.finish(t3)
                    d.release(seq)
                    d.ended(t3)
                else:
                    d.running.append(seq)
            d.run_op(t2, commit)

        self.sim.at(t + p.cost.handoff(r.prompt_tokens), transferred)


# ---- attainment and goodput ----------------------------------------------------------------------


def simulate(layout: Layout, profile: Profile, shape: Sequence[tuple],
             knobs: Knobs | None = None, cost: CostModel | None = None,
             profiles: dict[int, Profile] | None = None) -> list[SimRequest]:
    """``shape``: (prompt tokens, output tokens, arrival seconds[, the prompt's block keys[,
    its sampler's filters]]) per request (:func:`block_keys`; filters as the router records
    them, :data:`baton.control.profile.SAMPLING`)."""
    reqs = [SimRequest(x[0], x[1], x[2], keys=tuple(x[3]) if len(x) > 3 else (),
                       sampling=tuple(x[4]) if len(x) > 4 else ()) for x in shape]
    return Cluster(layout, profile, cost, knobs, profiles).run(reqs)


def block_keys(prompt: Sequence[int], block_size: int) -> tuple:
    """A key per full block of ``prompt``, each standing for the whole prefix up to the block's
    end (two prompts share the first k keys exactly when they share their first k blocks), as
    the engine's block hashes do."""
    keys, h = [], 0
    for i in range(block_size, len(prompt) + 1, block_size):
        h = hash((h, tuple(prompt[i - block_size:i])))
        keys.append(h)
    return tuple(keys)


def attainment(reqs: Sequence[SimRequest], ttft_slo: float, tpot_slo: float) -> float:
    """Share of ``reqs`` that ended with TTFT <= ``ttft_slo`` and TPOT <= ``tpot_slo``."""
    return sum(meets(r, ttft_slo, tpot_slo) for r in reqs) / len(reqs) if reqs else 0.0
