"""A gRPC call as the router's cancellation and stall watch see one: ``cancel()`` and nothing
else, with what a test asserts on (whether it was cancelled)."""

from __future__ import annotations

import threading


class Call:
    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()
