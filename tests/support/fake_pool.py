"""A fake of the router's WorkerPool for driving the orchestrator without processes.

Each fake worker answers from a script, one entry per call it gets, in order:

* a prefill script entry is a :class:`worker_pb2.PrefillResponse`, a :class:`Status` (the call
  fails with it) or :data:`HANG`;
* a decode or generate script entry is a list of steps: :func:`chunk` (a DecodeChunk),
  a :class:`Status` (the stream fails with it), :data:`HANG` (nothing more comes: the call
  ends CANCELLED when it is cancelled, DEADLINE_EXCEEDED when its timeout passes, as gRPC ends
  it).

It records every call (``calls``: (address, kind, request)), every lease given back
(``released``), and keeps the in-flight counts the routing policy reads, as the real pool does.
The fake stands in for gRPC and the worker processes only; the orchestrator, the routing policy,
the admission limits, the decode queue and the stall watch under test are the real ones.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from baton.control.registry import WorkerRecord
from baton.services.router.errors import Status
from baton.services.router.workers import WorkerError, count_inflight
from baton.v1 import worker_pb2

HANG = "hang"


def chunk(token_ids, text="", finish_reason="", **fields) -> worker_pb2.DecodeChunk:
    return worker_pb2.DecodeChunk(token_ids=token_ids, text=text, finish_reason=finish_reason,
                                  **fields)


def prefilled(first_token_id: int, worker: WorkerRecord, lease: str = "lease",
              finish_reason: str = "") -> worker_pb2.PrefillResponse:
    return worker_pb2.PrefillResponse(
        first_token_id=first_token_id, finish_reason=finish_reason,
        handle=worker_pb2.KVHandle(worker_id=worker.worker_id, address=worker.address,
                                   lease_id=lease, incarnation=worker.incarnation))


class _Call:
    """A call in flight with its timeout: cancel() fails whatever waits in it CANCELLED."""

    def __init__(self, address: str, timeout: float) -> None:
        self.address, self.timeout = address, timeout
        self.cancelled = threading.Event()

    def _hang(self) -> WorkerError:
        if self.cancelled.wait(self.timeout):
            return self._fail(Status.CANCELLED, "cancelled")
        return self._fail(Status.DEADLINE_EXCEEDED, "Deadline Exceeded")

    def cancel(self) -> None:
        self.cancelled.set()

    def _fail(self, status: Status, detail: str = "scripted") -> WorkerError:
        return WorkerError(self.address, status, detail)


class FakePrefill(_Call):
    def __init__(self, address: str, answer, timeout: float) -> None:
        super().__init__(address, timeout)
        self._answer = answer

    def result(self) -> worker_pb2.PrefillResponse:
        if self.cancelled.is_set():
            raise self._fail(Status.CANCELLED, "cancelled")
        if self._answer == HANG:
            raise self._hang()
        if isinstance(self._answer, Status):
            raise self._fail(self._answer)
        return self._answer


class FakeStream(_Call):
    def __init__(self, address: str, steps: list, timeout: float) -> None:
        super().__init__(address, timeout)
        self._steps = steps
        self.reached_hang = threading.Event()

    def __iter__(self) -> Iterator[worker_pb2.DecodeChunk]:
        for step in self._steps:
            if self.cancelled.is_set():
                raise self._fail(Status.CANCELLED, "cancelled")
            if step == HANG:
                self.reached_hang.set()
                raise self._hang()
            if isinstance(step, Status):
                raise self._fail(step)
            yield step


class FakeWorkerPool:
    """``scripts``: worker id -> list of script entries (see the module's docs)."""

    def __init__(self, workers: list[WorkerRecord], scripts: dict[str, list]) -> None:
        self.records, self.scripts = list(workers), {k: list(v) for k, v in scripts.items()}
        self.calls: list[tuple[str, str, object]] = []
        self.streams: list[FakeStream] = []
        self.released: list[str] = []
        self.forgotten = 0
        self._inflight: dict[str, int] = {}
        self._by_address = {w.address: w for w in workers}
        self._lock = threading.Lock()

    # ---- what the routing policy and the orchestrator read -------------------------------------

    def workers(self, role: str | None = None) -> list[WorkerRecord]:
        return [w for w in self.records if role is None or w.role == role or
                (w.role == "both" and role != "both")]

    def inflight(self, address: str) -> int:
        return self._inflight.get(address, 0)

    def forget(self, if_older_than: float = 0.0) -> bool:
        self.forgotten += 1
        return True

    @contextmanager
    def busy(self, address: str):
        yield from count_inflight(self._inflight, self._lock, address)  # as the real pool

    # ---- calls ---------------------------------------------------------------------------------

    def _next(self, address: str, kind: str, request):
        worker = self._by_address[address]
        with self._lock:
            self.calls.append((address, kind, request))
            script = self.scripts[worker.worker_id]
            assert script, f"{worker.worker_id} got an unscripted {kind} call"
            return script.pop(0)

    def prefill(self, address: str, request, timeout: float, metadata) -> FakePrefill:
        return FakePrefill(address, self._next(address, "prefill", request), timeout)

    def decode(self, address: str, request, timeout: float, metadata) -> FakeStream:
        return self._stream(address, "decode", request, timeout)

    def generate(self, address: str, request, timeout: float, metadata) -> FakeStream:
        return self._stream(address, "generate", request, timeout)

    def _stream(self, address: str, kind: str, request, timeout: float) -> FakeStream:
        s = FakeStream(address, self._next(address, kind, request), timeout)
        self.streams.append(s)
        return s

    def release(self, handle) -> None:
        self.released.append(handle.lease_id)

    def kinds(self) -> list[tuple[str, str]]:
        """(worker id, call kind) of every call so far, in order."""
        return [(self._by_address[a].worker_id, k) for a, k, _ in self.calls]
