"""Baton: disaggregated prefill/decode LLM serving.

Subpackages map to the repository's top-level folders: ``baton.engine`` (model, paged KV cache,
scheduler), ``baton.kernels`` (attention implementations), ``baton.cli`` (the ``baton`` command),
and the service, transfer and control layers built around the engine.
"""

import os
import signal
import threading
import time
from pathlib import Path

__version__ = "0.1.0"


def cache_dir() -> Path:
    """Where Baton keeps converted weights, `baton profile`'s file and `baton up`'s address:
    ``$BATON_CACHE_DIR``, else ``~/.cache/baton``."""
    return Path(os.environ.get("BATON_CACHE_DIR") or Path.home() / ".cache" / "baton")


# what a launcher asks of the process it starts, in its environment (see adopt_launch_settings)
PIN_CPUS_ENV, PARENT_ENV = "BATON_PIN_CPUS", "BATON_DIE_WITH_PARENT"
# PARENT_ENV's value from a passing thread ("PID:watch"), and how often such a process looks
# for its parent (see launch_env)
_WATCH, PARENT_POLL_S = ":watch", 1.0
# the folder of the process's own logs: its UCX protocol log goes there too (transfer/agent.py)
LOG_DIR_ENV = "BATON_LOG_DIR"


def launch_env(env, *, die_with_parent: bool = False, cpus=None) -> dict[str, str]:
    """``env`` with what a launcher asks of the process it starts (see adopt_launch_settings):
    run on ``cpus``; with ``die_with_parent``, SIGTERM when this process dies, a SIGKILL too.

    Linux's own signal for that (PDEATHSIG) comes when the starting *thread* ends, so it is
    asked only on the main thread: a process started on a passing thread (the autoscaler's
    starts) would be stopped when that thread ends. Such a process is asked to watch instead
    (``PID:watch``): a Baton process polls its parent every second and drains when it is gone;
    a process that is not Baton's (redis-server) ignores the variable."""
    env = dict(env)
    if die_with_parent:
        on_main = threading.current_thread() is threading.main_thread()
        env[PARENT_ENV] = str(os.getpid()) + ("" if on_main else _WATCH)
    if cpus:
        env[PIN_CPUS_ENV] = ",".join(map(str, sorted(cpus)))
    return env


def adopt_launch_settings() -> None:
    """Apply what the launcher asked for in the environment, first thing in a Baton process
    (before torch starts its threads): ``$BATON_PIN_CPUS`` (``0,1``): run on those cores;
    ``$BATON_DIE_WITH_PARENT`` (the launcher's pid, ``PID:watch`` from a passing thread): get
    SIGTERM (a drain) when it dies.

    The launcher cannot do these itself between fork and exec (``preexec_fn``): a real fork of
    a process with gRPC running runs gRPC's fork handlers, which restart its poller thread in
    the child, and closing the inherited descriptors before exec then aborts the child
    ("Epoll1Poller ... epoll_wait error: Bad file descriptor", about 1 start in 25 here). Without
    ``preexec_fn`` Python starts children with vfork, which runs no fork handlers."""
    cpus = os.environ.pop(PIN_CPUS_ENV, "")
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    parent = os.environ.pop(PARENT_ENV, "")
    if parent.endswith(_WATCH):
        _watch_parent(int(parent[:-len(_WATCH)]))
    elif parent:
        import contextlib
        import ctypes

        with contextlib.suppress(OSError, AttributeError):  # Linux only
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PDEATHSIG
        if os.getppid() != int(parent):  # it died before the line above: nothing would tell
            os.kill(os.getpid(), signal.SIGTERM)


def _watch_parent(parent: int) -> None:
    """SIGTERM this process once its parent process ``parent`` is gone (this process is then
    reparented, and ``getppid()`` changes), checked every ``PARENT_POLL_S`` seconds on a daemon
    thread. Unlike PDEATHSIG this follows the parent process, not the thread that started it."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def set_on_signals(event: threading.Event,
                   signals: tuple = (signal.SIGTERM, signal.SIGINT)) -> None:
    """Set ``event`` when one of ``signals`` arrives (a drain, Ctrl-C).

    The handler only writes a byte to a pipe; a watcher thread reads it and sets the event.
    A handler runs on the main thread between two bytecodes, possibly while that thread holds
    the event's lock inside ``event.wait()``, and setting the event there deadlocks (a router
    that got SIGINT and SIGTERM together under ``baton up`` hung that way). And a handler that
    does real work (starting a thread) is itself interrupted by the next signal of a burst,
    and re-entered, until the stack overflows (RecursionError); one ``os.write`` is over
    before the next signal can nest."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)

    def watch() -> None:
        while os.read(read_fd, 4096):
            event.set()

    def handler(*_) -> None:
        try:  # noqa: SIM105 (contextlib.suppress: two more frames for the next signal to nest in)
            os.write(write_fd, b"\0")
        except OSError:  # the pipe is full: a wake-up is already waiting to be read
            pass

    threading.Thread(target=watch, name="signal", daemon=True).start()
    for sig in signals:
        signal.signal(sig, handler)
