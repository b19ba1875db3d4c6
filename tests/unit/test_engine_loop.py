"""The engine thread's wake-ups: a thread waiting for KV blocks (a decode worker's hand-off
reservation on a full pool) is woken by the blocks being freed or by wake(), not by polling."""

from __future__ import annotations

import threading

from baton.engine.params import SamplingParams
from baton.services.common.engine_loop import EngineLoop

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
