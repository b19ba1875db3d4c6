"""A process that waits for a drain signal survives a burst of them: with the handler setting
the event itself, the main thread deadlocked inside ``Event.wait`` (5 hangs in 5 such bursts;
a router hung that way when ``baton up`` stopped it)."""

from __future__ import annotations

import signal
import subprocess
import sys

# Once it sees the stop file it ignores the two signals: the burst's last ones, or the test's
# final wake, can still arrive while it exits, and past the interpreter's finalization (which
# puts back the default handlers) a SIGTERM would kill it (exit -15: once, in the fast lane
# on two pytest workers, 2026-12-02).
CHILD = """
import os, signal, sys, threading
from baton import set_on_signals

ev = threading.Event()
set_on_signals(ev)
print("ready", flush=True)
while True:  # waits on the event again and again, as a draining process does
    if ev.wait(0.0005):
        ev.clear()
        if os.path.exists(sys.argv[1]):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            break
"""


def test_a_burst_of_drain_signals_never_deadlocks_the_wait(tmp_path):
    stop = tmp_path / "stop"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(stop)], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        for i in range(3000):
            child.send_signal(signal.SIGINT if i % 2 else signal.SIGTERM)
        stop.touch()
        child.send_signal(signal.SIGTERM)
        assert child.wait(120) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
