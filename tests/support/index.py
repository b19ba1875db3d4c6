"""The prefix index's test helpers: a publisher fed by hand, worker records, and the worker pool
as the routing policy sees it (the real redis-server and a clean client per test are
tests/unit/conftest.py's ``server`` and ``client`` fixtures)."""

from __future__ import annotations

from collections import deque

from baton.control.prefix_index import IndexPublisher
from baton.control.registry import WorkerRecord
from baton.engine.block_hash import namespace_for

NS = namespace_for("fp")


def rec(worker_id, incarnation="i1"):
    return WorkerRecord(worker_id, "prefill", "127.0.0.1:1", "fp", incarnation)


def publisher(client, worker_id, incarnation="i1", ttl_s=5.0):
    events = deque()
    load = [0, 0, 90, 100]
    pub = IndexPublisher(client, worker_id, incarnation, events, lambda: load, ttl_s=ttl_s)
    return pub, events, load


class Pool:  # the router's WorkerPool as RoutingPolicy sees it: the registry's records
    def __init__(self, records, inflight=None):
        self.records, self._inflight = records, inflight or {}

    def workers(self, role=None):
        return [w for w in self.records if role is None or w.role in (role, "both")]

    def inflight(self, address):
        return self._inflight.get(address, 0)
