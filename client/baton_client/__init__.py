"""Baton's client SDK for the public gRPC API: :class:`Client` (sync) and :class:`AsyncClient`
(asyncio), streaming and unary, with deadlines, cancellation, safe retries and typed errors.
See ``baton_client.client`` for an example."""

from baton_client.client import (
    AsyncClient,
    AsyncStream,
    Client,
    Delta,
    Result,
    Stream,
    Timing,
    TokenLogprob,
    ToolCall,
    Usage,
    build_request,
)
from baton_client.errors import (
    AuthenticationError,
    BatonError,
    CancelledError,
    DeadlineExceededError,
    InvalidRequestError,
    ResourceExhaustedError,
    ServerError,
    UnavailableError,
)

__all__ = ["AsyncClient", "AsyncStream", "AuthenticationError", "BatonError", "CancelledError",
           "Client", "DeadlineExceededError", "Delta", "InvalidRequestError",
           "ResourceExhaustedError", "Result", "ServerError", "Stream", "Timing", "TokenLogprob",
           "ToolCall", "UnavailableError", "Usage", "build_request"]
