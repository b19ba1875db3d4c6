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
    """Set ``event`` when one of ``signals`` arrives (a drain, Ctrl-C). The handler sets it from
    a new thread: a handler runs on the main thread between two bytecodes, possibly while that
    thread holds the event's lock inside ``event.wait()``, and setting it there deadlocks. A
    router that got SIGINT and SIGTERM together under ``baton up`` hung that way."""
    def handler(*_) -> None:
        threading.Thread(target=event.set, name="signal", daemon=True).start()

    for sig in signals:
        signal.signal(sig, handler)
