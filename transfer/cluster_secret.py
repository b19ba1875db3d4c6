"""The cluster secret: a shared token every call on the internal plane carries.

A worker's gRPC port answers the KV handshake (the NIXL metadata that lets a peer READ the
worker's whole KV pool), prefill and decode calls, and lease releases. With a cluster secret
set, a worker refuses every call but health checks (probes send no metadata) that does not carry
it (UNAUTHENTICATED), so a process that merely reaches the port learns nothing and reads
nothing. Routers, decode workers (as KV readers) and Baton's tools send it on every call to a
worker.

Where it comes from, never the command line (``ps`` shows argv to every user of the host):

* ``$BATON_CLUSTER_SECRET`` (a Kubernetes Secret as an env var; ``baton up`` makes one per
  cluster and hands it to its processes this way), else
* the file named by ``$BATON_CLUSTER_SECRET_FILE`` (a mounted Secret), stripped of whitespace.

Neither set: no secret, and workers take calls from anyone who reaches them (a laptop, or a
network that already isolates the workers: the Helm chart's NetworkPolicy).
"""

from __future__ import annotations

import hmac
import os
from functools import lru_cache

import grpc

METADATA_KEY = "baton-cluster-secret"
ENV, FILE_ENV = "BATON_CLUSTER_SECRET", "BATON_CLUSTER_SECRET_FILE"
HELP = (f"cluster secret: ${ENV}, or a file named by ${FILE_ENV} (never a flag: argv is "
        "public); when set, a worker refuses calls without it (UNAUTHENTICATED), and routers "
        "and workers send it")
# probes cannot send metadata; a health answer reveals nothing
OPEN_METHODS = ("/grpc.health.v1.Health/",)


def from_env(env=os.environ) -> str | None:
    """The secret named by the environment (see the module's docs), or None; raises ValueError
    for an unreadable or empty file."""
    if env.get(ENV):
        return env[ENV]
    path = env.get(FILE_ENV)
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            value = f.read().strip()
    except OSError as e:
        raise ValueError(f"${FILE_ENV}={path}: {e.strerror}") from None
    if not value:
        raise ValueError(f"${FILE_ENV}={path}: the file is empty")
    return value


@lru_cache(maxsize=1)
def current() -> str | None:
    """This process's secret (read once)."""
    return from_env()


def adopt(secret: str | None) -> None:
    """Make ``secret`` this process's when the environment names none: a tool (``baton role``,
    ``baton tune --live --apply``) that found a local ``baton up``'s cluster takes its secret
    from that ``baton up``'s state file (:func:`baton.control.cluster_state.up_secret`)."""
    if secret and not current():
        os.environ[ENV] = secret
        current.cache_clear()


class _Send(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, secret: str) -> None:
        self._pair = (METADATA_KEY, secret)

    def _details(self, d):
        return d._replace(metadata=(*(d.metadata or ()), self._pair))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


def channel(address: str, options=(), secret: str | None = None) -> grpc.Channel:
    """An insecure channel to a worker that sends ``secret`` (default: this process's) on every
    call; a plain channel when there is none."""
    ch = grpc.insecure_channel(address, options=list(options))
    secret = secret if secret is not None else current()
    return grpc.intercept_channel(ch, _Send(secret)) if secret else ch


class RequireSecret(grpc.ServerInterceptor):
    """A worker's gate: calls without ``secret`` end UNAUTHENTICATED (health checks excepted)."""

    def __init__(self, secret: str) -> None:
        self._secret = secret.encode()

    def _ok(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == METADATA_KEY:
                given = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(given, self._secret)
        return False

    def intercept_service(self, continuation, details):
        if details.method.startswith(OPEN_METHODS) or self._ok(details.invocation_metadata):
            return continuation(details)
        handler = continuation(details)
        if handler is None:
            return None

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"this worker requires the cluster secret ({METADATA_KEY} metadata)")

        if handler.response_streaming:
            def deny_stream(request, context):
                deny(request, context)
                yield from ()
            return grpc.unary_stream_rpc_method_handler(
                deny_stream, handler.request_deserializer, handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            deny, handler.request_deserializer, handler.response_serializer)


def interceptors() -> list:
    """The server interceptors a worker needs for this process's secret."""
    secret = current()
    return [RequireSecret(secret)] if secret else []
