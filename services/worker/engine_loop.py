"""The engine on its own thread; RPC threads reach it through ``call`` and per-request streams.

The engine is single-threaded by design (no locks in the hot path). Everything that touches it
(adding, aborting, reserving and committing hand-offs, integrity checks) is posted here as a call
and runs between two steps; outputs go to the queue of the request they belong to.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from baton.engine.engine import LLMEngine, RequestOutput
from baton.services.common.faults import NONE as NO_FAULTS
from baton.services.common.faults import Faults
from baton.services.worker.status import EngineDied

log = logging.getLogger("baton.services")


class EngineLoop:
    """``died`` is set when the engine thread stops on an error: the worker then deregisters,
    reports NOT_SERVING and exits non-zero (:func:`baton.services.common.process.serve_forever`).
    ``faults`` (tests only, :mod:`baton.services.common.faults`): the thread fails on purpose
    after ``crash_engine_after`` steps; every step takes at least ``step_delay`` (a slow
    machine, on any machine)."""

    def __init__(self, engine: LLMEngine, faults: Faults = NO_FAULTS, *,
                 tick_s: float = 0.05) -> None:
        # called between steps on the engine thread (a holder's lease sweep, a decode worker's
        # quarantine check); added with add_tick
        self._ticks: list[Callable[[], None]] = []
        self._tick_s = tick_s
        group = getattr(engine, "tp_group", None)
        if group is not None:  # a follower rank that exited takes the group down, idle or not
            self._ticks.append(group.check)
        self.on_outputs: Callable[[list], None] | None = None  # metrics, on the engine thread
        self.engine = engine
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, queue.SimpleQueue] = {}  # engine thread only
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        self.died = threading.Event()
        self._faults, self._steps = faults, 0
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        # threads waiting for KV blocks to be freed (a decode worker's hand-off reservation)
        self._freed = threading.Condition()
        self.frees = 0  # times the pool's free block count rose, counted by the engine thread
        self._free_seen = 0
        self._wakes = 0

    def add_tick(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the engine thread after every step (and every idle wait of at most
        ``tick_s``). Call before :meth:`start`."""
        self._ticks.append(fn)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stopped.set()
        self._calls.put(None)
        self._thread.join(timeout)

    # ---- used from other threads -----------------------------------------------------------------

    def call(self, fn: Callable, *args, **kwargs) -> Future:
        """Run ``fn(*args, **kwargs)`` on the engine thread between steps; a dead engine fails
        the future with :class:`EngineDied`, whenever it died."""
        fut: Future = Future()
        if self._error is not None:
            fut.set_exception(EngineDied(f"engine stopped: {self._error!r}"))
            return fut
        self._calls.put((fut, fn, args, kwargs))
        # the engine may have died between the check and the put, after its thread failed what
        # the queue held: fail what is left ourselves (each item is taken from the queue once,
        # by one thread, so nothing is failed twice)
        if self._error is not None:
            self._fail_pending(self._error)
        return fut

    def run(self, fn: Callable, *args, **kwargs):
        return self.call(fn, *args, **kwargs).result()

    def open_stream(self, request_id: str) -> queue.SimpleQueue:
        """Engine thread only (inside a ``call``): route ``request_id``'s outputs to a queue."""
        q: queue.SimpleQueue = queue.SimpleQueue()
        self._streams[request_id] = q
        return q

    def submit(self, request_id: str, **add_request_kwargs) -> queue.SimpleQueue:
        """Add a request (raises what ``add_request`` raises) and return its output queue. Its
        arrival is now, in the caller's thread: the engine adds it between steps, and the step
        running meanwhile is part of its queue time (``queue_s``), not of its prefill."""
        add_request_kwargs.setdefault("arrival_time", time.monotonic())

        def add() -> queue.SimpleQueue:
            q = self.open_stream(request_id)
            try:
                self.engine.add_request(request_id=request_id, **add_request_kwargs)
            except BaseException:
                del self._streams[request_id]
                raise
            return q
        return self.run(add)

    def abort(self, request_id: str) -> None:
        """Abort from any thread; the stream (if any) is closed with an aborted output."""
        self.call(self.engine.abort, request_id)

    def wait_for_frees(self, seen: int, timeout: float) -> int:
        """Block until KV blocks were freed after :attr:`frees` read ``seen`` (a request
        finished or was aborted, a hand-off was released), :meth:`wake` was called, the engine
        died, or ``timeout`` passed; returns :attr:`frees` then."""
        with self._freed:
            wakes = self._wakes
            self._freed.wait_for(lambda: self.frees != seen or self._wakes != wakes
                                 or self._error is not None, timeout)
            return self.frees

    def wake(self) -> None:
        """Wake every :meth:`wait_for_frees` (one of them has a reason to look again)."""
        with self._freed:
            self._wakes += 1
            self._freed.notify_all()

    # ---- the engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                busy = self.engine.has_unfinished()
                self._drain(block=not busy)
                if self.engine.has_unfinished():
                    self.dispatch(self.engine.step())
                    self._steps += 1
                    if self._faults.step_delay:
                        time.sleep(self._faults.step_delay)
                    if self._steps == self._faults.crash_engine_after:
                        raise RuntimeError("fault injection: crash_engine_after="
                                           f"{self._faults.crash_engine_after}")
                for tick in self._ticks:
                    tick()
                self._note_frees()
        except BaseException as e:  # a bug in the engine: fail every waiter loudly
            log.exception("engine thread died")
            self._error = e
            for q in self._streams.values():
                q.put(EngineDied(f"engine stopped: {e!r}"))
            self._fail_pending(e)
            self.wake()
            self.died.set()

    def _drain(self, block: bool) -> None:
        try:
            item = self._calls.get(timeout=self._tick_s) if block else self._calls.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fut, fn, args, kwargs = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as e:  # handed to the caller, who raises it
                    fut.set_exception(e)
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return

    def _note_frees(self) -> None:
        """Engine thread: after a step and the calls before it, wake the threads waiting for
        KV blocks if the pool has more free ones than last time."""
        free = self.engine.stats().free_blocks
        if free > self._free_seen:
            with self._freed:
                self.frees += 1
                self._freed.notify_all()
        self._free_seen = free

    def dispatch(self, outputs: list[RequestOutput]) -> None:
        """Engine thread only: hand outputs to their streams (and the metrics); a finished
        request's stream is dropped with its last output."""
        if self.on_outputs is not None:
            self.on_outputs(outputs)
        for out in outputs:
            q = self._streams.get(out.request_id)
            if q is None:
                continue
            q.put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail_pending(self, e: BaseException) -> None:
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[0].set_exception(EngineDied(f"engine stopped: {e!r}"))
