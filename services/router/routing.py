"""Routing decisions: which decode worker, whether to prefill there or on a prefill worker, and
which one.

Every candidate gets a score in [0, 1] from each scorer, combined with weights
(``--scorers prefix=3,inflight=1,queue=1,kv=0.5,prefill=1``)::

    prefix    leading prompt blocks the worker's KV cache holds / prompt blocks (Redis index);
              a block in a KV tier (host memory, disk) counts its tier's weight (--tier-weights:
              the share of a block's prefill time a load from the tier saves, measured by
              `baton profile`), so a pool hit beats a host hit beats a disk hit beats a miss
    inflight  1 / (1 + requests in flight on it, counted by every router in Redis)
    queue     1 / (1 + requests waiting in its engine's queue)
    kv        free KV blocks / total KV blocks
    prefill   1 / (1 + prompt tokens its engine has still to compute / 1,024): a worker busy
              with a long prompt is not as free as its request count says

The best-scoring decode worker is chosen first (prefix overlap there means fewer blocks to move).
Then conditional disaggregation: the decode worker prefills the prompt itself (``local``) when the
tokens it does not hold are at most ``local_max_new_tokens``, when no prefill worker is available,
or when every prefill worker is saturated and it lacks at most ``saturated_local_max_tokens``;
otherwise the best-scoring prefill worker prefills it (``remote``). The last limit is there
because a long prompt prefilled on a decode worker stalls every stream it decodes: at 3 req/s on
a 1P+1D pair (2-core VM, Azure conversation trace) 2,036-, 566- and 558-token prompts sent there
on saturation put 46 of 100 requests past a 100 ms TPOT; with the limit at 256, 6 (and 90% met
both SLOs, TTFT 4 s too, against 48%).
With one candidate and no other worker to prefill, the choice is forced and the index is not
read. Each decision carries its reason, reported in the final message and counted in
``/metrics``.

Without the index (``--routing least-loaded``, or Redis unreachable) the prefix scorer is left out
and the router's own in-flight counts replace the shared ones. ``--routing round-robin`` is the
cache-blind baseline: workers in turn, the threshold applied to the whole prompt.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from baton.control.pd import (  # noqa: F401 (the reasons are part of the routing API)
    DEFAULT_SCORER_WEIGHTS,
    DEFAULT_TIER_WEIGHTS,
    FEW_NEW_TOKENS,
    MANY_NEW_TOKENS,
    NO_PREFILL_WORKER,
    PREFILL_SATURATED,
    pd_path,
    prefill_score,
    saturated_limit,
)
from baton.control.prefix_index import PrefixIndex, Signals
from baton.control.registry import WorkerRecord
from baton.engine.block_hash import hash_chain, namespace_for
from baton.services.router.limits import PoolFullError

MODES = ("cache-aware", "least-loaded", "round-robin")
DEFAULT_WEIGHTS = ",".join(f"{k}={v:g}" for k, v in DEFAULT_SCORER_WEIGHTS.items())



class NoWorkerError(Exception):
    pass


@dataclass(frozen=True)
class ScoreInput:
    """What a scorer sees about one candidate."""

    signals: Signals
    prompt_blocks: int  # blocks of the prompt that could be reused at all
    tier_weights: dict[str, float] = field(default_factory=lambda: DEFAULT_TIER_WEIGHTS)


def _prefix(x: ScoreInput) -> float:
    if not x.prompt_blocks:
        return 0.0
    s, w = x.signals, x.tier_weights
    return (s.hit_blocks + w.get("host", 0.0) * s.host_blocks
            + w.get("disk", 0.0) * s.disk_blocks) / x.prompt_blocks


def _inflight(x: ScoreInput) -> float:
    return 1.0 / (1 + x.signals.inflight)


def _queue(x: ScoreInput) -> float:
    return 1.0 / (1 + (x.signals.waiting or 0))


def _kv(x: ScoreInput) -> float:
    s = x.signals
    if not s.total_blocks or s.free_blocks is None:
        return 1.0
    return s.free_blocks / s.total_blocks


def _prefill(x: ScoreInput) -> float:
    return prefill_score(x.signals.prefill_tokens)


SCORERS = {"prefix": _prefix, "inflight": _inflight, "queue": _queue, "kv": _kv,
           "prefill": _prefill}


def _parse_named_numbers(spec: str, known, what: str, lo: float, hi: float | None,
                         start: dict[str, float]) -> dict[str, float]:
    """``"a=1,b=2"`` over ``start``: each name in ``known``, each number in [lo, hi]; raises
    ValueError naming the bad entry (``what``: "scorer", "KV tier")."""
    out = dict(start)
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, value = part.partition("=")
        if name not in known:
            raise ValueError(f"unknown {what} {name!r} (known: {', '.join(known)})")
        try:
            w = float(value)
        except ValueError:
            raise ValueError(f"{what} weight {part!r} is not name=number") from None
        if hi is None and w < lo:
            raise ValueError(f"{what} weight {part!r} must be >= {lo:g}")
        if hi is not None and not lo <= w <= hi:
            raise ValueError(f"{what} weight {part!r} must be in [{lo:g}, {hi:g}]")
        out[name] = w
    return out


def parse_tier_weights(spec: str) -> dict[str, float]:
    """``"host=0.95,disk=0.8"`` -> weights in [0, 1] (the others default); raises ValueError
    naming a bad entry."""
    return _parse_named_numbers(spec, DEFAULT_TIER_WEIGHTS, "KV tier", 0, 1,
                                DEFAULT_TIER_WEIGHTS)


def parse_weights(spec: str) -> dict[str, float]:
    """``"prefix=3,inflight=1"`` -> weights; raises ValueError naming a bad entry."""
    out = _parse_named_numbers(spec, SCORERS, "scorer", 0, None, {})
    if not any(out.values()):
        raise ValueError(f"scorer weights {spec!r}: at least one must be > 0")
    return out


@dataclass
class Decision:
    path: str  # remote | local
    reason: str
    decode: WorkerRecord
    prefill: WorkerRecord | None
    cached_tokens: int  # tokens the index says the prefilling worker holds (0 without it)
    used_index: bool
    decide_s: float


class RoutingPolicy:
    """Decides a request's workers. ``pool`` is the router's WorkerPool (registry view and local
    in-flight counts); ``index`` may be None (no Redis index: load-only)."""

    def __init__(self, pool, index: PrefixIndex | None, *, mode: str = "cache-aware",
                 weights: dict[str, float] | None = None, local_max_new_tokens: int = 64,
                 prefill_saturation: int = 8, saturated_local_max_tokens: int = 256,
                 tier_weights: dict[str, float] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"routing mode {mode!r} must be one of {MODES}")
        self.pool, self.index, self.mode = pool, index, mode
        self.weights = weights or parse_weights(DEFAULT_WEIGHTS)
        self.tier_weights = tier_weights or dict(DEFAULT_TIER_WEIGHTS)
        self.local_max_new_tokens, self.prefill_saturation = (local_max_new_tokens,
                                                              prefill_saturation)
        self.saturated_local_max = saturated_limit(saturated_local_max_tokens)
        self._turns: dict[str, int] = {}
        self._lock = threading.Lock()
        # The in-flight counts a decision reads were taken before its read, and the decisions
        # this router made meanwhile (a burst's other requests, racing in other threads) have
        # not claimed their workers yet, so a burst would pile onto the worker every racer saw
        # as least loaded. Each decision adds the ones made since it started, and picks and
        # records under one lock, so the racers of one router see each other.
        self._seq = 0  # decisions made so far; the last 4096 kept: (decode id, prefill id)
        self._decided: deque[tuple[str, str | None]] = deque(maxlen=4096)
        self._pick_lock = threading.Lock()

    def prompt_hashes(self, ids: list[int], fingerprint: str, cache_salt: str | None,
                      block_size: int) -> bytes:
        """Hashes (concatenated, 32 bytes each) of the blocks a worker could reuse: at most
        ``len(ids) - 1`` tokens (the last prompt token always runs through the model)."""
        usable = (len(ids) - 1) // block_size * block_size
        return hash_chain(ids[:usable], block_size, namespace_for(fingerprint, cache_salt))

    def decide(self, ids: list[int], hashes: bytes | None, exclude: set[str]) -> Decision:
        """``hashes``: :meth:`prompt_hashes` (None in round-robin mode)."""
        t0 = time.perf_counter()
        decodes = [w for w in self.pool.workers("decode") if w.address not in exclude]
        if not decodes:
            known = len(self.pool.workers("decode"))
            raise NoWorkerError(f"no decode worker available ({known} registered, "
                                f"{len(exclude)} failed for this request)")
        prefills = [w for w in self.pool.workers("prefill") if w.address not in exclude]
        if self.mode == "round-robin":
            d = self._turn("decode", self._open(decodes, None))
            p_cands = [w for w in prefills if w.address != d.address]
            p = self._turn("prefill", p_cands) if p_cands else None
            return self._finish(ids, d, p, 0, 0, False, False, t0)

        if len(decodes) == 1 and all(w.address == decodes[0].address for w in prefills):
            # one worker, no other to prefill: nothing the index says could change the choice
            return self._finish(ids, self._open(decodes, None)[0], None, 0, 0, False, False, t0)
        union = {w.worker_id: w for w in decodes + prefills}
        records = list(union.values())
        with self._pick_lock:
            since = self._seq
        sig = None
        if self.mode == "cache-aware" and self.index is not None:
            sig = self.index.signals(hashes or b"", records)
        used_index = sig is not None
        if sig is None:
            sig = [Signals(inflight=self.pool.inflight(w.address)) for w in records]
        by_id = dict(zip(union, sig))
        with self._pick_lock:
            for wids in itertools.islice(reversed(self._decided), self._seq - since):
                for wid in wids:
                    if wid in by_id:
                        by_id[wid].inflight += 1
            decision = self._pick(ids, hashes, self._open(decodes, by_id), prefills, by_id,
                                  used_index, t0)
            self._decided.append((decision.decode.worker_id,
                                  decision.prefill.worker_id if decision.prefill else None))
            self._seq += 1
        return decision

    def _open(self, decodes: list[WorkerRecord], by_id: dict | None) -> list[WorkerRecord]:
        """The decode workers with room in their running batch: fewer requests in flight on
        them than their ``--max-num-seqs`` (counted by every router, from the index; this
        router's own count without it). Raises PoolFullError when none has."""
        def load(w: WorkerRecord) -> int:
            return by_id[w.worker_id].inflight if by_id else self.pool.inflight(w.address)

        out = [w for w in decodes if not w.max_num_seqs or load(w) < w.max_num_seqs]
        if not out:
            raise PoolFullError(f"every decode worker runs its --max-num-seqs requests "
                                f"({len(decodes)} workers)")
        return out

    def _pick(self, ids, hashes, decodes, prefills, by_id, used_index, t0) -> Decision:
        dropped = set() if used_index else {"prefix"}
        if self.weights.get("prefill") and any(s.prefill_tokens is None
                                               for s in by_id.values()):
            # a worker of an earlier release publishes no count: scored as idle on this term,
            # it would draw the requests until it is upgraded, so in a rolling upgrade (or with
            # no index) the decision is made as before the term
            dropped.add("prefill")
        weights = {k: v for k, v in self.weights.items()
                   if k not in dropped} or {"inflight": 1.0}
        n_blocks = len(hashes or b"") // 32
        total = sum(weights.values())
        terms = [(SCORERS[name], wt / total) for name, wt in weights.items() if wt]
        scores = {}  # each worker scored once, though it may be a candidate for both roles
        for wid, s in by_id.items():
            x = ScoreInput(s, n_blocks, self.tier_weights)
            scores[wid] = sum(wt * f(x) for f, wt in terms)

        def score(w: WorkerRecord) -> float:
            return scores[w.worker_id]

        d = self._best("decode", decodes, score)
        p_cands = [w for w in prefills if w.address != d.address]
        p = self._best("prefill", p_cands, score) if p_cands else None
        bs = d.block_size

        def saturated(w: WorkerRecord) -> bool:
            s = by_id[w.worker_id]
            return (s.inflight + (s.waiting or 0)) >= self.prefill_saturation > 0

        def held(w: WorkerRecord) -> int:  # a tier's blocks load faster than they compute
            s = by_id[w.worker_id]
            return (s.hit_blocks + s.host_blocks + s.disk_blocks) * bs

        return self._finish(ids, d, p, held(d), held(p) if p else 0,
                            bool(p_cands) and all(saturated(w) for w in p_cands),
                            used_index, t0)

    def _finish(self, ids, d, p, d_cached, p_cached, saturated: bool, used_index,
                t0) -> Decision:
        path, reason = pd_path(len(ids) - d_cached, p is not None, saturated,
                               self.local_max_new_tokens, self.saturated_local_max)
        return Decision(path, reason, d, p if path == "remote" else None,
                        d_cached if path == "local" else p_cached, used_index,
                        time.perf_counter() - t0)

    def _best(self, role: str, workers: list[WorkerRecord], score) -> WorkerRecord:
        """Highest score; ties (within 1e-9) taken in turn, so equal workers share a burst."""
        scored = [(score(w), w) for w in workers]
        top = max(s for s, _ in scored)
        return self._turn(role, [w for s, w in scored if s >= top - 1e-9])

    def _turn(self, role: str, workers: list[WorkerRecord]) -> WorkerRecord:
        with self._lock:
            turn = self._turns[role] = self._turns.get(role, -1) + 1
        return workers[turn % len(workers)]
