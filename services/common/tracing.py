"""OpenTelemetry tracing: one trace per request across the router, the prefill worker, the KV
transfer and the decode worker.

Off by default, and then free: no OpenTelemetry import, every span is :data:`NO_SPAN`. A process
traces when the standard environment asks for it:

- ``OTEL_TRACES_EXPORTER``: ``otlp`` and/or ``console`` (comma-separated; ``none``: off), or
- ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` set (implies otlp);
- ``OTEL_SDK_DISABLED=true`` turns it off whatever else is set.

The OTLP exporter takes the rest of its settings from the standard variables too (protocol
``grpc`` by default or ``http/protobuf``, headers, TLS, timeout), as do sampling
(``OTEL_TRACES_SAMPLER``), batching (``OTEL_BSP_*``) and the resource (``OTEL_SERVICE_NAME``,
default ``baton-<role>``; ``OTEL_RESOURCE_ATTRIBUTES``). Tracing needs
``pip install 'baton[tracing]'``; a process asked to trace without it refuses to start.

Context crosses processes as W3C ``traceparent``/``tracestate`` gRPC metadata (HTTP headers on
the OpenAI front). Spans are started and parented explicitly, never through the ambient context,
because a gRPC stream's generator may resume on another thread.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable

log = logging.getLogger("baton.tracing")

PROPAGATED = ("traceparent", "tracestate")
_KINDS = ("internal", "server", "client")


def exporters(env=os.environ) -> list[str]:
    """The span exporters the environment asks for; empty: tracing is off."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",")
             if n.strip()]
    if "none" in names:
        return []
    if not names and (env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                      or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        names = ["otlp"]
    for n in names:
        if n not in ("otlp", "console"):
            raise ValueError(f"OTEL_TRACES_EXPORTER={n!r}: Baton supports otlp, console, none")
    return names


class NoSpan:
    """A span that records nothing: what every call returns while tracing is off."""

    recording = False

    def set(self, attrs: dict) -> None:
        pass

    def event(self, name: str, attrs: dict | None = None) -> None:
        pass

    def child(self, name: str, kind: str = "internal", attrs: dict | None = None,
              at: float | None = None) -> NoSpan:
        return self

    def end(self, error: object = None, at: float | None = None) -> None:
        pass

    def metadata(self) -> tuple:
        return ()


NO_SPAN = NoSpan()


class Span(NoSpan):
    """A recording span. Times (``start``, ``at``) are ``time.monotonic()`` seconds."""

    recording = True

    def __init__(self, tracing: Tracing, span) -> None:
        self._t, self._span = tracing, span

    def set(self, attrs: dict) -> None:
        self._span.set_attributes({k: v for k, v in attrs.items() if v is not None})

    def event(self, name: str, attrs: dict | None = None) -> None:
        self._span.add_event(name, attrs or {})

    def child(self, name: str, kind: str = "internal", attrs: dict | None = None,
              at: float | None = None) -> Span:
        """A span under this one, starting now or ``at``."""
        return self._t.start(name, kind, attrs, parent=self, at=at)

    def end(self, error: object = None, at: float | None = None) -> None:
        """End the span; ``error`` (an exception, a gRPC status code or a message) marks it
        failed."""
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            if isinstance(error, BaseException):
                self._span.record_exception(error)
                kind, message = type(error).__name__, str(error)
            else:  # a grpc.StatusCode or a status name
                kind = message = getattr(error, "name", None) or str(error)
            self._span.set_status(Status(StatusCode.ERROR, message))
            self._span.set_attribute("error.type", kind)
        self._span.end(end_time=self._t.ns(time.monotonic() if at is None else at))

    def metadata(self) -> tuple:
        """gRPC metadata carrying this span as the parent of the callee's spans."""
        carrier: dict[str, str] = {}
        self._t.propagator.inject(carrier, context=self._t.trace.set_span_in_context(self._span))
        return tuple(carrier.items())


class Tracing:
    """The process's tracer provider and exporters (see the module docstring)."""

    def __init__(self, role: str, instance: str, names: list[str]) -> None:
        try:
            from opentelemetry import trace
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as e:
            raise SystemExit(f"tracing is on (OTEL_* environment) but OpenTelemetry is not "
                             f"installed ({e}); pip install 'baton[tracing]'") from e
        attrs = {"service.name": os.environ.get("OTEL_SERVICE_NAME") or f"baton-{role}",
                 "service.namespace": "baton", "service.instance.id": instance,
                 "baton.role": role}
        # Resource.create merges OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME
        self.provider = TracerProvider(resource=Resource.create(attrs))
        for name in names:
            self.provider.add_span_processor(BatchSpanProcessor(_exporter(name)))
        self.trace = trace
        self.tracer = self.provider.get_tracer("baton")
        self.propagator = TraceContextTextMapPropagator()
        self._offset_ns = time.time_ns() - time.monotonic_ns()
        log.info("tracing on: exporting spans to %s as %s", ",".join(names),
                 attrs["service.name"])

    def ns(self, monotonic_s: float) -> int:
        """Span times: the monotonic clock, mapped once to the epoch (so that spans stamped
        afterwards, like the engine's queue, line up with those stamped live)."""
        return int(monotonic_s * 1e9) + self._offset_ns

    def start(self, name: str, kind: str = "internal", attrs: dict | None = None,
              parent: Span | Iterable | None = None, at: float | None = None) -> Span:
        """A span under ``parent``: a :class:`Span`, or metadata / headers as (key, value)
        pairs carrying a remote parent; ``None`` starts a new trace."""
        from opentelemetry.trace import SpanKind

        if isinstance(parent, Span):
            ctx = self.trace.set_span_in_context(parent._span)
        elif parent is not None:
            ctx = self.propagator.extract({k.lower(): v for k, v in parent
                                           if k.lower() in PROPAGATED})
        else:
            ctx = None
        span = self.tracer.start_span(
            name, context=ctx, kind=getattr(SpanKind, kind.upper()),
            attributes={k: v for k, v in (attrs or {}).items() if v is not None},
            start_time=self.ns(time.monotonic() if at is None else at))
        return Span(self, span)

    def shutdown(self) -> None:
        """Export what is buffered (at drain and at exit)."""
        self.provider.shutdown()


def _exporter(name: str):
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            raise SystemExit(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: Baton exports "
                             "grpc or http/protobuf")
    except ImportError as e:
        raise SystemExit(f"OTLP over {protocol} needs its exporter ({e}); pip install "
                         "'baton[tracing]' (grpc) or opentelemetry-exporter-otlp-proto-http"
                         ) from e
    return OTLPSpanExporter()


_current: Tracing | None = None


def setup(role: str, instance: str) -> Tracing | None:
    """Turn tracing on for this process if the environment asks for it (see the module
    docstring); returns the Tracing, or None while it is off."""
    global _current
    names = exporters()
    if not names:
        return None
    if _current is None:
        import atexit

        _current = Tracing(role, instance, names)
        atexit.register(_current.shutdown)
    return _current


def enabled() -> bool:
    """Whether this process traces (``setup`` found the environment asking for it)."""
    return _current is not None


def start(name: str, kind: str = "internal", attrs: dict | None = None,
          parent: Span | Iterable | None = None, at: float | None = None) -> NoSpan:
    """A span (see :meth:`Tracing.start`), or :data:`NO_SPAN` while tracing is off."""
    if _current is None:
        return NO_SPAN
    return _current.start(name, kind, attrs, parent, at)


def server_span(context, name: str, attrs: dict | None = None,
                at: float | None = None) -> NoSpan:
    """The span of one incoming gRPC call (that arrived ``at``), under the caller's span when
    its metadata carries one."""
    return request_span(context.invocation_metadata() or (), name, attrs, at)


def worker_span(context, method: str, rid: str, worker_id: str, request,
                at: float | None = None) -> NoSpan:
    """The span of a worker's ``method`` call for request ``rid`` (with its prompt's length)."""
    if _current is None:
        return NO_SPAN
    return server_span(context, f"baton.v1.{method}", {
        "baton.request_id": rid, "baton.worker.id": worker_id,
        "gen_ai.usage.input_tokens": len(request.prompt_token_ids)}, at=at)


def request_span(carrier, name: str, attrs: dict | None = None,
                 at: float | None = None) -> NoSpan:
    """The span of one incoming request (that arrived ``at``), under the caller's span when
    ``carrier`` (its gRPC metadata or HTTP headers, as (name, value) pairs) names one."""
    if _current is None:
        return NO_SPAN
    return _current.start(name, "server", attrs, parent=carrier, at=at)


def shutdown() -> None:
    if _current is not None:
        _current.shutdown()


def error_name(context, exc: BaseException) -> str:
    """What failed a call: the gRPC status the handler set (``abort``), else the exception."""
    code = getattr(context, "code", lambda: None)()
    return getattr(code, "name", None) or type(exc).__name__


def traced_stream(span: NoSpan, context, stream):
    """Relay a server stream's messages, ending ``span`` when it ends, fails or is cancelled."""
    if not span.recording:
        yield from stream
        return
    try:
        yield from stream
    except GeneratorExit:
        span.end(error="CANCELLED")
        raise
    except BaseException as e:
        span.end(error=error_name(context, e))
        raise
    span.end()


def traced_call(span: NoSpan, context, fn, *args):
    """``fn(*args)`` for a unary call, ending ``span`` with its outcome."""
    try:
        out = fn(*args)
    except BaseException as e:
        span.end(error=error_name(context, e))
        raise
    span.end()
    return out
