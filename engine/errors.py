"""Typed errors raised by the engine. Each carries the values that caused it."""

from __future__ import annotations


class BatonError(Exception):
    """Base class of every error Baton raises on purpose."""


class InvalidRequestError(BatonError, ValueError):
    """A request was rejected at submission. ``field`` names the offending input."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        self.field, self.value, self.reason = field, value, reason
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"invalid {field}={shown}: {reason}")


class RequestTooLargeError(InvalidRequestError):
    """The request could never fit in the KV-cache pool, however long it waited."""


class DuplicateRequestError(InvalidRequestError):
    """A request id is already in use in this engine."""


class ModelLoadError(BatonError):
    """A model could not be found or read."""


class UnsupportedModelError(ModelLoadError):
    """The model exists but uses an architecture, quantization or feature Baton does not run."""
