"""Admission at the router: API keys, bounded concurrency, a bounded wait queue, per-key caps.

A request takes a slot for its whole life (routing, prefill, transfer, decode, streaming)::

    arrives ──► its key over --max-concurrent-per-key? ──yes──► RESOURCE_EXHAUSTED (HTTP 429)
                  │ no
                  ▼
              a slot free (< --max-concurrent)? ──yes──► runs; the slot is freed when it ends
                  │ no
                  ▼
              queue full (--max-queued waiting)? ──yes──► RESOURCE_EXHAUSTED (HTTP 429)
                  │ no
                  ▼
              waits (first come, first served) for a slot ──► runs; or its deadline passes
              (DEADLINE_EXCEEDED) or its client goes away (CANCELLED) while waiting

Then the decode pool: a decode worker runs at most its ``--max-num-seqs`` requests, so when every
decode worker has that many in flight (counted by every router, through the Redis index) a
request waits at the router, first come first served, for one to end (:class:`DecodeQueue`),
instead of being sent to a worker that cannot take it; past ``--max-queued`` waiting it is
refused at once (RESOURCE_EXHAUSTED, HTTP 429), as the admission queue refuses.

Nothing queues without bound: past these limits a request is refused at once, with the limit
named, instead of piling up in the router's or a worker's queue. Imports no torch.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from baton.engine.errors import BatonError


class LimitExceededError(BatonError):
    """A limit refused the request for now (RESOURCE_EXHAUSTED; HTTP 429). ``limit`` names the
    setting, ``value`` its configured size."""

    def __init__(self, limit: str, value: int, reason: str) -> None:
        self.limit, self.value, self.reason = limit, value, reason
        super().__init__(f"{limit}={value}: {reason}")


class WaitEndedError(BatonError):
    """The request's deadline passed, or its client went away, while it waited for a slot."""

    def __init__(self, reason: str, waited_s: float,
                 what: str = "a slot (--max-concurrent)") -> None:
        self.reason, self.waited_s = reason, waited_s
        super().__init__(f"{reason} after waiting {waited_s:.2f}s for {what}")


class PoolFullError(BatonError):
    """Every candidate decode worker has its running batch full (routing raises it)."""


@dataclass(frozen=True)
class Limits:
    """0 means no limit. ``max_queued`` requests may wait for one of ``max_concurrent`` slots."""

    max_concurrent: int = 0
    max_queued: int = 0
    max_concurrent_per_key: int = 0

    def __post_init__(self) -> None:
        for name in ("max_concurrent", "max_queued", "max_concurrent_per_key"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")


class WaitLine:
    """Waiters in arrival order, each asleep on its own event; only the head's is set when
    something frees (:meth:`wake_head`), and the next one's when the head leaves, so a slot's
    end wakes one thread, not the whole line. Not locked itself: its owner holds its own lock
    around every call but ``len()`` (a read that may be stale and is checked again under
    the lock). The others nap ``idle_check_s`` at a time only to see whether their client
    went away; their deadline ends a nap exactly.

    Shared by :class:`Admission` and :class:`DecodeQueue`. Each used to wake every waiter
    every 50 ms and at every request's end to find it was not first: shifting-load run 14
    (2-vCPU VM, a decode-heavy backlog of up to ~450 requests) gave the router 150 s of CPU
    against 98 s for the same layout with a shorter line, CPU the two workers on those cores
    did not get."""

    __slots__ = ("_turns",)

    def __init__(self) -> None:
        self._turns: deque[threading.Event] = deque()

    def __len__(self) -> int:
        return len(self._turns)

    def join(self) -> threading.Event:
        """A new waiter at the back; its event is set when it is (or may be) first."""
        turn = threading.Event()
        self._turns.append(turn)
        return turn

    def is_head(self, turn: threading.Event) -> bool:
        return self._turns[0] is turn

    def nap_s(self, turn: threading.Event, recheck_s: float, idle_check_s: float) -> float:
        """How long ``turn`` sleeps before it looks again: the head ``recheck_s`` (for what
        frees unannounced), the others ``idle_check_s``."""
        return recheck_s if self._turns[0] is turn else idle_check_s

    def wake_head(self) -> None:
        if self._turns:
            self._turns[0].set()

    def leave(self, turn: threading.Event) -> None:
        """``turn`` leaves (served, refused, its deadline or client gone); if it was first,
        the next in line looks at once."""
        was_head = self._turns[0] is turn
        self._turns.remove(turn)
        if was_head:
            self.wake_head()


class Admission:
    """Slots and the queue of waiters; thread-safe. ``stats()`` for metrics and tests.

    Waiters stand in a :class:`WaitLine`: a slot's end wakes only the head, which also looks
    again every ``recheck_s``; the others wake every ``idle_check_s`` for a client gone."""

    recheck_s = 0.05
    idle_check_s = 0.5

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._running = 0
        self._waiting = WaitLine()  # first come first served
        self._per_key: dict[str, int] = {}
        self.refused = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"running": self._running, "waiting": len(self._waiting),
                    "refused": self.refused, "keys": len(self._per_key)}

    @contextmanager
    def slot(self, key: str, time_remaining: Callable[[], float | None],
             is_active: Callable[[], bool]):
        """Hold a slot for the ``with`` body; raises LimitExceededError or WaitEndedError
        instead of entering it. ``time_remaining()`` is the request's deadline (None: none),
        ``is_active()`` false once its client went away."""
        self._enter(key, time_remaining, is_active)
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                self._leave_key(key)
                self._waiting.wake_head()  # a slot for the head of the line

    def _enter(self, key, time_remaining, is_active) -> None:
        """Counts the key at once (its waiting requests count against its cap too), then a
        slot, waiting in line for one when they are all taken."""
        lim = self.limits
        t0 = time.monotonic()
        with self._lock:
            if lim.max_concurrent_per_key and \
                    self._per_key.get(key, 0) >= lim.max_concurrent_per_key:
                self.refused += 1
                raise LimitExceededError("max_concurrent_per_key", lim.max_concurrent_per_key,
                                         "this API key has that many requests in flight")
            if lim.max_concurrent and (self._running >= lim.max_concurrent or self._waiting) \
                    and len(self._waiting) >= lim.max_queued:
                self.refused += 1
                raise LimitExceededError(
                    "max_queued", lim.max_queued,
                    f"{self._running} requests run (max_concurrent={lim.max_concurrent}) and "
                    f"{len(self._waiting)} wait; try again later")
            self._per_key[key] = self._per_key.get(key, 0) + 1
            try:
                if lim.max_concurrent:
                    self._wait_in_line(t0, time_remaining, is_active)
            except BaseException:
                self._leave_key(key)
                raise
            self._running += 1

    def _wait_in_line(self, t0, time_remaining, is_active) -> None:
        """Under the lock (let go while asleep): until this request is first in line and a slot
        is free."""
        if self._running < self.limits.max_concurrent and not self._waiting:
            return
        turn = self._waiting.join()
        try:
            while self._running >= self.limits.max_concurrent or not self._waiting.is_head(turn):
                left = time_remaining()
                if left is not None and left <= 0:
                    raise WaitEndedError("the deadline passed", time.monotonic() - t0)
                if not is_active():
                    raise WaitEndedError("the client went away", time.monotonic() - t0)
                nap = self._waiting.nap_s(turn, self.recheck_s, self.idle_check_s)
                turn.clear()  # under the lock: a slot freed from here on sets it again
                self._lock.release()
                try:
                    turn.wait(nap if left is None else min(left, nap))
                finally:
                    self._lock.acquire()
        finally:
            self._waiting.leave(turn)

    def _leave_key(self, key: str) -> None:
        n = self._per_key[key] - 1
        if n:
            self._per_key[key] = n
        else:
            del self._per_key[key]


class DecodeQueue:
    """Requests waiting for a decode worker with a free slot, first come first served; at most
    ``max_queued`` of them. :meth:`wake` when a request ends on this router (a slot freed);
    others routers' ends are seen by looking again every ``recheck_s``.

    Only the head of the line (a :class:`WaitLine`) looks for a slot: :meth:`wake` sets its
    event; the others sleep until their turn, waking every ``idle_check_s`` for a client
    gone."""

    def __init__(self, max_queued: int, recheck_s: float = 0.05,
                 idle_check_s: float = 0.5) -> None:
        self.max_queued, self.recheck_s, self.idle_check_s = max_queued, recheck_s, idle_check_s
        self._lock = threading.Lock()
        self._line = WaitLine()
        self.refused = 0

    def waiting(self) -> int:
        return len(self._line)

    def wake(self) -> None:
        if self._line:  # no lock taken while nobody waits (every request ends through here)
            with self._lock:
                self._line.wake_head()

    def first(self, pick: Callable[[], object], time_remaining: Callable[[], float],
              is_active: Callable[[], bool]):
        """``pick()``'s answer, waiting in line while it raises PoolFullError; raises
        LimitExceededError when ``max_queued`` already wait, WaitEndedError when the deadline
        passes or the client goes away first."""
        if not self._line:
            try:
                return pick()
            except PoolFullError as e:
                full = e
        else:
            full = PoolFullError("requests already wait for a decode worker")
        t0 = time.monotonic()
        with self._lock:
            if len(self._line) >= self.max_queued:
                self.refused += 1
                raise LimitExceededError("max_queued", self.max_queued,
                                         f"{full}; {len(self._line)} requests already wait "
                                         "for a decode slot")
            turn = self._line.join()  # set: this waiter is (or may be) first, look again
        try:
            while True:
                with self._lock:
                    head = self._line.is_head(turn)
                left = time_remaining()
                if left <= 0:
                    raise WaitEndedError("the deadline passed", time.monotonic() - t0,
                                         "a decode slot (every decode worker's --max-num-seqs)")
                if not is_active():
                    raise WaitEndedError("the client went away", time.monotonic() - t0,
                                         "a decode slot (every decode worker's --max-num-seqs)")
                if not head:
                    turn.wait(min(self.idle_check_s, left))
                    continue
                turn.clear()  # before the look: a wake during it is not lost
                try:
                    return pick()
                except PoolFullError:  # until a request ends here, or to see other routers'
                    turn.wait(min(self.recheck_s, left))
        finally:
            with self._lock:
                self._line.leave(turn)


class ApiKeys:
    """The API keys the public endpoints accept (``--auth-token``, ``--api-keys-file``); empty:
    no key needed. Compared in constant time; only digests are kept."""

    def __init__(self, keys=()) -> None:
        import hashlib

        self._digest = lambda k: hashlib.sha256(k.encode()).digest()
        self._keys = [self._digest(k) for k in keys if k]

    @classmethod
    def load(cls, token: str | None, path: str | None) -> ApiKeys:
        """``token`` and one key per line of ``path`` (blank lines and ``#`` comments skipped)."""
        keys = [token] if token else []
        if path:
            with open(path) as f:
                keys += [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
        return cls(keys)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def allows(self, authorization: str | None) -> bool:
        """``authorization``: the header or metadata value, ``Bearer <key>``."""
        import hmac

        if not authorization or not authorization.startswith("Bearer "):
            return False
        d = self._digest(authorization[len("Bearer "):])
        return any([hmac.compare_digest(d, k) for k in self._keys])  # no early exit


class StallWatch:
    """Cancels worker streams that went quiet: a stream :meth:`watch`-ed and then silent (no
    :meth:`beat`) for ``timeout_s`` is cancelled from a watchdog thread and marked stalled, so
    the router can take its request elsewhere. A hung worker (SIGSTOP, a host gone without its
    TCP connection breaking) then costs ``timeout_s``, not the request's whole deadline.
    While the router waits on its own client (:meth:`Watched.hold`, until the next beat) the
    stream is not watched: a client slow to read holds back the router's reads of the worker,
    and that silence is not the worker's; nor is the time the router itself was stopped.
    ``timeout_s`` 0: off."""

    class Watched:
        __slots__ = ("call", "last", "stalled", "_now")

        def __init__(self, call, now=time.monotonic) -> None:
            self.call, self._now, self.stalled = call, now, False
            self.last = now()

        def beat(self) -> None:
            self.last = self._now()

        def hold(self) -> None:
            """The router is handing a chunk to its client: quiet from here is the client's
            (flow control), never the worker's, until the next :meth:`beat`."""
            self.last = math.inf

    def __init__(self, timeout_s: float, clock=time) -> None:
        """``clock``: what has ``monotonic()`` and ``sleep(s)`` (tests stop it)."""
        self.timeout_s, self._clock = timeout_s, clock
        self._watched: set[StallWatch.Watched] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, call) -> StallWatch.Watched:
        w = StallWatch.Watched(call, self._clock.monotonic)
        if self.timeout_s <= 0:
            return w
        with self._lock:
            self._watched.add(w)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stall-watch",
                                                 daemon=True)
                self._thread.start()
        return w

    def unwatch(self, w: StallWatch.Watched) -> None:
        with self._lock:
            self._watched.discard(w)

    def _run(self) -> None:
        every = min(1.0, self.timeout_s / 4)
        while True:
            before = self._clock.monotonic()
            self._clock.sleep(every)
            now = self._clock.monotonic()
            # woken over a second late: the router's own process (or its whole machine) was
            # stopped, and it could not have read what its workers sent meanwhile; that time
            # is not their silence (a VM paused for 31 s would have migrated every stream)
            late = now - before - every
            with self._lock:
                if late > 1.0:
                    for w in self._watched:
                        w.last += late
                quiet = [w for w in self._watched if now - w.last > self.timeout_s]
                for w in quiet:
                    self._watched.discard(w)
                    w.stalled = True
            for w in quiet:
                w.call.cancel()
