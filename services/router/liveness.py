"""Which workers answer, as the router's health reports it.

The registry says which workers were alive at their last heartbeat, and while Redis is down it
says nothing new: a router then keeps routing to the workers it last saw, and some of those may
be gone. So the router asks every worker it knows the standard gRPC health check once a second
(all at once, each with a short timeout); a worker "answers" if it said SERVING within
``fresh_s``. ``/health`` and the router's own gRPC health are built on that (:func:`report`),
not on the registry's entries: a router that can serve nothing says so (HTTP 503, NOT_SERVING),
naming why, and says when its view of the registry is stale.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc
from baton.services.router.workers import count_roles

log = logging.getLogger("baton.services.router")


class Liveness:
    """Probes the workers of ``pool`` every ``interval_s``; :meth:`answering` lists those that
    answered SERVING within ``fresh_s``. ``health``: a gRPC health servicer to keep NOT_SERVING
    while :func:`report` says degraded."""

    def __init__(self, pool, interval_s: float = 1.0, timeout_s: float = 1.0,
                 fresh_s: float = 3.0, health=None, services: tuple[str, ...] = ("",)) -> None:
        self.pool, self.interval_s, self.timeout_s, self.fresh_s = pool, interval_s, timeout_s, \
            fresh_s
        self.health, self.services = health, services
        self.answered_at: dict[str, float] = {}
        self.rounds = 0
        self._round_done = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-liveness", daemon=True)

    def start(self) -> Liveness:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.probe()
            except Exception:  # noqa: BLE001 - a probe round must never end the thread
                log.exception("worker liveness round failed")
            self._set_health()
            self._stop.wait(self.interval_s)

    def probe(self) -> None:
        """One round: every known worker's health check, at once."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        calls = []
        for w in self.pool.workers():
            stub = self.pool.stub(health_pb2_grpc.HealthStub, w.address)
            calls.append((w, stub.Check.future(health_pb2.HealthCheckRequest(service=""),
                                               timeout=self.timeout_s)))
        for w, call in calls:
            try:
                ok = call.result().status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                ok = False
            if ok:
                self.answered_at[w.worker_id] = time.monotonic()
        with self._round_done:
            self.rounds += 1
            self._round_done.notify_all()

    def wait_round(self, timeout: float = 10.0) -> None:
        """Until one more probe round has finished (tests)."""
        with self._round_done:
            n = self.rounds
            self._round_done.wait_for(lambda: self.rounds > n, timeout)

    def answers(self, worker) -> bool:
        """Whether ``worker`` answered SERVING within ``fresh_s``."""
        return time.monotonic() - self.answered_at.get(worker.worker_id, -1e9) <= self.fresh_s

    def answering(self) -> list:
        """The pool's workers that answered SERVING within ``fresh_s``."""
        return [w for w in self.pool.workers() if self.answers(w)]

    def _set_health(self) -> None:
        if self.health is None:
            return
        from grpc_health.v1 import health_pb2

        ok, _ = report(self.pool, self)
        status = (health_pb2.HealthCheckResponse.SERVING if ok
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in self.services:  # ignored once the server drains (graceful shutdown)
            self.health.set(name, status)


def report(pool, liveness: Liveness) -> tuple[bool, dict]:
    """(whether the router can serve, the body of ``/health``). Degraded when no worker that
    can decode (decode or both) answers, or when prefill workers are registered and none of
    them answers; the registry's staleness is said either way."""
    known = pool.workers()
    answering = count_roles([w for w in known if liveness.answers(w)])
    registered = count_roles(known)
    reasons = []
    if answering.get("decode", 0) + answering.get("both", 0) == 0:
        n = registered.get("decode", 0) + registered.get("both", 0)
        reasons.append(f"no decode worker answered in the last {liveness.fresh_s:g}s "
                       f"({n} known)")
    if registered.get("prefill", 0) and not answering.get("prefill", 0):
        reasons.append(f"no prefill worker answered in the last {liveness.fresh_s:g}s "
                       f"({registered['prefill']} known)")
    body = {"status": "degraded" if reasons else "ok", "workers": answering,
            "registered": registered, "registry": pool.registry_state()}
    if reasons:
        body["reasons"] = reasons
    down = body["registry"].get("unreachable_for_s")
    if down is not None:
        body["warnings"] = [f"worker registry (Redis) unreachable for {down:.0f}s: the workers "
                            "known are the ones last seen"]
    return not reasons, body
