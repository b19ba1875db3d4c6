"""Starting processes from a process where gRPC runs (``baton up``, the benchmarks, the test
harness: each holds channels to its workers) never aborts the child.

A real fork there (``subprocess.Popen(preexec_fn=...)``) runs gRPC's fork handlers, which restart
its poller thread in the child; Popen then closes the inherited descriptors before exec, and the
child aborts with "Epoll1Poller ... epoll_wait error: Bad file descriptor" (exit -6; a decode
worker started pinned to cores by `baton bench compare` died so, its log holding only that
line). The launcher asks for its per-child settings (cores, die-with-parent) through the
environment instead, so Python starts children with vfork, which runs no fork handlers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent import futures

import grpc
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture
def grpc_running():
    """A gRPC server and a connected channel in this process, as in every launcher."""
    server = grpc.server(futures.ThreadPoolExecutor(2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=60)
    yield
    channel.close()
    server.stop(0)


def test_1000_starts_from_a_process_running_grpc_never_abort(grpc_running):
    """1000 children started by the launcher's spawn() with the settings that used a
    preexec_fn (cores, die with the parent): none aborts (`true` execs at once, so the window
    a fork leaves is what is measured; with a preexec_fn 13 and 40 of 300 aborted here). Then
    Python children apply the settings as a Baton process does first thing and run on the
    cores they were given."""
    from baton.services.launch.local import spawn

    cpu = sorted(os.sched_getaffinity(0))[0]
    true = shutil.which("true") or "/bin/true"
    codes: dict[int, int] = {}
    for _ in range(1000):
        p = spawn([true], dict(os.environ), stderr=subprocess.PIPE, cpus={cpu},
                  die_with_parent=True)
        _, err = p.communicate(timeout=120)
        codes[p.returncode] = codes.get(p.returncode, 0) + 1
        assert b"epoll_wait" not in err, err[-300:]
    assert codes == {0: 1000}
    child = ("from baton import adopt_launch_settings as a; a(); import os; "
             "print(sorted(os.sched_getaffinity(0)), os.environ.get('BATON_PIN_CPUS'))")
    for _ in range(10):
        p = spawn([sys.executable, "-c", child], dict(os.environ), stdout=subprocess.PIPE,
                  cpus={cpu}, die_with_parent=True)
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0 and out.decode().split() == [f"[{cpu}]", "None"]


def test_workers_started_and_stopped_many_times_never_abort(grpc_running, tiny_llama, tmp_path):
    """A decode worker pinned to a core and tied to its parent (the two settings that used a
    preexec_fn), started and drained 12 times from a process with gRPC running: every start
    serves, every stop exits 0, and no log holds gRPC's poller error."""
    from baton.services.launch.local import WorkerProcess

    cpu = sorted(os.sched_getaffinity(0))[0]
    for i in range(12):
        w = WorkerProcess("decode", ["--model", str(tiny_llama[0]), "--num-blocks", "16",
                                     "--threads", "1"], cpus={cpu}, die_with_parent=True,
                          log_dir=str(tmp_path))
        try:
            assert os.sched_getaffinity(w.pid) == {cpu}
            assert w.info().num_blocks == 16
        finally:
            w.stop()
        assert w.proc.returncode == 0, (i, w.log_tail())
        assert "epoll_wait error" not in w.log_path.read_text(errors="replace"), i


def test_a_sigterm_delivered_to_another_thread_still_drains_the_worker(tiny_llama, tmp_path):
    """SIGTERM sent to the process lands on a thread the kernel picks: the main thread only
    when no signal is pending on it. Sent here to one of the worker's other threads (tgkill),
    as it was once in CI (a worker ignored `stop()` for 10 s and was killed), it still drains:
    the main thread's timed wait reaches the Python handler."""
    import ctypes
    import signal

    from baton.services.launch.local import WorkerProcess

    w = WorkerProcess("decode", ["--model", str(tiny_llama[0]), "--num-blocks", "16",
                                 "--threads", "1"], log_dir=str(tmp_path))
    try:
        assert w.info().num_blocks == 16
        tid = next(int(t) for t in os.listdir(f"/proc/{w.pid}/task") if int(t) != w.pid)
        libc = ctypes.CDLL(None, use_errno=True)
        SYS_TGKILL = {"x86_64": 234, "aarch64": 131}[os.uname().machine]
        assert libc.syscall(SYS_TGKILL, w.pid, tid, signal.SIGTERM) == 0, ctypes.get_errno()
        assert w.proc.wait(60) == 0, w.log_tail()
        assert "drained; exiting" in w.log_tail()
    finally:
        w.stop()
