"""Tracing's pieces in one process: when it is on, how a span's context crosses a process boundary
(as gRPC metadata), retroactive spans, errors. The cross-process trace of a real cluster is in
tests/integration/test_tracing.py."""

from __future__ import annotations

import time

import pytest
from baton.services.common import tracing
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


def test_off_by_default_and_on_by_the_standard_variables():
    assert tracing.exporters({}) == []
    assert tracing.exporters({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}) == ["otlp"]
    assert tracing.exporters({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317"}) == ["otlp"]
    assert tracing.exporters({"OTEL_TRACES_EXPORTER": "console, otlp"}) == ["console", "otlp"]
    assert tracing.exporters({"OTEL_TRACES_EXPORTER": "none",
                              "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}) == []
    assert tracing.exporters({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}) == []
    with pytest.raises(ValueError, match="zipkin"):
        tracing.exporters({"OTEL_TRACES_EXPORTER": "zipkin"})


def test_off_means_no_spans_and_no_metadata():
    assert not tracing.enabled()  # nothing in the test environment turns it on
    span = tracing.start("x")
    assert span is tracing.NO_SPAN and not span.recording
    assert span.child("y").metadata() == ()
    span.set({"a": 1})
    span.end(error="BOOM")


def _tracing(role: str) -> tuple[tracing.Tracing, InMemorySpanExporter]:
    t = tracing.Tracing(role, f"{role}-1", [])
    exporter = InMemorySpanExporter()
    t.provider.add_span_processor(SimpleSpanProcessor(exporter))
    return t, exporter


def test_context_crosses_processes_as_grpc_metadata():
    router, router_spans = _tracing("router")
    worker, worker_spans = _tracing("decode")
    root = router.start("chat m", "server", {"gen_ai.request.model": "m", "skipped": None})
    call = root.child("baton.v1.DecodeWorker/Decode", "client")
    md = call.metadata()
    assert [k for k, _ in md] == ["traceparent"]
    # the worker sees the metadata among others, keys in any case
    remote = worker.start("baton.v1.DecodeWorker/Decode", "server",
                          parent=[("authorization", "Bearer x"), ("TraceParent", md[0][1])])
    t0 = time.monotonic()
    remote.child("baton.kv.transfer", attrs={"baton.kv.bytes": 4096}, at=t0 - 0.5).end(at=t0)
    remote.end()
    call.end()
    root.end()
    (r_root, r_call) = sorted(router_spans.get_finished_spans(), key=lambda s: s.start_time)
    w_spans = {s.name: s for s in worker_spans.get_finished_spans()}
    server, transfer = w_spans["baton.v1.DecodeWorker/Decode"], w_spans["baton.kv.transfer"]
    trace_id = r_root.context.trace_id
    assert {s.context.trace_id for s in (r_call, server, transfer)} == {trace_id}
    assert r_root.parent is None and r_call.parent.span_id == r_root.context.span_id
    assert server.parent.span_id == r_call.context.span_id and server.parent.is_remote
    assert transfer.parent.span_id == server.context.span_id
    assert transfer.end_time - transfer.start_time == pytest.approx(0.5e9, rel=1e-3)
    assert dict(r_root.attributes) == {"gen_ai.request.model": "m"}
    assert r_root.resource.attributes["service.name"] == "baton-router"
    assert server.resource.attributes["baton.role"] == "decode"


def test_errors_mark_the_span():
    t, spans = _tracing("prefill")

    class Ctx:
        def code(self):
            import grpc

            return grpc.StatusCode.RESOURCE_EXHAUSTED

    def fail():
        raise RuntimeError("no blocks")

    with pytest.raises(RuntimeError):
        tracing.traced_call(t.start("a"), Ctx(), fail)

    def stream():
        yield 1
        yield 2

    s = t.start("b")
    gen = tracing.traced_stream(s, Ctx(), stream())
    assert next(gen) == 1
    gen.close()  # the client went away mid-stream
    a, b = spans.get_finished_spans()
    assert a.status.status_code.name == "ERROR"
    assert a.attributes["error.type"] == "RESOURCE_EXHAUSTED"
    assert b.attributes["error.type"] == "CANCELLED"


def test_a_span_without_a_parent_in_the_metadata_starts_a_trace():
    t, spans = _tracing("prefill")
    t.start("a", "server", parent=[("authorization", "x")]).end()
    (a,) = spans.get_finished_spans()
    assert a.parent is None
