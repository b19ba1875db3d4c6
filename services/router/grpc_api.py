"""The router's public gRPC API (``baton.v1.Baton``): a thin adapter around the orchestrator.

A call's deadline becomes the request's (``--request-timeout`` when the client set none, as most
gRPC clients do by default), the end of the call (cancelled, deadline) cancels the request, and
a :class:`RequestError` ends the call with the status code of the same name and its message.
"""

from __future__ import annotations

import grpc
from baton.services.router.errors import RequestError
from baton.services.router.limits import ApiKeys
from baton.services.router.orchestrator import (
    Caller,
    Cancellation,
    Orchestrator,
    resolve_max_tokens,
)
from baton_client.v1 import api_pb2, api_pb2_grpc

DEFAULT_MAX_TOKENS = 16  # what a Baton API request that sets no params.max_tokens gets


class RouterServicer(api_pb2_grpc.BatonServicer):
    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orchestrator = orchestrator

    def ListModels(self, request, context):
        return api_pb2.ListModelsResponse(models=[self.orchestrator.model_card()])

    def Generate(self, request, context):
        cancel = Cancellation()
        if not context.add_callback(cancel.cancel):  # runs when the call ends, however it ends
            cancel.cancel()  # it already has
        metadata = tuple(context.invocation_metadata() or ())
        caller = Caller.of(metadata, context.peer())
        deadline = self.orchestrator.deadline(context.time_remaining())
        resolve_max_tokens(request, DEFAULT_MAX_TOKENS)
        try:
            yield from self.orchestrator.generate(request, deadline, cancel, caller)
        except RequestError as e:
            context.abort(grpc.StatusCode[e.status.name], e.message)


class TokenAuth(grpc.ServerInterceptor):
    """Every call but health checks (probes cannot send tokens) needs
    ``authorization: Bearer <key>`` metadata with one of ``keys``; others end UNAUTHENTICATED."""

    OPEN = ("/grpc.health.v1.Health/",)

    def __init__(self, keys: ApiKeys) -> None:
        self._ok = keys.allows

    @staticmethod
    def _deny(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED,
                      "missing or wrong token (authorization: Bearer ...)")

    def intercept_service(self, continuation, details):
        if details.method.startswith(self.OPEN):
            return continuation(details)
        for key, value in details.invocation_metadata or ():
            if key == "authorization" and self._ok(value):
                return continuation(details)
        handler = continuation(details)
        if handler is None:
            return None
        if handler.response_streaming:
            def deny_stream(request, context):
                self._deny(request, context)
                yield from ()
            return grpc.unary_stream_rpc_method_handler(
                deny_stream, handler.request_deserializer, handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            self._deny, handler.request_deserializer, handler.response_serializer)
