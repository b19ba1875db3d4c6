"""Which UCX transports a hand-off used is read from UCX's own protocol report."""

from __future__ import annotations


def test_transports_are_read_from_ucx_protocol_tables(tmp_path):
    from baton.transfer.agent import _TransportLog

    log = tmp_path / "ucx.log"
    row = "[1795383681.16] [vm:9006 :0]   "
    log.write_text("\n".join(row + line for line in [
        "| bench-reader intra-node cfg#1                                    |",
        "| remote memory write by ucp_put* from host memory to host |",
        "| 0..inf | zero-copy   | 52% on tcp/lo and 48% on tcp/eth0 |",
        "| remote memory read by ucp_get*(multi) into host memory from host |",
        "| Range  | Description |                  Config                   |",
        "| 0..inf | zero-copy   | cma/memory                                |",
        "| active message by ucp_am_send* from host memory |",
        "|   1..16515 | zero-copy          | tcp/lo        |",
    ]) + "\n")
    t = _TransportLog(log)
    assert t.poll() == ["cma/memory"]  # only READ tables count: that is all a hand-off does
    with open(log, "a") as f:  # later tables (a new peer) add to what was seen
        f.write(row + "| remote memory read by ucp_get* into host memory from host |\n")
        f.write(row + "| 0..8192 | software emulation | 60% on tcp/lo and 40% on tcp/eth0 |\n")
    assert t.poll() == ["cma/memory", "tcp/eth0", "tcp/lo"]
    assert _TransportLog(None).poll() == []


def test_the_holders_progress_thread_backs_off_when_idle_and_wakes_for_a_read():
    """The agent's progress thread (a real NIXL agent over a real registered pool) polls at the
    fast interval after ``wake()`` and backs off to the idle one, so an idle or decoding worker
    is not interrupted 500 times a second."""
    import threading
    import time

    import torch
    from baton.transfer.agent import KVAgent

    agent = KVAgent("backoff-test", torch.zeros(4, 1024, dtype=torch.uint8),
                    progress_interval_s=0.002, idle_interval_s=0.064)
    calls: list[float] = []
    lock = threading.Lock()
    seen = threading.Condition(lock)
    poll = agent.agent.get_new_notifs

    def counted(*args, **kwargs):
        with seen:
            calls.append(time.monotonic())
            seen.notify_all()
        return poll(*args, **kwargs)

    def polls_after(n: int, since: float) -> list[float]:
        """The first ``n`` polls after ``since``, waited for (the bound is a hang detector)."""
        with seen:
            assert seen.wait_for(lambda: sum(t > since for t in calls) >= n, 60), calls
            return [t for t in calls if t > since][:n]

    agent.agent.get_new_notifs = counted
    try:
        # backed off: 2+4+...+64 ms after the start, then every 64 ms. A loaded machine only
        # stretches the gaps; a thread that did not back off would poll every 2 ms
        start = polls_after(1, 0.0)[0]
        idle = polls_after(12, start)[-6:]
        gaps = [b - a for a, b in zip(idle, idle[1:])]
        assert min(gaps) >= 0.06, gaps  # ~64 ms each (500 Hz would be 2 ms)
        woke = time.monotonic()
        agent.wake()
        woken = polls_after(3, woke)
        # 2, 4, 8 ms after the wake, not the 64 ms idle period each
        assert woken[-1] - woke < 3 * 0.064, [t - woke for t in woken]
    finally:
        agent.close()
