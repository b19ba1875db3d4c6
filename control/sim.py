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

Not modelled: prefix-cache hits (the traces' prompts are unique token streams), preemption (a
step that cannot get a block for a running request stops admitting instead), network between
machines (the profile's hand-off is whatever it measured).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from baton.control.pd import pd_path, saturated_limit
from baton.control.profile import CostModel, Profile
from baton.control.workload import Record, meets


@dataclass(frozen=True)
class Layout:
    """``prefill`` prefill workers and ``decode`` decode workers; ``prefill == 0`` with
    ``colocated`` is colocated serving (every worker prefills and decodes its own requests)."""

    prefill: int
    decode: int
    colocated: bool = False

    @property
    def name(self) -> str:
        return f"{self.decode} colocated" if self.colocated else f"{self.prefill}P+{self.decode}D"

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

    @property
    def num_tokens(self) -> int:
        return self.req.prompt_tokens + self.generated


class Sim:
    """The event queue."""

    def __init__(self) -> None:
        self.now = 0.0
        self._q: list = []
        self._n = itertools.count()

    def at(self, t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self._q, (t, next(self._n), fn))

    def run(self) -> None:
        while self._q:
            self.now, _, fn = heapq.heappop(self._q)
            fn(self.now)


class SimEngine:
    def __init__(self, sim: Sim, cost: CostModel, p: Profile, name: str) -> None:
        self.sim, self.cost, self.name = sim, cost, name
        self.budget, self.max_seqs = p.max_num_batched_tokens, p.max_num_seqs
        self.bs = p.block_size
        self.free_blocks = p.num_blocks
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.ops: list[Callable[[float], None]] = []
        self.busy = False
        self.inflight = 0  # the router's count of its requests here
        self.on_free: Callable[[float], None] | None = None  # a decode slot freed

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
        self.run_op(t, lambda _t: self.waiting.append(seq))

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
            n = min(seq.num_tokens, budget)
            if not self.take_blocks(seq, n):
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
        self.sim.at(t + self.cost.step(chunks, decodes), lambda t2: self._end(batch, t2))

    def _end(self, batch: list[tuple[_Seq, int]], t: float) -> None:
        for seq, n in batch:
            seq.computed += n
            if seq.computed < seq.num_tokens:
                continue  # a prompt chunk: no token yet
            seq.generated += 1
            if seq.generated == 1 and seq.prefill_only:
                self.running.remove(seq)  # blocks stay pinned until the hand-off frees them
                if seq.on_done is not None:
                    seq.on_done(t)
                continue
            if seq.generated == 1 and seq.req.first is None:
                seq.req.first = t
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


class Cluster:
    """Simulated workers of one :class:`Layout` and the router's decisions."""

    def __init__(self, layout: Layout, profile: Profile, cost: CostModel | None = None,
                 knobs: Knobs | None = None) -> None:
        self.layout, self.p = layout, profile
        self.cost = cost or CostModel(profile)
        self.knobs = knobs or Knobs()
        self._saturated_local_max = saturated_limit(self.knobs.saturated_local_max_tokens)
        self.sim = Sim()
        self.prefills = [SimEngine(self.sim, self.cost, profile, f"prefill-{i}")
                         for i in range(layout.prefill)]
        self.decodes = [SimEngine(self.sim, self.cost, profile, f"decode-{i}")
                        for i in range(layout.decode)]
        for d in self.decodes:
            d.on_free = self._slot_freed
        self.decode_queue: deque[SimRequest] = deque()  # waiting for a decode slot
        self._turn = itertools.count()

    def _least(self, engines: Sequence[SimEngine], load: Callable[[SimEngine], int]):
        low = min(load(e) for e in engines)
        tied = [e for e in engines if load(e) == low]
        return tied[next(self._turn) % len(tied)]

    def run(self, reqs: Sequence[SimRequest]) -> list[SimRequest]:
        for r in reqs:
            self.sim.at(r.sent + self.p.router_s, lambda t, r=r: self._route(t, r))
        self.sim.run()
        return list(reqs)

    def _slot_freed(self, t: float) -> None:
        if self.decode_queue:
            self._route(t, self.decode_queue.popleft(), queued=True)

    def _route(self, t: float, r: SimRequest, queued: bool = False) -> None:
        # as the router's DecodeQueue: a decode worker with room in its batch, else wait, in
        # arrival order (a newcomer joins the line behind anyone already waiting)
        room = [e for e in self.decodes if e.inflight < e.max_seqs]
        if not room or (self.decode_queue and not queued):
            self.decode_queue.append(r)
            return
        d = self._least(room, lambda e: e.inflight)
        d.inflight += 1
        k = self.knobs
        saturated = all(e.inflight + len(e.waiting) >= k.prefill_saturation > 0
                        for e in self.prefills)
        path, _ = pd_path(r.prompt_tokens, bool(self.prefills) and not self.layout.colocated,
                          saturated, k.local_prefill_max_tokens, self._saturated_local_max)
        if path == "local":
            r.path = "local"
            d.submit(t, _Seq(r))
            return
        r.path = "remote"
        p = self._least(self.prefills, lambda e: e.inflight)
        p.inflight += 1
        seq = _Seq(r, prefill_only=True)

        def prefilled(t1: float) -> None:
            p.inflight -= 1
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
                if r.max_tokens <= 1:
                    r.finish(t3)
                    d.release(seq)
                    d.ended(t3)
                else:
                    d.running.append(seq)
            d.run_op(t2, commit)

        self.sim.at(t + self.cost.handoff(r.prompt_tokens), transferred)


# ---- attainment and goodput ----------------------------------------------------------------------


def simulate(layout: Layout, profile: Profile, shape: Sequence[tuple[int, int, float]],
             knobs: Knobs | None = None, cost: CostModel | None = None) -> list[SimRequest]:
    """``shape``: (prompt tokens, output tokens, arrival seconds) per request."""
    reqs = [SimRequest(p, o, at) for p, o, at in shape]
    return Cluster(layout, profile, cost, knobs).run(reqs)


def attainment(reqs: Sequence[SimRequest], ttft_slo: float, tpot_slo: float) -> float:
    """Share of ``reqs`` that ended with TTFT <= ``ttft_slo`` and TPOT <= ``tpot_slo``."""
    return sum(meets(r, ttft_slo, tpot_slo) for r in reqs) / len(reqs) if reqs else 0.0
