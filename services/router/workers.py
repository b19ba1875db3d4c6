"""The router's side of the worker API: the live workers and the calls made to them.

This is the one router module that speaks gRPC to the workers. Every call has a finite timeout
(the request's deadline); a failed call raises :class:`WorkerError` with the worker's status as a
:class:`Status`, its message and, for invalid input, the field the worker named, so the
orchestrator decides what to do (retry elsewhere, migrate, fail) from values, not from gRPC
types. KV handles pass through opaquely: the router hands one from a prefill call to a decode
call, or back to its holder with :meth:`WorkerPool.release`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc
from baton.control.registry import WorkerRecord, WorkerRegistry
from baton.services.common.protocol import FIELD_METADATA, PEER_METADATA
from baton.services.router.errors import Status
from baton.transfer import cluster_secret
from baton.transfer.lease_client import LeaseClient
from baton.v1 import worker_pb2, worker_pb2_grpc
from redis.exceptions import RedisError

log = logging.getLogger("baton.services.router")
# A worker's replies can be large: a Gemma 3 tokenizer (262,144 pieces and their merges) is
# 21 MB of JSON, past gRPC's default 4 MB
WORKER_REPLY_LIMIT = 256 << 20


class WorkerError(Exception):
    """A call to the worker at ``address`` failed with ``status``; ``detail`` is its message,
    ``field`` the input it rejected (INVALID_ARGUMENT), if it named one; ``culprit`` the worker
    the failure came from: ``address``, or the prefill worker a decode worker's hand-off
    failed on."""

    def __init__(self, address: str, status: Status, detail: str,
                 field: str | None = None, culprit: str | None = None) -> None:
        super().__init__(f"{address}: {status.name} {detail}")
        self.address, self.status, self.detail, self.field = address, status, detail, field
        self.culprit = culprit or address

    @classmethod
    def of(cls, address: str, e: grpc.RpcError) -> WorkerError:
        code = e.code()
        meta = dict(e.trailing_metadata() or ())
        return cls(address, Status.named(code.name if code else "UNKNOWN"),
                   e.details() or (code.name if code else ""), meta.get(FIELD_METADATA),
                   meta.get(PEER_METADATA))


class Prefill:
    """A Prefill call in flight: :meth:`result` waits for the worker's answer."""

    def __init__(self, address: str, future) -> None:
        self.address, self._future = address, future

    def cancel(self) -> None:
        self._future.cancel()

    def result(self) -> worker_pb2.PrefillResponse:
        """The worker's answer; raises WorkerError (CANCELLED once :meth:`cancel` was called)."""
        try:
            return self._future.result()
        except grpc.FutureCancelledError:
            raise WorkerError(self.address, Status.CANCELLED, "cancelled") from None
        except grpc.RpcError as e:
            raise WorkerError.of(self.address, e) from None


class Stream:
    """A decode worker's stream of chunks (Decode or Generate): iterate it; raises WorkerError
    when the call fails."""

    def __init__(self, address: str, call) -> None:
        self.address, self._call = address, call

    def cancel(self) -> None:
        self._call.cancel()

    def __iter__(self) -> Iterator[worker_pb2.DecodeChunk]:
        try:
            yield from self._call
        except grpc.RpcError as e:
            raise WorkerError.of(self.address, e) from None


def count_roles(workers) -> dict[str, int]:
    """How many of ``workers`` have each role."""
    counts: dict[str, int] = {}
    for w in workers:
        counts[w.role] = counts.get(w.role, 0) + 1
    return counts


def count_inflight(counts: dict[str, int], lock: threading.Lock, address: str):
    """The body of a ``busy(address)`` context manager: ``counts[address]`` is one higher while
    the ``with`` block runs (a generator for :func:`contextlib.contextmanager`)."""
    with lock:
        counts[address] = counts.get(address, 0) + 1
    try:
        yield
    finally:
        with lock:
            counts[address] -= 1


REFRESH_S = 1.0  # a router re-reads the registry (roles among it) at most this often


class WorkerPool:
    """Live workers from the registry (re-read at most every ``refresh_s``), one channel per
    address, and the router's own count of requests in flight on each (least-loaded first)."""

    def __init__(self, registry: WorkerRegistry, refresh_s: float = REFRESH_S) -> None:
        self.registry, self.refresh_s = registry, refresh_s
        self._workers: list[WorkerRecord] = []
        self._read_at = -math.inf  # never read
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[tuple, object] = {}
        self._inflight: dict[str, int] = {}
        self._registry_ok = True
        self._registry_down_since = 0.0
        # set by the router's main (its Liveness): keep workers the registry stopped listing
        # while they answer (see _kept)
        self.still_answering: Callable[[WorkerRecord], bool] | None = None
        self._unlisted: set[str] = set()
        self._lock = threading.Lock()
        # set once the router knows its model (pin_fingerprint): workers with another model
        # fingerprint (weights, dtype, block size, device kind) are left out, each named once
        self.fingerprint: str | None = None
        self._foreign: set[str] = set()
        self.leases = LeaseClient(channel=self.channel)  # gives abandoned handles back

    def pin_fingerprint(self, fingerprint: str) -> None:
        """Route only to workers with this model fingerprint. A CPU worker and a GPU worker of
        the same model have different ones (their KV differs), as do two dtypes: one router
        serves one kind, and the others are skipped with a warning naming them."""
        with self._lock:
            self.fingerprint, self._read_at = fingerprint, -math.inf

    def workers(self, role: str | None = None) -> list[WorkerRecord]:
        with self._lock:
            if time.monotonic() - self._read_at > self.refresh_s:
                self._reread()
            ws = self._workers
        return [w for w in ws if role is None or w.role == role or
                (w.role == "both" and role != "both")]

    def _reread(self) -> None:
        try:
            self._workers = self._kept(self._ours(self.registry.workers()))
        except (RedisError, OSError) as e:  # keep routing to the workers last seen
            if self._registry_ok:
                log.warning("worker registry unreadable (%s); using the %d workers "
                            "last seen", e, len(self._workers))
                self._registry_down_since = time.time()
            self._registry_ok = False
        else:
            if not self._registry_ok:
                log.info("worker registry readable again (after %.0fs)",
                         time.time() - self._registry_down_since)
            self._registry_ok = True
        self._read_at = time.monotonic()

    def _kept(self, listed: list[WorkerRecord]) -> list[WorkerRecord]:
        """``listed`` plus the workers known before that the registry no longer lists but that
        still answer (``still_answering``): a Redis that came back empty (or a worker whose
        heartbeat cannot reach it) must not make a router forget live workers. A draining
        worker answers NOT_SERVING, so it is not kept."""
        if self.still_answering is None:
            return listed
        ids = {w.worker_id for w in listed}
        kept = [w for w in self._workers if w.worker_id not in ids and self.still_answering(w)]
        for w in kept:
            if w.worker_id not in self._unlisted:
                self._unlisted.add(w.worker_id)
                log.warning("worker %s is not in the registry but answers: still routing to "
                            "it (Redis restarted empty, or its heartbeat cannot reach Redis)",
                            w.worker_id)
        self._unlisted &= {w.worker_id for w in kept}
        return listed + kept

    def registry_state(self) -> dict:
        """Whether the last registry read worked; if not, since when (seconds) it has not."""
        if self._registry_ok:
            return {"reachable": True}
        return {"reachable": False,
                "unreachable_for_s": round(time.time() - self._registry_down_since, 1)}

    def _ours(self, workers: list[WorkerRecord]) -> list[WorkerRecord]:
        if self.fingerprint is None:
            return workers
        for w in workers:
            if w.fingerprint != self.fingerprint and w.worker_id not in self._foreign:
                self._foreign.add(w.worker_id)
                log.warning("worker %s at %s has model fingerprint %s..., this router serves "
                            "%s... (another model, dtype, block size or device kind); not "
                            "routing to it", w.worker_id, w.address, w.fingerprint[:12],
                            self.fingerprint[:12])
        return [w for w in workers if w.fingerprint == self.fingerprint]

    def role_counts(self) -> dict[str, int]:
        return count_roles(self.workers())

    def inflight(self, address: str) -> int:
        """Requests this router has in flight on ``address``."""
        return self._inflight.get(address, 0)

    def channel(self, address: str) -> grpc.Channel:
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                # not SingleThreadedUnaryStream (streams read on the relaying thread, ~0.3 ms
                # less per request): gRPC never released such a call once it was cancelled,
                # ~18 KB of the router's memory per client that went away mid-stream
                # (bench/soak.py: +48% in 20,000 requests)
                ch = self._channels[address] = cluster_secret.channel(
                    address, [("grpc.max_receive_message_length", WORKER_REPLY_LIMIT)])
            return ch

    def stub(self, cls, address: str):
        """A ``cls`` stub on ``address``'s channel, made once (a stub builds a callable per
        method)."""
        key = (cls, address)
        stub = self._stubs.get(key)
        if stub is None:
            stub = self._stubs[key] = cls(self.channel(address))
        return stub

    @contextmanager
    def busy(self, address: str):
        """Count a call on ``address`` in flight (:meth:`inflight`) while the body runs."""
        yield from count_inflight(self._inflight, self._lock, address)

    def forget(self, if_older_than: float = 0.0) -> bool:
        """Re-read the registry on the next pick (a worker just failed, or none was found), if
        the last read is older than ``if_older_than`` seconds; whether it will be."""
        with self._lock:
            if time.monotonic() - self._read_at < if_older_than:
                return False
            self._read_at = -math.inf
            return True

    # ---- calls -----------------------------------------------------------------------------------

    def prefill(self, address: str, request: worker_pb2.PrefillRequest, timeout: float,
                metadata) -> Prefill:
        stub = self.stub(worker_pb2_grpc.PrefillWorkerStub, address)
        return Prefill(address, stub.Prefill.future(request, timeout=timeout, metadata=metadata))

    def decode(self, address: str, request: worker_pb2.DecodeRequest, timeout: float,
               metadata) -> Stream:
        """Decode a request another worker prefilled (its KV handle in ``request``)."""
        stub = self.stub(worker_pb2_grpc.DecodeWorkerStub, address)
        return Stream(address, stub.Decode(request, timeout=timeout, metadata=metadata))

    def generate(self, address: str, request: worker_pb2.LocalRequest, timeout: float,
                 metadata) -> Stream:
        """Prefill and decode on one worker (the local path)."""
        stub = self.stub(worker_pb2_grpc.DecodeWorkerStub, address)
        return Stream(address, stub.Generate(request, timeout=timeout, metadata=metadata))

    def release(self, handle) -> None:
        """Give a KV handle's lease back to its holder (frees its blocks now, not at the
        lease's expiry), over the holder's lease channel or gRPC. Best effort: the lease
        expires anyway."""
        self.leases.release_quietly(handle, timeout=2.0)

    def tokenizer(self, timeout: float) -> tuple[worker_pb2.TokenizerResponse, WorkerRecord]:
        """Ask a registered worker for its tokenizer; waits until one is registered and
        serving (raises SystemExit after ``timeout`` seconds)."""
        end = time.monotonic() + timeout
        while True:
            for w in self.workers():
                cls = (worker_pb2_grpc.PrefillWorkerStub if w.role == "prefill"
                       else worker_pb2_grpc.DecodeWorkerStub)
                try:
                    return self.stub(cls, w.address).Tokenizer(worker_pb2.InfoRequest(),
                                                               timeout=10), w
                except grpc.RpcError as e:
                    log.info("tokenizer from %s: %s", w.address, e.code())
            if time.monotonic() > end:
                raise SystemExit(f"no worker answered within {timeout}s; is the registry right?")
            self.forget()
            time.sleep(0.2)
