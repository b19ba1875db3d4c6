"""One connected trace per request across processes: a real cluster (redis-server, a prefill
worker, a decode worker and a router on loopback, tiny random Llama) traced through the standard
OTEL_* environment to an OTLP/gRPC receiver in this test process that keeps the spans in memory.
The test's own client span (an in-memory exporter in this process) is the traces' root: the
client SDK carries it to the router, the router to the workers."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections import defaultdict
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from baton.client import Client, InvalidRequestError
from tests.support.observe import tokens

pytestmark = pytest.mark.slow


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver keeping every span, with its service name, in memory."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                res = {a.key: _value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append({
                            "service": res.get("service.name"), "name": s.name,
                            "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex(), "kind": s.kind,
                            "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                            "status": s.status.code, "events": [e.name for e in s.events],
                            "attrs": {a.key: _value(a.value) for a in s.attributes}})
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str, expect: int, timeout: float = 30.0) -> list[dict]:
        """The spans of ``trace_id``, once at least ``expect`` of them arrived, the router's
        request span among them (processes export in batches of their own)."""
        end = time.monotonic() + timeout
        while True:
            with self.lock:
                got = [s for s in self.spans if s["trace_id"] == trace_id]
            ids = {s["span_id"] for s in got}
            roots = [s for s in got if s["parent"] not in ids]
            if (len(got) >= expect and len(roots) == 1) or time.monotonic() > end:
                return got
            time.sleep(0.05)


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@pytest.fixture(scope="module")
def traced(tiny_llama, start_cluster):
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
           "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_BSP_SCHEDULE_DELAY": "50"}
    c = start_cluster(prefill=1, decode=1, env=env,
                      worker_args=["--model", str(tiny_llama[0]), "--block-size", "4",
                                   "--num-blocks", "256", "--registry-ttl", "2"],
                      routers=[["--http-port", "0", "--local-prefill-max-tokens", "16"]])
    c.wait_router_sees(c.router, prefill=1, decode=1)
    yield receiver, c.router, c.prefill[0], c.decode[0]
    c.stop()
    server.stop(0)


@pytest.fixture(scope="module")
def client_tracer():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def _check_connected(spans: list[dict], root_parent: str) -> dict:
    """Every span's parent is in the trace, but one: the router's request span, whose parent is
    ``root_parent`` (the caller's span, or none). Returns spans by (service, name)."""
    ids = {s["span_id"] for s in spans}
    assert len({s["trace_id"] for s in spans}) == 1
    roots = [s for s in spans if s["parent"] not in ids]
    assert len(roots) == 1, [(s["service"], s["name"]) for s in roots]
    assert roots[0]["service"] == "baton-router" and roots[0]["parent"] == root_parent
    by = {(s["service"], s["name"]): s for s in spans}
    assert len(by) == len(spans), "one span of each kind per request"
    for s in spans:  # children lie within their parents (one machine: one clock)
        p = next((q for q in spans if q["span_id"] == s["parent"]), None)
        if p is not None:
            assert p["start"] - 2e6 <= s["start"] <= s["end"] <= p["end"] + 2e6, (s, p)
    return by


def test_one_connected_trace_per_request_across_router_prefill_transfer_decode(
        traced, client_tracer):
    receiver, router, prefill, decode = traced
    tracer, exporter = client_tracer
    ids = tokens(1, 60)
    with Client(router.address) as c, tracer.start_as_current_span("app request") as mine:
        r = c.generate(token_ids=ids, max_tokens=5, ignore_eos=True)
    assert r.path == "remote" and r.usage.completion_tokens == 5
    ctx = mine.get_span_context()
    spans = receiver.trace(format(ctx.trace_id, "032x"), expect=9)
    by = _check_connected(spans, format(ctx.span_id, "016x"))
    assert {s["service"] for s in spans} == {"baton-router", "baton-prefill", "baton-decode"}
    R, P, D = "baton-router", "baton-prefill", "baton-decode"
    root = next(s for s in spans if s["parent"] == format(ctx.span_id, "016x"))
    assert root["name"].startswith("text_completion ")
    a = root["attrs"]
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == root["name"].split(" ", 1)[1]
    assert a["gen_ai.usage.input_tokens"] == 60 and a["gen_ai.usage.output_tokens"] == 5
    assert a["gen_ai.request.max_tokens"] == 5
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["baton.path"] == "remote" and a["baton.prefill.worker"] == prefill.worker_id
    assert a["baton.decode.worker"] == decode.worker_id and a["baton.kv.blocks_read"] > 0
    route = by[(R, "baton.route")]
    assert route["parent"] == root["span_id"]
    assert route["attrs"]["baton.route.reason"] == r.route_reason
    call_p = by[(R, "baton.v1.PrefillWorker/Prefill")]
    call_d = by[(R, "baton.v1.DecodeWorker/Decode")]
    server_p = by[(P, "baton.v1.PrefillWorker/Prefill")]
    server_d = by[(D, "baton.v1.DecodeWorker/Decode")]
    assert call_p["parent"] == call_d["parent"] == root["span_id"]
    assert server_p["parent"] == call_p["span_id"] and server_d["parent"] == call_d["span_id"]
    assert call_p["kind"] == 3 and server_p["kind"] == 2  # CLIENT, SERVER
    assert server_p["attrs"]["baton.kv.blocks_leased"] == 15  # 60 tokens in 4-token blocks
    for name in ("baton.engine.queue", "baton.engine.prefill"):
        assert by[(P, name)]["parent"] == server_p["span_id"]
    transfer = by[(D, "baton.kv.transfer")]
    assert transfer["parent"] == server_d["span_id"]
    t = transfer["attrs"]
    assert t["baton.kv.bytes"] == a["baton.kv.bytes"] > 0
    assert t["baton.kv.blocks_read"] == a["baton.kv.blocks_read"]
    assert t["baton.kv.transport"] and t["baton.kv.source_worker"] == prefill.worker_id
    assert server_d["attrs"]["gen_ai.usage.output_tokens"] == 5
    assert "baton.first_token" in server_d["events"]
    assert all(s["status"] != 2 for s in spans)  # none failed
    # the app's own span, in this process's in-memory exporter, is the trace's root
    (app,) = [s for s in exporter.get_finished_spans() if s.name == "app request"]
    assert app.context.trace_id == ctx.trace_id and app.parent is None


def test_local_path_and_untraced_callers_get_a_trace_of_their_own(traced):
    receiver, router, _prefill, decode = traced
    with Client(router.address) as c:
        r = c.generate(token_ids=tokens(2, 8), max_tokens=3, ignore_eos=True, request_id="loc-1")
    assert r.path == "local" and r.request_id == "loc-1" and r.router_request_id != "loc-1"
    root = _span_of(receiver, "loc-1")
    assert root["attrs"]["baton.request_id"] == r.router_request_id
    spans = receiver.trace(root["trace_id"], expect=6)
    by = _check_connected(spans, "")  # the router started the trace
    assert {s["service"] for s in spans} == {"baton-router", "baton-decode"}
    server = by[("baton-decode", "baton.v1.DecodeWorker/Generate")]
    assert server["parent"] == by[("baton-router", "baton.v1.DecodeWorker/Generate")]["span_id"]
    for name in ("baton.engine.queue", "baton.engine.prefill"):
        assert by[("baton-decode", name)]["parent"] == server["span_id"]
    assert root["attrs"]["baton.path"] == "local"


def _span_of(receiver: Receiver, request_id: str, timeout: float = 30.0) -> dict:
    """The router's request span of the client's ``request_id``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with receiver.lock:
            for s in receiver.spans:
                if (s["service"] == "baton-router" and s["kind"] == 2
                        and s["attrs"].get("baton.client_request_id") == request_id):
                    return s
        time.sleep(0.05)
    raise AssertionError(f"no router span for {request_id}")


def test_openai_http_joins_the_callers_trace_and_failures_are_marked(traced):
    receiver, router, _prefill, _decode = traced
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    body = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
    req = urllib.request.Request(f"http://{router.http_address}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json",
                                          "traceparent": f"00-{trace_id}-{parent}-01"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert json.load(resp)["usage"]["completion_tokens"] >= 1
    spans = receiver.trace(trace_id, expect=6)  # a short prompt: router and decode worker
    _check_connected(spans, parent)
    # a refused request still leaves its span, marked failed with the status
    with Client(router.address) as c, pytest.raises(InvalidRequestError):
        c.generate("hi", model="no-such-model", request_id="bad-1")
    bad = _span_of(receiver, "bad-1")
    assert bad["status"] == 2 and bad["attrs"]["error.type"] == "INVALID_ARGUMENT"
    spans = defaultdict(list)
    for s in receiver.spans:
        spans[s["trace_id"]].append(s)
    assert len(spans[bad["trace_id"]]) == 1  # no worker was called
