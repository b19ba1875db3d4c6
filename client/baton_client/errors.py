"""Typed errors of the Baton client, one per kind of failure (mapped from gRPC status codes)."""

from __future__ import annotations

import grpc


class BatonError(Exception):
    """Base class. ``code`` is the gRPC status code, ``details`` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class InvalidRequestError(BatonError, ValueError):
    """The request was refused as given (a bad parameter, an empty or too long prompt, an
    unknown model); the message names the field."""


class AuthenticationError(BatonError):
    """Missing or wrong token (UNAUTHENTICATED / PERMISSION_DENIED)."""


class UnavailableError(BatonError):
    """No worker (or no router) could take the request now."""


class DeadlineExceededError(BatonError, TimeoutError):
    """The deadline passed; the request was cancelled on the cluster."""


class ResourceExhaustedError(BatonError):
    """The cluster is out of KV blocks or another limit for now."""


class CancelledError(BatonError):
    """The call was cancelled (by this client)."""


class ServerError(BatonError):
    """A failure inside the cluster (INTERNAL, DATA_LOSS, ABORTED, UNKNOWN, ...)."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.FAILED_PRECONDITION: InvalidRequestError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: InvalidRequestError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.CANCELLED: CancelledError,
}


def from_rpc_error(e: grpc.RpcError) -> BatonError:
    code = e.code()
    return _BY_CODE.get(code, ServerError)(code, e.details() or code.name)
