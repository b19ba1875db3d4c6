"""The router's stall watch counts a worker's silence, not the time the router itself was
stopped. A test cannot stop its own process, so the watch runs on a clock of the test's:
each of its sleeps lasts what the test says, one of them 40 s past its due (the machine paused,
as this VM did for ~31 s in docs/routing.md's run 36)."""

from __future__ import annotations

import queue
import threading

from baton.services.router import limits

from tests.support.calls import Call


class Clock:
    """``monotonic`` and ``sleep`` for the watchdog: ``sleep`` says the last look is done
    (``looked``), then waits for the test to say how long it lasted."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.ticks: queue.Queue[float] = queue.Queue()
        self.looked = threading.Semaphore(0)

    def monotonic(self) -> float:
        return self.now

    def sleep(self, _s: float) -> None:
        self.looked.release()
        self.now += self.ticks.get()

    def tick(self, s: float) -> None:
        """One sleep of ``s`` seconds, and the look after it done."""
        self.ticks.put(s)
        assert self.looked.acquire(timeout=60), "the watchdog did not look"


def test_a_pause_of_the_router_is_not_a_workers_silence():
    clock = Clock()
    watch = limits.StallWatch(30.0, clock=clock)  # looks every 1 s
    paused, hung = Call(), Call()
    w = watch.watch(paused)
    assert clock.looked.acquire(timeout=60)  # the watchdog's first sleep
    clock.tick(1.0)
    clock.tick(41.0)  # the machine stopped for 40 s: the stream is not stalled
    assert not w.stalled and not paused.cancelled.is_set()
    h = watch.watch(hung)  # a stream watched after the pause, silent from here
    for _ in range(28):
        clock.tick(1.0)
    assert not w.stalled  # 30 s of silence counted (1 + 1 + 28), not over 30
    clock.tick(1.0)
    # the silence around the pause, 31 s, is the worker's: cancelled now
    assert w.stalled and paused.cancelled.is_set()
    # one watched after the pause counts from its start: 29 s so far, then 31
    assert not h.stalled
    clock.tick(2.0)
    assert h.stalled and hung.cancelled.is_set()


def test_without_a_pause_silence_past_the_timeout_is_a_stall():
    clock = Clock()
    watch = limits.StallWatch(30.0, clock=clock)
    call = Call()
    w = watch.watch(call)
    assert clock.looked.acquire(timeout=60)
    for _ in range(30):
        clock.tick(1.0)
    assert not w.stalled  # 30 s: not over the timeout
    clock.tick(1.9)  # late, but by under a second: counted
    assert w.stalled and call.cancelled.is_set()
