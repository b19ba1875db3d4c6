"""A Baton process started to die with its launcher goes when the launcher is SIGKILLed, also
when a passing thread started it (the workers `baton up --autoscale` adds): Linux's PDEATHSIG
follows the starting thread, so those watch their parent process instead. Before, they ran on,
idle, after `kill -9` of `baton up`."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

from tests.support.processes import alive

# the started process: a Baton process's first step, then it answers one line on stdin
CHILD = ("import os, sys, time; from baton import adopt_launch_settings; adopt_launch_settings(); "
         "print('ready', os.getpid(), flush=True); sys.stdin.readline(); "
         "print('pong', flush=True); time.sleep(600)")
# the launcher: starts it on a thread that then ends, says so, and lives on
LAUNCHER = ("import os, subprocess, sys, threading, time; "
            "from baton.services.launch.local import spawn; "
            f"t = threading.Thread(target=spawn, args=([sys.executable, '-c', {CHILD!r}], "
            "os.environ), kwargs={'die_with_parent': True}); t.start(); t.join(); "
            "print('thread ended', flush=True); time.sleep(600)")


def test_a_process_a_passing_thread_started_outlives_the_thread_and_dies_with_the_launcher():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)  # the child shares both
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(s) for s in launcher.stdout], daemon=True).start()
    child = None
    try:
        seen = {lines.get(timeout=120) for _ in range(2)}  # a failure's limit: both come at once
        child = int(next(s for s in seen if s.startswith("ready")).split()[1])
        assert "thread ended\n" in seen, seen
        # the starting thread has ended and the child still answers: no PDEATHSIG fired
        launcher.stdin.write("ping\n")
        launcher.stdin.flush()
        assert lines.get(timeout=120) == "pong\n"
        launcher.kill()
        launcher.wait(30)
        # it looks for its parent every second; 60 s is a failure's limit, not a margin
        for _ in range(600):
            if not alive(child):
                break
            time.sleep(0.1)
        left = alive(child)
    finally:
        launcher.kill()
        if child and alive(child):
            os.kill(child, signal.SIGKILL)
    assert not left, "a process a passing thread started outlived its SIGKILLed launcher"


def test_only_the_main_thread_asks_linux_the_others_ask_to_watch():
    from baton import PARENT_ENV, launch_env

    assert launch_env({}, die_with_parent=True)[PARENT_ENV] == str(os.getpid())
    got = {}
    t = threading.Thread(target=lambda: got.update(launch_env({}, die_with_parent=True)))
    t.start()
    t.join()
    assert got[PARENT_ENV] == f"{os.getpid()}:watch"
    assert PARENT_ENV not in launch_env({})
