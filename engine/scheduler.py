"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

The scheduler decides *what* runs next and returns it as plain data; it never calls the model.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from baton.engine.config import EngineConfig
from baton.engine.kv_cache import KVCacheManager
from baton.engine.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    """One engine step: ``num_new_tokens[i]`` tokens of ``requests[i]`` run through the model."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.requests)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)


@dataclass
class SchedulerStats:
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0  # tokens run through the model (prompt chunks + decodes)


class Scheduler:
    """Waiting queue (FIFO) + running list (oldest first) over a :class:`KVCacheManager`.

    Each step spends a budget of ``max_num_batched_tokens``: running requests first (a decode
    step costs one token, an unfinished prefill continues in chunks), then waiting requests are
    admitted while blocks, budget and ``max_num_seqs`` allow. When a running request cannot get a
    block, the newest running request is preempted: its blocks are freed (full blocks stay in the
    prefix cache) and it goes back to the front of the waiting queue to be recomputed.
    """

    def __init__(self, cfg: EngineConfig, kv: KVCacheManager) -> None:
        self.cfg = cfg
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        # prompt tokens still to run through the model, over every queued and running request
        # (a preempted one's output tokens too): the load a long prompt puts on this engine,
        # which a count of requests does not show. Kept on the engine thread (add, finish,
        # recount after each step) and read from any thread as one int (the prefix index
        # publishes it; the routers' ``prefill`` scorer reads it)
        self.prefill_tokens_left = 0
        # the waiting queue's part of it, kept as requests join and leave the queue (a queued
        # request computes nothing), so a step's recount walks only the running batch
        self._waiting_left = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self._waiting_left += _left(request)
        self.prefill_tokens_left += _left(request)

    def recount(self) -> None:
        """:attr:`prefill_tokens_left` after a step moved the running batch."""
        self.prefill_tokens_left = self._waiting_left + sum(_left(r) for r in self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.cfg.max_num_batched_tokens

        # 1. running requests, oldest first; preempt from the newest end when blocks run out
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while self.kv.allocate_slots(req, n) is None:
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            else:
                batch.requests.append(req)
                batch.num_new_tokens.append(n)
                budget -= n
                i += 1
                continue
            break

        # 2. admit waiting requests (not in a step that had to preempt: memory is short)
        while (self.waiting and budget > 0 and not batch.preempted
               and len(self.running) < self.cfg.max_num_seqs):
            req = self.waiting[0]
            hit = self.kv.get_prefix_hit(req)
            n = min(req.num_tokens - hit.num_tokens, budget)
            if self.kv.allocate_slots(req, n, hit) is None:
                break
            self.waiting.popleft()
            self._waiting_left -= _left(req)
            self.stats.prefix_query_tokens += req.num_tokens
            self.stats.prefix_hit_tokens += hit.num_tokens
            req.num_computed_tokens = hit.num_tokens
            req.num_cached_tokens = hit.num_tokens
            req.cached_tokens_by_tier = hit.tokens_by_tier()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
        self.stats.num_scheduled_tokens += batch.total_tokens
        return batch

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)
        self._waiting_left += _left(req)

    def finish(self, req: Request, status: RequestStatus, free_blocks: bool = True) -> None:
        """Take a request out of the queues. ``free_blocks=False`` pins them (prefill hand-off)."""
        assert status.finished, status
        left = 0
        if req in self.running:
            self.running.remove(req)
            left = _left(req)
        elif req in self.waiting:
            self.waiting.remove(req)
            left = _left(req)
            self._waiting_left -= left
        self.prefill_tokens_left = max(0, self.prefill_tokens_left - left)
        req.status = status
        if free_blocks:
            self.kv.free(req.request_id)


def _left(req: Request) -> int:
    """Tokens ``req`` still has to run through the model before its next one is sampled, when
    that is more than one (a decoding request's one token is not prefill)."""
    n = req.num_tokens - req.num_computed_tokens
    return n if n > 1 else 0
