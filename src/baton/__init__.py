"""Baton: disaggregated prefill/decode LLM serving.

Subpackages map to the repository's top-level folders: ``baton.engine`` (model, paged KV cache,
scheduler), ``baton.kernels`` (attention implementations), ``baton.cli`` (the ``baton`` command),
and the service, transfer and control layers built around the engine.
"""

import os
import signal
import threading
from pathlib import Path

__version__ = "0.1.0"


def cache_dir() -> Path:
    """Where Baton keeps converted weights, `baton profile`'s file and `baton up`'s address:
    ``$BATON_CACHE_DIR``, else ``~/.cache/baton``."""
    return Path(os.environ.get("BATON_CACHE_DIR") or Path.home() / ".cache" / "baton")


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
