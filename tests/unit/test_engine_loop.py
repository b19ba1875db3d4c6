"""The engine thread's wake-ups: a thread waiting for KV blocks (a decode worker's hand-off
reservation on a full pool) is woken by the blocks being freed or by wake(), not by polling."""

from __future__ import annotations

import threading
import time

from baton.engine.params import SamplingParams
from baton.services.common.faults import Faults
from baton.services.worker.engine_loop import EngineLoop
from baton.services.worker.status import EngineDied

PROMPT = list(range(5, 30))  # 25 tokens: 7 blocks of 4


def waiter(loop: EngineLoop, seen: int):
    done, got = threading.Event(), []

    def wait() -> None:
        got.append(loop.wait_for_frees(seen, 120))
        done.set()

    threading.Thread(target=wait, daemon=True).start()
    return done, got


def test_a_reservation_waiting_for_blocks_wakes_when_they_are_freed(tiny_engine):
    engine = tiny_engine(num_kv_blocks=8)
    loop = EngineLoop(engine).start()
    try:
        params = SamplingParams(max_tokens=4)
        assert loop.run(engine.reserve_handoff, "x", PROMPT, 7, params) is not None
        seen = loop.frees
        assert loop.run(engine.reserve_handoff, "y", PROMPT, 7, params) is None  # full
        done, got = waiter(loop, seen)
        loop.abort("x")  # frees x's 7 blocks
        assert done.wait(120) and got[0] > seen  # woken by the free, not the 120 s timeout
        assert loop.run(engine.reserve_handoff, "y", PROMPT, 7, params) is not None
    finally:
        loop.stop()


def test_wake_ends_every_wait_without_a_free(tiny_engine):
    loop = EngineLoop(tiny_engine(num_kv_blocks=8)).start()
    try:
        done, got = waiter(loop, loop.frees)
        while not done.is_set():  # until the waiter is inside its wait and sees the wake
            loop.wake()
            done.wait(0.05)
        assert got == [loop.frees]
    finally:
        loop.stop()


class _PutAfterDeath:
    """The loop's call queue, with a barrier between ``call``'s dead-engine check and its put:
    the put waits until the engine thread has died (and failed what the queue held)."""

    def __init__(self, loop: EngineLoop) -> None:
        self.loop, self.inner = loop, loop._calls

    def put(self, item) -> None:
        if item is not None and threading.current_thread().name == "late-caller":
            assert self.loop.died.wait(120), "the engine thread never died"
        self.inner.put(item)

    def get(self, *a, **kw):
        return self.inner.get(*a, **kw)

    def get_nowait(self):
        return self.inner.get_nowait()


def test_a_call_posted_while_the_engine_dies_fails_instead_of_hanging(tiny_engine):
    """Bug: call() checked for a dead engine, then enqueued; an item put after the dying thread
    drained the queue was never completed and its caller (an RPC thread) hung."""
    engine = tiny_engine(num_kv_blocks=8)
    loop = EngineLoop(engine, Faults(crash_engine_after=1))
    loop._calls = _PutAfterDeath(loop)
    loop.start()
    got: list = []

    def late_call() -> None:
        fut = loop.call(engine.stats)  # passes the check: the engine is alive yet
        got.append(fut.exception(timeout=120))  # hang detector only

    caller = threading.Thread(target=late_call, name="late-caller", daemon=True)
    caller.start()
    loop.submit("x", prompt_token_ids=PROMPT, params=SamplingParams(max_tokens=4))  # 1 step
    caller.join(180)
    assert loop.died.is_set()
    assert len(got) == 1 and isinstance(got[0], EngineDied), got
    assert "fault injection" in str(got[0])


def test_a_commit_whose_first_token_finishes_the_request_drops_its_stream(tiny_engine):
    """Bug: a hand-off committed with max_tokens=1 finished at once, and its stream entry
    stayed in the loop forever (one leaked queue per such request)."""
    from baton.services.worker.decode_role import DecodeService

    engine = tiny_engine(num_kv_blocks=16)
    loop = EngineLoop(engine).start()
    try:
        service = DecodeService(loop, reader=None, worker_id="w", incarnation="i",
                                transfer_timeout_s=5.0)
        for rid, max_tokens in (("one", 1), ("more", 3)):
            slots = loop.run(engine.reserve_handoff, rid, PROMPT, 7,
                             SamplingParams(max_tokens=max_tokens))
            assert slots is not None
            # asked on the engine thread with the commit: a later look races its next steps
            stream, kept = loop.run(lambda rid=rid: (service._commit(rid), rid in loop._streams))
            first = stream.get(timeout=120)
            assert first.new_token_ids == [7]
            assert first.finished == (max_tokens == 1)
            # finished with its first output: dropped; still decoding: kept until it finishes
            assert kept == (max_tokens > 1), rid
        while not stream.get(timeout=120).finished:
            pass
        assert loop.run(lambda: dict(loop._streams)) == {}
        loop.run(engine.check_integrity)
    finally:
        loop.stop()


def test_queue_time_counts_the_step_running_when_a_request_arrived(tiny_engine):
    """Bug: the engine stamped a request's arrival when its thread added it, between steps, so
    the step running when it came was in neither ``queue_s`` nor anywhere the worker reported:
    the router counted it as prefill compute (a prefill worker's "prefill" phase 28% above the
    simulator's first-token compute on a busy worker). The engine thread is held here, as a long
    step would hold it, while a request arrives."""
    engine = tiny_engine(num_kv_blocks=16)
    loop = EngineLoop(engine).start()
    held, release = threading.Event(), threading.Event()
    loop.call(lambda: (held.set(), release.wait(120)))
    got: list = []
    try:
        assert held.wait(120)
        sender = threading.Thread(target=lambda: got.append(loop.submit(
            "late", prompt_token_ids=PROMPT, params=SamplingParams(max_tokens=1))))
        sender.start()
        while loop._calls.qsize() == 0:  # its arrival is stamped before the call is queued
            sender.join(0.01)
        hold = 0.2
        threading.Event().wait(hold)  # the engine thread stays busy this long after it came
        release.set()
        sender.join(120)
        out = got[0].get(timeout=120)
        assert out.finished and out.queue_s >= hold
        assert out.first_token_s >= out.queue_s
    finally:
        release.set()
        loop.stop()


def test_an_engine_caller_can_give_the_arrival_time(tiny_engine):
    engine = tiny_engine(num_kv_blocks=16)
    came = time.monotonic() - 5.0
    req = engine.add_request(prompt_token_ids=PROMPT, params=SamplingParams(max_tokens=1),
                             request_id="r", arrival_time=came)
    assert req.arrival_time == came
    outs = [o for o in engine.step() if o.request_id == "r"]
    assert outs and outs[0].queue_s >= 5.0
