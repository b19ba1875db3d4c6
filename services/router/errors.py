"""How a request fails, in the router's own terms: a :class:`Status` and a :class:`RequestError`
that carries the field, value and reason that caused it.

The orchestrator raises these and nothing else; each front maps them once: the gRPC API to the
status code of the same name, the OpenAI front to an HTTP status and an OpenAI error body whose
``param`` is ``field``. Nothing parses a message to find out what went wrong.
"""

from __future__ import annotations

import enum


class Status(enum.Enum):
    """Why a request ended unsuccessfully. The names are gRPC's, so the gRPC front maps them by
    name and a worker's gRPC status maps back the same way."""

    CANCELLED = "cancelled"
    INVALID_ARGUMENT = "invalid_argument"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    NOT_FOUND = "not_found"
    PERMISSION_DENIED = "permission_denied"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    FAILED_PRECONDITION = "failed_precondition"
    ABORTED = "aborted"
    OUT_OF_RANGE = "out_of_range"
    UNIMPLEMENTED = "unimplemented"
    INTERNAL = "internal"
    UNAVAILABLE = "unavailable"
    DATA_LOSS = "data_loss"
    UNAUTHENTICATED = "unauthenticated"
    UNKNOWN = "unknown"

    @classmethod
    def named(cls, name: str) -> Status:
        """The status called ``name`` (a gRPC status code's name); UNKNOWN for any other."""
        return cls.__members__.get(name, cls.UNKNOWN)


class RequestError(Exception):
    """A request ended with ``status``. ``message`` is what the client reads; ``field`` (with
    ``value``) names the input that caused it, when one did."""

    def __init__(self, status: Status, message: str, field: str | None = None,
                 value: object = None) -> None:
        super().__init__(message)
        self.status, self.message, self.field, self.value = status, message, field, value

    def __repr__(self) -> str:
        return f"RequestError({self.status.name}, {self.message!r}, field={self.field!r})"

    @classmethod
    def invalid(cls, e: Exception) -> RequestError:
        """INVALID_ARGUMENT for an ``InvalidRequestError``-like ``e`` (``field``, ``value``)."""
        return cls(Status.INVALID_ARGUMENT, f"{type(e).__name__}: {e}",
                   getattr(e, "field", None), getattr(e, "value", None))
