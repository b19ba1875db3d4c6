"""OpenAI-compatible HTTP on the router: ``/v1/completions``, ``/v1/chat/completions`` (server-sent
events with ``"stream": true``, one JSON body otherwise), ``/v1/models``, ``/health``, ``/metrics``.

Requests go to the same :class:`RouterService.Generate` the gRPC API uses, in-process (no second
hop), through a small stand-in for the gRPC servicer context: a client that disconnects cancels
the request like a cancelled gRPC call does. Errors come back as OpenAI-style JSON bodies with
400 (invalid input, naming ``param``), 503 (no worker), 504 (deadline) or 500.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from baton.services.router.limits import ApiKeys
from baton.v1 import api_pb2, worker_pb2

log = logging.getLogger("baton.services.router")

_HTTP = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAVAILABLE: 503,
         grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
         grpc.StatusCode.FAILED_PRECONDITION: 400}


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Context:
    """What RouterService.Generate uses of a grpc.ServicerContext."""

    def __init__(self, timeout: float | None, headers=None, peer: str = "") -> None:
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._callbacks: list = []
        self._active = True
        # the caller's trace context (W3C traceparent / tracestate) and API key, as gRPC has them
        self._metadata = tuple((k.lower(), headers[k])
                               for k in ("traceparent", "tracestate", "Authorization")
                               if headers is not None and headers.get(k))
        self._peer = peer

    def invocation_metadata(self):
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def abort(self, code, details):
        raise _Aborted(code, details)

    def add_callback(self, fn) -> None:
        self._callbacks.append(fn)

    def is_active(self) -> bool:
        return self._active and (self._deadline is None or time.monotonic() < self._deadline)

    def time_remaining(self):
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def done(self) -> None:
        self._active = False
        for fn in self._callbacks:
            fn()


class Metrics:
    """Counters for /metrics (Prometheus text format)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str, str], int] = {}  # (api, path, status) -> count
        self.prompt_tokens = self.completion_tokens = 0
        self.latency_sum = self.ttft_sum = 0.0
        self.latency_count = 0

    def record(self, api: str, path: str, status: str, final=None) -> None:
        with self._lock:
            key = (api, path or "none", status)
            self.requests[key] = self.requests.get(key, 0) + 1
            if final is not None:
                self.prompt_tokens += final.usage.prompt_tokens
                self.completion_tokens += final.usage.completion_tokens
                self.latency_sum += final.timing.total_s
                self.ttft_sum += final.timing.first_token_s
                self.latency_count += 1

    def render(self, workers: dict[str, int]) -> str:
        with self._lock:
            out = ["# HELP baton_requests_total HTTP requests by API, path taken and status.",
                   "# TYPE baton_requests_total counter"]
            out += [f'baton_requests_total{{api="{a}",path="{p}",status="{s}"}} {n}'
                    for (a, p, s), n in sorted(self.requests.items())]
            out += ["# TYPE baton_prompt_tokens_total counter",
                    f"baton_prompt_tokens_total {self.prompt_tokens}",
                    "# TYPE baton_generated_tokens_total counter",
                    f"baton_generated_tokens_total {self.completion_tokens}",
                    "# TYPE baton_http_request_seconds summary",
                    f"baton_http_request_seconds_sum {self.latency_sum}",
                    f"baton_http_request_seconds_count {self.latency_count}",
                    "# TYPE baton_http_time_to_first_token_seconds summary",
                    f"baton_http_time_to_first_token_seconds_sum {self.ttft_sum}",
                    f"baton_http_time_to_first_token_seconds_count {self.latency_count}",
                    "# TYPE baton_workers gauge"]
            out += [f'baton_workers{{role="{r}"}} {n}' for r, n in sorted(workers.items())]
        return "\n".join(out) + "\n"


class _BadRequest(Exception):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _typed(body: dict, key: str, kind: type | tuple, what: str):
    """``body[key]`` if present and not null, checked to be ``kind`` (bools are not numbers)."""
    value = body.get(key)
    if value is None:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise _BadRequest(key, f"{key} must be {what}, got {value!r}")
    return value


def _set(p, field: str, key: str, value) -> None:
    try:
        setattr(p, field, value)
    except (ValueError, TypeError) as e:  # out of the wire type's range
        raise _BadRequest(key, f"{key}={value!r} is out of range ({e})") from None


def _params(body: dict, kind: str = "text") -> worker_pb2.SamplingParams:
    p = worker_pb2.SamplingParams()
    for key in ("max_completion_tokens", "max_tokens"):
        value = _typed(body, key, int, "an integer")
        if value is not None:
            _set(p, "max_tokens", key, value)
            break
    for key, kind_, what in (("temperature", (int, float), "a number"),
                             ("top_p", (int, float), "a number"), ("seed", int, "an integer"),
                             ("top_k", int, "an integer")):
        value = _typed(body, key, kind_, what)
        if value is not None:
            _set(p, key, key, value)
    if body.get("temperature") is None:
        p.temperature = 1.0  # the OpenAI API's default
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _BadRequest("stop", "stop must be a string or a list of strings")
        p.stop.extend(stops)
    ignore_eos = _typed(body, "ignore_eos", bool, "a boolean")  # vLLM's: exactly max_tokens
    if ignore_eos is not None:
        p.ignore_eos = ignore_eos
    _typed(body, "stream", bool, "a boolean")
    _typed(body, "stream_options", dict, "an object")
    if body.get("n", 1) != 1:
        raise _BadRequest("n", "only n=1 is supported")
    lp = body.get("logprobs")
    if kind == "chat" and lp:  # logprobs: true, top_logprobs: n
        _set(p, "logprobs", "top_logprobs",
             _typed(body, "top_logprobs", int, "an integer") or 0)
    elif kind == "text" and lp is not None and lp is not False:  # logprobs: n
        _set(p, "logprobs", "logprobs", _typed(body, "logprobs", int, "an integer"))
    return p


def _generate_request(kind: str, body: dict) -> api_pb2.GenerateRequest:
    req = api_pb2.GenerateRequest(model=_typed(body, "model", str, "a string") or "",
                                  params=_params(body, kind))
    if kind == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise _BadRequest("messages", "messages must be a non-empty list")
        for i, m in enumerate(msgs):
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                parts = [c.get("text", "") for c in content if isinstance(c, dict)]
                content = "".join(parts) if all(isinstance(t, str) for t in parts) else None
            if not isinstance(content, str) or not isinstance(m.get("role"), str):
                raise _BadRequest(f"messages[{i}]", "each message needs a role and text content")
            req.chat.messages.add(role=m["role"], content=content)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            req.text = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            try:
                req.token_ids.ids.extend(prompt)
            except ValueError:
                raise _BadRequest("prompt", "token ids must be 32-bit integers") from None
        else:
            raise _BadRequest("prompt", "prompt must be a string or a list of token ids")
    return req


class OpenAIHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    router = None  # set by serve_http
    metrics: Metrics = None
    keys: ApiKeys = ApiKeys()  # when any: /v1/* needs "Authorization: Bearer <key>"

    def _authorized(self) -> bool:
        """/v1/* with API keys set needs one as the bearer token (the OpenAI client's api_key);
        /health and /metrics stay open for probes and scrapers."""
        if not self.keys or not self.path.startswith("/v1/"):
            return True
        if self.keys.allows(self.headers.get("Authorization")):
            return True
        self._error(401, "missing or wrong API key (Authorization: Bearer ...)",
                    "authentication_error")
        return False

    def log_message(self, fmt, *args) -> None:  # through logging, not stderr
        log.debug("http %s", fmt % args)

    # ---- routing ---------------------------------------------------------------------------------

    def do_GET(self) -> None:
        if not self._authorized():
            return
        path = self.path.split("?")[0]
        if path == "/v1/models":
            models = self.router.ListModels(None, None).models
            self._json(200, {"object": "list", "data": [
                {"id": m.id, "object": "model", "created": 0, "owned_by": "baton",
                 "max_model_len": m.max_model_len} for m in models]})
        elif path == "/health":
            counts = self._worker_counts()
            ok = counts.get("decode", 0) + counts.get("both", 0) > 0
            self._json(200 if ok else 503, {"status": "ok" if ok else "no decode worker",
                                            "workers": counts})
        elif path == "/metrics":
            body = (self.metrics.render(self._worker_counts())
                    + self.router.metrics.render()).encode()
            self._send(200, body, "text/plain; version=0.0.4")
        else:
            self._error(404, f"no route {path}", "not_found")

    def do_POST(self) -> None:
        if not self._authorized():
            return
        path = self.path.split("?")[0]
        kind = {"/v1/completions": "text", "/v1/chat/completions": "chat"}.get(path)
        if kind is None:
            return self._error(404, f"no route {path}", "not_found")
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(body, dict):
                raise _BadRequest("body", "the body must be a JSON object")
            req = _generate_request(kind, body)
        except (ValueError, _BadRequest) as e:
            return self._error(400, str(e), "invalid_request_error",
                               getattr(e, "param", "body"))
        if body.get("stream"):
            self._stream(kind, req, body)
        else:
            self._complete(kind, req)

    # ---- generation ------------------------------------------------------------------------------

    def _context(self) -> _Context:
        return _Context(timeout=None, headers=self.headers,
                        peer=f"ipv4:{self.client_address[0]}:{self.client_address[1]}")

    def _run(self, req, ctx):
        self._gen = self.router.Generate(req, ctx)
        return self._gen

    def _complete(self, kind: str, req) -> None:
        ctx = self._context()
        text, final, lps = "", None, []
        try:
            for msg in self._run(req, ctx):
                if msg.HasField("delta"):
                    text += msg.delta.text
                    lps += msg.delta.logprobs
                else:
                    final = msg.final
        except _Aborted as e:
            self.metrics.record(kind, "", e.code.name)
            return self._error(_HTTP.get(e.code, 500), e.details, _err_type(e.code),
                               _param(e.details))
        finally:
            self._close(ctx)
        self.metrics.record(kind, final.path, "OK", final)
        rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), self._model()
        reason = _finish(final.finish_reason)
        lp = self._logprobs(kind, lps) if req.params.HasField("logprobs") else None
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": reason, "logprobs": lp}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": lp}
            obj = "text_completion"
        self._json(200, {"id": rid, "object": obj, "created": created, "model": model,
                         "choices": [choice], "usage": _usage(final),
                         "baton": {"path": final.path, "retries": final.retries,
                                   "migrations": final.migrations,
                                   "prefill_worker": final.prefill_worker,
                                   "decode_worker": final.decode_worker}})

    def _stream(self, kind: str, req, body: dict) -> None:
        ctx = self._context()
        rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), self._model()
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        want_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        started = False

        want_lp = req.params.HasField("logprobs")

        def chunk(delta_text: str | None, reason: str | None, first: bool = False,
                  lps=()) -> dict:
            lp = self._logprobs(kind, lps) if want_lp and lps else None
            if kind == "chat":
                delta = {"role": "assistant", "content": ""} if first else (
                    {"content": delta_text} if delta_text is not None else {})
                choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": lp}
            else:
                choice = {"index": 0, "text": delta_text or "", "finish_reason": reason,
                          "logprobs": lp}
            return {"id": rid, "object": obj, "created": created, "model": model,
                    "choices": [choice]}

        try:
            for msg in self._run(req, ctx):
                if not started:  # headers only once the first token is certain
                    self._start_sse()
                    started = True
                    if kind == "chat":
                        self._event(chunk(None, None, first=True))
                if msg.HasField("delta"):
                    self._event(chunk(msg.delta.text, None, lps=msg.delta.logprobs))
                else:
                    final = msg.final
                    self._event(chunk(None if kind == "chat" else "",
                                      _finish(final.finish_reason)))
                    if want_usage:
                        self._event({"id": rid, "object": obj, "created": created,
                                     "model": model, "choices": [], "usage": _usage(final)})
                    self.metrics.record(kind, final.path, "OK", final)
            self._raw(b"data: [DONE]\n\n")
            self._end_chunks()
        except _Aborted as e:
            self.metrics.record(kind, "", e.code.name)
            if not started:
                return self._error(_HTTP.get(e.code, 500), e.details, _err_type(e.code),
                                   _param(e.details))
            self._event({"error": {"message": e.details, "type": _err_type(e.code),
                                   "code": e.code.name}})
            self._end_chunks()
        except (BrokenPipeError, ConnectionResetError):
            log.info("HTTP client went away; cancelling its request")
        finally:
            self._close(ctx)

    def _close(self, ctx: _Context) -> None:
        ctx.done()  # cancels the worker calls still in flight
        gen = getattr(self, "_gen", None)
        if gen is not None:
            gen.close()
            self._gen = None

    # ---- output helpers --------------------------------------------------------------------------

    def _logprobs(self, kind: str, lps) -> dict:
        """baton.v1.TokenLogprob list -> the OpenAI chat or legacy completions shape."""
        tok = self.router.tokenizer

        def s(token_id: int) -> str:
            return tok.decode([token_id], skip_special_tokens=False)

        if kind == "chat":
            return {"content": [
                {"token": s(lp.token_id), "logprob": lp.logprob,
                 "bytes": list(s(lp.token_id).encode()),
                 "top_logprobs": [{"token": s(t.token_id), "logprob": t.logprob,
                                   "bytes": list(s(t.token_id).encode())} for t in lp.top]}
                for lp in lps]}
        tokens = [s(lp.token_id) for lp in lps]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{s(t.token_id): t.logprob for t in lp.top} for lp in lps],
                "text_offset": offsets}

    def _model(self) -> str:
        return self.router.model

    def _worker_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for w in self.router.pool.workers():
            counts[w.role] = counts.get(w.role, 0) + 1
        return counts

    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj: dict) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _error(self, status: int, message: str, etype: str, param: str | None = None) -> None:
        self._json(status, {"error": {"message": message, "type": etype, "param": param,
                                      "code": None}})

    def _start_sse(self) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _raw(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _event(self, obj: dict) -> None:
        self._raw(b"data: " + json.dumps(obj).encode() + b"\n\n")

    def _end_chunks(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def _finish(reason: str) -> str:
    return {"stop": "stop", "length": "length"}.get(reason, reason or "stop")


def _usage(final) -> dict:
    u = final.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def _err_type(code: grpc.StatusCode) -> str:
    return {grpc.StatusCode.INVALID_ARGUMENT: "invalid_request_error",
            grpc.StatusCode.UNAVAILABLE: "service_unavailable",
            grpc.StatusCode.DEADLINE_EXCEEDED: "timeout"}.get(code, "server_error")


def _param(details: str) -> str | None:
    # "InvalidRequestError: invalid temperature=-1.0: must be >= 0" -> "temperature"
    if "invalid " in details and "=" in details:
        return details.split("invalid ", 1)[1].split("=", 1)[0]
    return None


def serve_http(router, host: str, port: int, keys: ApiKeys | None = None,
               tls: tuple[str, str] | None = None) -> ThreadingHTTPServer:
    """Start the HTTP front on a thread; returns the server (``server_address`` has the port).
    ``tls``: (certificate file, key file) to serve HTTPS."""
    handler = type("Handler", (OpenAIHandler,), {"router": router, "metrics": Metrics(),
                                                 "keys": keys or ApiKeys()})
    server = ThreadingHTTPServer((host, port), handler)
    if tls is not None:
        import ssl

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(*tls)
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="openai-http", daemon=True).start()
    return server
