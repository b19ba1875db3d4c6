"""The router's OpenAI-compatible HTTP front: ``/v1/completions``, ``/v1/chat/completions``
(server-sent events with ``"stream": true``, one JSON body otherwise), ``/v1/models``, ``/health``,
``/metrics``.

It is a Starlette app served by uvicorn (httptools and uvloop when installed), the stack vLLM's
and SGLang's OpenAI servers use, so keep-alive, pipelining, chunked streaming, TLS and slow or
vanishing clients are handled by a maintained HTTP server rather than by Baton. A request is
turned into a ``baton.v1.GenerateRequest`` and run by the same :class:`Orchestrator` the gRPC
API uses, in-process: the orchestrator's generator runs on a thread of a pool sized like the gRPC
server's, and its messages cross to the event loop through a queue. A client that disconnects,
streaming or not, queued or running, cancels its request on every worker. Errors are OpenAI
error bodies: 400 naming ``param`` (invalid input), 401 (API key), 429 (limits), 503 (no
worker), 504 (deadline) or 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from baton.services.router.errors import RequestError, Status
from baton.services.router.limits import ApiKeys
from baton.services.router.orchestrator import (
    Caller,
    Cancellation,
    Orchestrator,
    answer_shape,
    thinks,
)
from baton_client.v1 import api_pb2
from prometheus_client import Counter, Gauge, Summary
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

log = logging.getLogger("baton.services.router")

_HTTP_STATUS = {Status.INVALID_ARGUMENT: 400, Status.FAILED_PRECONDITION: 400,
                Status.UNAUTHENTICATED: 401, Status.RESOURCE_EXHAUSTED: 429,
                Status.CANCELLED: 499, Status.UNAVAILABLE: 503, Status.DEADLINE_EXCEEDED: 504}
_ERROR_TYPE = {Status.INVALID_ARGUMENT: "invalid_request_error",
               Status.FAILED_PRECONDITION: "invalid_request_error",
               Status.UNAUTHENTICATED: "authentication_error",
               Status.RESOURCE_EXHAUSTED: "rate_limit_error",
               Status.UNAVAILABLE: "service_unavailable", Status.DEADLINE_EXCEEDED: "timeout"}
_PROPAGATED = ("traceparent", "tracestate", "authorization")


class HttpMetrics:
    """The front's counters, in the orchestrator's Prometheus registry (one ``/metrics``)."""

    def __init__(self, registry) -> None:
        r = registry
        self.requests = Counter("baton_requests", "HTTP requests by API, path taken and status.",
                                ["api", "path", "status"], registry=r)
        self.prompt_tokens = Counter("baton_prompt_tokens", "Prompt tokens of HTTP requests.",
                                     registry=r)
        self.generated = Counter("baton_generated_tokens", "Tokens sent to HTTP clients.",
                                 registry=r)
        self.latency = Summary("baton_http_request_seconds", "HTTP request start to its end.",
                               registry=r)
        self.ttft = Summary("baton_http_time_to_first_token_seconds",
                            "HTTP request start to its first token.", registry=r)
        self.workers = Gauge("baton_workers", "Registered workers by role.", ["role"],
                             registry=r)
        self.unknown = Counter("baton_http_unknown_fields", "Request fields the front did not "
                               "know and ignored (--unknown-fields ignore).", ["field"],
                               registry=r)

    def record(self, api: str, final=None, error: RequestError | None = None) -> None:
        if error is not None:
            self.requests.labels(api, "none", error.status.name).inc()
            return
        self.requests.labels(api, final.path or "none", "OK").inc()
        self.prompt_tokens.inc(final.usage.prompt_tokens)
        self.generated.inc(final.usage.completion_tokens)
        self.latency.observe(final.timing.total_s)
        self.ttft.observe(final.timing.first_token_s)


# ---- request bodies -> baton.v1.GenerateRequest --------------------------------------------------


def _bad(param: str, message: str) -> RequestError:
    return RequestError(Status.INVALID_ARGUMENT, message, param)


def _typed(body: dict, key: str, kind: type | tuple, what: str):
    """``body[key]`` if present and not null, checked to be ``kind`` (bools are not numbers)."""
    value = body.get(key)
    if value is None:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise _bad(key, f"{key} must be {what}, got {value!r}")
    return value


def _set(p, field: str, key: str, value) -> None:
    try:
        setattr(p, field, value)
    except (ValueError, TypeError) as e:  # out of the wire type's range
        raise _bad(key, f"{key}={value!r} is out of range ({e})") from None


_NUMBERS = (("temperature", (int, float), "a number"), ("top_p", (int, float), "a number"),
            ("seed", int, "an integer"), ("top_k", int, "an integer"),
            ("presence_penalty", (int, float), "a number"),
            ("frequency_penalty", (int, float), "a number"),
            ("repetition_penalty", (int, float), "a number"), ("min_p", (int, float), "a number"),
            ("min_tokens", int, "an integer"))
# what the sampling fields may be (the engine's SamplingParams checks them again)
_RANGES = {"presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0),
           "repetition_penalty": (1e-9, 100.0), "min_p": (0.0, 1.0), "min_tokens": (0, 1 << 30)}


# what a request that sets neither max_tokens nor max_completion_tokens gets, per endpoint: the
# completions API's documented 16; chat none (None): the router runs it to EOS, to the context
# less the prompt (at most --max-tokens), or to what the worker's KV pool holds, as OpenAI and
# vLLM run chat to EOS or the context
DEFAULT_MAX_TOKENS: dict[str, int | None] = {"text": 16, "chat": None}
# the most choices one request may ask for (n)
MAX_N = 16


def _params(body: dict, kind: str = "text") -> api_pb2.SamplingParams:
    p = api_pb2.SamplingParams()
    default = DEFAULT_MAX_TOKENS[kind]
    if default is not None:
        p.max_tokens = default
    for key in ("max_completion_tokens", "max_tokens"):
        value = _typed(body, key, int, "an integer")
        if value is not None:
            _set(p, "max_tokens", key, value)
            break
    for key, kind_, what in _NUMBERS:
        value = _typed(body, key, kind_, what)
        if value is not None:
            lo, hi = _RANGES.get(key, (value, value))
            if not lo <= value <= hi:
                raise _bad(key, f"{key}={value!r} must be in [{lo:g}, {hi:g}]")
            _set(p, key, key, value)
    _token_fields(p, body)
    if body.get("temperature") is None:
        p.temperature = 1.0  # the OpenAI API's default
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _bad("stop", "stop must be a string or a list of strings")
        p.stop.extend(stops)
    ignore_eos = _typed(body, "ignore_eos", bool, "a boolean")  # vLLM's: exactly max_tokens
    if ignore_eos is not None:
        p.ignore_eos = ignore_eos
    _typed(body, "stream", bool, "a boolean")
    _typed(body, "stream_options", dict, "an object")
    n = _typed(body, "n", int, "an integer")
    if n is not None and not 1 <= n <= MAX_N:
        raise _bad("n", f"n={n} must be in [1, {MAX_N}]")
    if (n or 1) > 1 and body.get("stream"):
        raise _bad("n", "n > 1 with stream is not implemented (send n requests, or stream=false)")
    _logprobs_param(p, body, kind)
    return p


def _grammar_fields(req, body: dict, chat_template: str | None) -> None:
    """``response_format`` or ``structured_outputs`` as the grammar the workers follow, checked
    here (a bad or unsupported schema is a 400 naming it, before any worker holds KV); with a
    reasoning model thinking, the grammar applies after its thinking block."""
    from baton.engine import grammar
    from baton.engine.errors import InvalidRequestError

    for key in grammar.GUIDED:
        if body.get(key) is not None:
            raise _bad(key, f"{key} was removed from vLLM; send structured_outputs (e.g. "
                            '{"json": SCHEMA}) or response_format instead')
    given = [k for k in ("response_format", "structured_outputs") if body.get(k) is not None]
    if len(given) == 2:
        raise _bad("structured_outputs", "give response_format or structured_outputs, not both")
    if not given:
        return
    try:
        think = thinks(req, chat_template)
        req.params.grammar = (
            grammar.from_response_format(body["response_format"], think)
            if given[0] == "response_format"
            else grammar.from_structured_outputs(body["structured_outputs"], think))
    except InvalidRequestError as e:  # GrammarError, or chat_template_kwargs
        raise _bad(e.field, str(e)) from None


def _token_fields(p, body: dict) -> None:
    """``logit_bias`` (OpenAI: token id as a string -> bias in [-100, 100]) and vLLM's
    ``stop_token_ids``."""
    bias = _typed(body, "logit_bias", dict, "an object of token id -> bias")
    for tok, v in (bias or {}).items():
        if not (isinstance(tok, str) and tok.isdigit()) or isinstance(v, bool) or not isinstance(
                v, (int, float)) or not -100 <= v <= 100:
            raise _bad("logit_bias", f"logit_bias maps token ids (strings of digits) to biases "
                                     f"in [-100, 100]; got {tok!r}: {v!r}")
        p.logit_bias[int(tok)] = float(v)
    stops = _typed(body, "stop_token_ids", list, "a list of token ids")
    if stops is not None:
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stops):
            raise _bad("stop_token_ids", "stop_token_ids must be a list of token ids (>= 0)")
        p.stop_token_ids.extend(stops)


def _logprobs_param(p, body: dict, kind: str) -> None:
    lp = body.get("logprobs")
    if kind == "chat" and lp:  # logprobs: true, top_logprobs: n
        _set(p, "logprobs", "top_logprobs",
             _typed(body, "top_logprobs", int, "an integer") or 0)
    elif kind == "text" and lp is not None and lp is not False:  # logprobs: n
        _set(p, "logprobs", "logprobs", _typed(body, "logprobs", int, "an integer"))


def _zero(v) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0)


# OpenAI (and vLLM) request fields Baton does not implement, each with what counts as not using
# it (its documented default, or empty). Sent with any other value, the request is refused with
# 400 naming the field, never served as if the field were absent. Fields that only describe the
# caller (user, metadata) are accepted as they are.
_NOT_IMPLEMENTED: dict[str, tuple[tuple[str, ...], Callable[[object], bool], str]] = {
    "functions": (("chat",), lambda v: v is None or v == [], "[]"),
    "function_call": (("chat",), lambda v: v is None or v == "none", '"none"'),
    "modalities": (("chat",), lambda v: v is None or v == ["text"], '["text"]'),
    "audio": (("chat",), lambda v: v is None, "null"),
    "prediction": (("chat",), lambda v: v is None, "null"),
    "reasoning_effort": (("chat",), lambda v: v is None, "null"),
    "web_search_options": (("chat",), lambda v: v is None, "null"),
    "verbosity": (("chat",), lambda v: v is None, "null"),
    "moderation": (("chat",), lambda v: v is None, "null"),
    "echo": (("text",), lambda v: v is None or v is False, "false"),
    "suffix": (("text",), lambda v: v is None or v == "", '""'),
    "best_of": (("text",), lambda v: v is None or v == 1, "1"),
}


# logit processing (engine/params.py): OpenAI's penalties and bias, vLLM's others; structured
# output (engine/grammar.py): OpenAI's response_format, vLLM's structured_outputs
SAMPLING_FIELDS = ("presence_penalty", "frequency_penalty", "logit_bias", "repetition_penalty",
                   "min_p", "min_tokens", "stop_token_ids", "response_format",
                   "structured_outputs")
# the fields Baton reads, per API (vLLM's top_k, ignore_eos and chat_template_kwargs too)
_SERVED = {
    "chat": {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
             "seed", "stop", "stream", "stream_options", "n", "logprobs", "top_logprobs",
             "top_k", "ignore_eos", "chat_template_kwargs", "tools", "tool_choice",
             "parallel_tool_calls", *SAMPLING_FIELDS},
    "text": {"model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
             "stream_options", "n", "logprobs", "top_k", "ignore_eos", *SAMPLING_FIELDS},
}
# fields that describe the caller or ask a hosted service for something Baton has no part of
# (storage, tiers, cache retention): accepted and not acted on
CALLER_FIELDS = {"user", "metadata", "store", "service_tier", "prompt_cache_key",
                 "prompt_cache_retention", "prompt_cache_options", "safety_identifier"}
# what the router does with a field it does not know (--unknown-fields): refuse it, as OpenAI
# does ("Unrecognized request argument supplied"), or ignore it (logged once, counted)
UNKNOWN_FIELDS = ("refuse", "ignore")


def known_fields(kind: str) -> set[str]:
    """Every field of a ``kind`` request this router knows: served, accepted as the caller's,
    or refused as not implemented."""
    from baton.engine.grammar import GUIDED

    return (_SERVED[kind] | CALLER_FIELDS | set(GUIDED)
            | {k for k, (kinds, _, _) in _NOT_IMPLEMENTED.items() if kind in kinds})


def _refuse_unimplemented(kind: str, body: dict) -> None:
    for key, (kinds, unused, default) in _NOT_IMPLEMENTED.items():
        if kind in kinds and key in body and not unused(body[key]):
            raise _bad(key, f"{key} is not implemented by Baton (leave it out, or send "
                            f"{default}); got {json.dumps(body[key])[:100]}")


def unknown_fields(kind: str, body: dict) -> list[str]:
    """The fields of ``body`` a ``kind`` request does not have, in order."""
    known = known_fields(kind)
    return [k for k in body if k not in known]


def generate_request(kind: str, body: dict, unknown: str = "refuse",
                     chat_template: str | None = None) -> api_pb2.GenerateRequest:
    """The gRPC API's request for an OpenAI ``kind`` ("chat" or "text") body; raises
    RequestError (INVALID_ARGUMENT) naming the offending field, a field Baton does not implement
    included, and (``unknown="refuse"``) a field no such request has."""
    if not isinstance(body, dict):
        raise _bad("body", "the body must be a JSON object")
    extra = unknown_fields(kind, body)
    if extra and unknown == "refuse":
        raise _bad(extra[0], f"Unrecognized request argument supplied: {extra[0]} (the router "
                             "refuses fields it does not know; `--unknown-fields ignore` "
                             "ignores them)")
    _refuse_unimplemented(kind, body)
    req = api_pb2.GenerateRequest(model=_typed(body, "model", str, "a string") or "",
                                  params=_params(body, kind))
    if kind == "chat":
        _chat(req, body.get("messages"))
        kwargs = _typed(body, "chat_template_kwargs", dict, "an object")
        if kwargs:
            req.chat.template_kwargs_json = json.dumps(kwargs)
    else:
        _prompt(req, body.get("prompt"))
    _grammar_fields(req, body, chat_template)
    if kind == "chat":
        _tools(req, body, chat_template)
    return req


def _tools(req, body: dict, chat_template: str | None) -> None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` onto the chat request, checked
    here (400 naming the field); the orchestrator builds the grammar that forces a required
    or named call (``tool_calls.prepare``) and parses the calls out of the answer."""
    from baton.engine import tool_calls
    from baton.engine.errors import InvalidRequestError

    if body.get("tools") is None:
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise _bad("tool_choice", "tool_choice names a tool, but tools is empty")
        return
    parallel = _typed(body, "parallel_tool_calls", bool, "a boolean")
    try:
        tool_calls.checked(chat_template, body["tools"], body.get("tool_choice"))
    except InvalidRequestError as e:
        raise _bad(e.field, str(e)) from None
    if body.get("tool_choice") == "none":
        return
    req.chat.tools_json = json.dumps(body["tools"])
    if body.get("tool_choice") is not None:
        req.chat.tool_choice_json = json.dumps(body["tool_choice"])
    if parallel is not None:
        req.chat.parallel_tool_calls = parallel


def _chat(req, msgs) -> None:
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "messages must be a non-empty list")
    for i, m in enumerate(msgs):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            content = _text_parts(content, i)
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if content is None and calls:  # an assistant turn of tool calls only
            content = ""
        if not isinstance(content, str) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}]", "each message needs a role and text content")
        msg = req.chat.messages.add(role=m["role"], content=content)
        if calls is not None:
            if not isinstance(calls, list):
                raise _bad(f"messages[{i}].tool_calls", "tool_calls must be a list")
            msg.tool_calls_json = json.dumps(calls)
        for key in ("tool_call_id", "name"):
            if isinstance(m.get(key), str):
                setattr(msg, key, m[key])


def _text_parts(parts: list, i: int) -> str | None:
    """A message's content parts joined, when every part is text (None if one is malformed).
    A part of another type (an image, audio, a file) is refused naming it: the model would
    answer without it, wrong in silence."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise _bad(f"messages[{i}].content[{j}].type",
                       f"content part type {kind!r} is not served: Baton's models read text "
                       "only (send the part as text, or leave it out)")
        texts.append(part.get("text"))
    return "".join(texts) if all(isinstance(t, str) for t in texts) else None


def _prompt(req, prompt) -> None:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        req.text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        try:
            req.token_ids.ids.extend(prompt)
        except ValueError:
            raise _bad("prompt", "token ids must be 32-bit integers") from None
    else:
        raise _bad("prompt", "prompt must be a string or a list of token ids")


# ---- the orchestrator's generator, on a thread, read from the event loop -------------------------

_END = object()


class _Relay:
    """Runs one request's orchestrator generator on ``pool`` and hands its messages to the event
    loop. :meth:`cancel` (the client went away) cancels the request on every worker."""

    def __init__(self, orchestrator: Orchestrator, pool: ThreadPoolExecutor, req,
                 caller: Caller) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._cancel = Cancellation()
        gen = orchestrator.generate(req, orchestrator.deadline(None), self._cancel, caller)
        pool.submit(self._run, gen)

    def cancel(self) -> None:
        self._cancel.cancel()

    def _run(self, gen) -> None:
        put = self._loop.call_soon_threadsafe
        try:
            for msg in gen:
                put(self._queue.put_nowait, msg)
            put(self._queue.put_nowait, _END)
        except RequestError as e:
            put(self._queue.put_nowait, e)
        except Exception as e:  # a bug: the client still gets an answer
            log.exception("request failed")
            put(self._queue.put_nowait, RequestError(Status.INTERNAL, f"{type(e).__name__}: {e}"))

    async def __aiter__(self):
        while True:
            item = await self._queue.get()
            if item is _END:
                return
            if isinstance(item, RequestError):
                raise item
            yield item


class _All:
    """Every relay of an ``n`` > 1 request, cancelled together."""

    def __init__(self, relays: list[_Relay]) -> None:
        self.relays = relays

    def cancel(self) -> None:
        for r in self.relays:
            r.cancel()


async def _drain(messages, answer) -> None:
    async for msg in messages:
        answer.take(msg)


def _merge(answers: list) -> dict:
    """One body of ``n`` answers: choice i is answer i's; usage counts the prompt once and
    every choice's tokens; ``baton.choices`` says where each ran and what it found cached."""
    out = answers[0].body()
    out["choices"] = [{**a.body()["choices"][0], "index": i} for i, a in enumerate(answers)]
    usage = out["usage"]
    usage["completion_tokens"] = sum(a.final.usage.completion_tokens for a in answers)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    out["baton"]["choices"] = [{"path": a.final.path, "cached_tokens": a.final.usage.cached_tokens,
                                "decode_worker": a.final.decode_worker} for a in answers]
    return out


async def _watch_disconnect(request: Request, relay) -> None:
    """Cancel ``relay`` when the client disconnects (the body was read already, so the next ASGI
    message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    relay.cancel()


# ---- the app -------------------------------------------------------------------------------------


class OpenAIFront:
    """The routes, bound to one orchestrator; :meth:`app` is the ASGI app."""

    def __init__(self, orchestrator: Orchestrator, keys: ApiKeys | None = None,
                 threads: int = 1024, unknown_fields: str = "refuse") -> None:
        assert unknown_fields in UNKNOWN_FIELDS, unknown_fields
        self.orch, self.keys, self.unknown = orchestrator, keys or ApiKeys(), unknown_fields
        self._ignored: set[str] = set()
        self.metrics = HttpMetrics(orchestrator.metrics.registry)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="http-request")

    def app(self) -> Starlette:
        routes = [Route("/v1/models", self.models), Route("/health", self.health),
                  Route("/metrics", self.scrape), Route("/v1/baton/workload", self.workload),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat, methods=["POST"])]
        app = Starlette(routes=routes, exception_handlers={404: _not_found, 405: _not_found})
        app.add_middleware(_ApiKeyCheck, keys=self.keys)
        return app

    async def models(self, request: Request) -> Response:
        m = self.orch.model_card()
        return _json({"object": "list", "data": [
            {"id": m.id, "object": "model", "created": 0, "owned_by": "baton",
             "max_model_len": m.max_model_len}]})

    async def health(self, request: Request) -> Response:
        """200 while the router can serve, 503 with the reasons while it cannot: workers
        that answer, not registry entries (``baton.services.router.liveness``)."""
        ok, body = self.orch.health()
        return _json(body, status_code=200 if ok else 503)

    async def workload(self, request: Request) -> Response:
        """The live workload (services/router/workload_log.py), one JSON record per line,
        oldest first: a trace `baton tune --format baton` reads. 404 with --workload-window 0.
        Needs the API key like every /v1 route."""
        log_ = self.orch.workload
        if log_ is None:
            return _json({"error": {"message": "this router keeps no workload "
                                               "(--workload-window 0)", "type": "not_found"}},
                         status_code=404)
        body = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in log_.export())
        return Response(body, media_type="application/x-ndjson")

    async def scrape(self, request: Request) -> Response:
        self.metrics.workers.clear()
        for role, n in self.orch.pool.role_counts().items():
            self.metrics.workers.labels(role).set(n)
        return Response(self.orch.metrics.render(), media_type="text/plain; version=0.0.4")

    def _note_ignored(self, kind: str, body: dict) -> None:
        """Count (and log once per field) what ``--unknown-fields ignore`` let through."""
        for key in unknown_fields(kind, body):
            key = key[:64]
            if key not in self._ignored and len(self._ignored) < 256:  # bounded labels
                self._ignored.add(key)
                log.warning("ignoring the unknown request field %r (--unknown-fields ignore)",
                            key)
            self.metrics.unknown.labels(key if key in self._ignored else "(other)").inc()

    async def completions(self, request: Request) -> Response:
        return await self._generate("text", request)

    async def chat(self, request: Request) -> Response:
        return await self._generate("chat", request)

    async def _generate(self, kind: str, request: Request) -> Response:
        try:
            body = json.loads(await request.body() or b"{}")
            req = generate_request(kind, body, self.unknown, self.orch.tokenizer.chat_template)
            if self.unknown == "ignore":
                self._note_ignored(kind, body)
        except (ValueError, RecursionError) as e:
            return _error(_bad("body", f"the body is not JSON: {e}"))
        except RequestError as e:
            self.metrics.record(kind, error=e)
            return _error(e)
        if (body.get("n") or 1) > 1:
            return await self._choices(kind, req, body, request)
        relay = _Relay(self.orch, self.pool, req, _caller(request))
        answer = _Answer(kind, self.orch, req, body)
        if body.get("stream"):
            return await self._stream(answer, relay, request)
        return await self._complete(answer, relay, request)

    async def _choices(self, kind: str, req, body: dict, request: Request) -> Response:
        """``n`` > 1: choice i is its own request, with ``seed + i`` where a seed is given.
        Choice 0 runs first until its first token (its prompt is then in a worker's prefix
        cache and the router's index); the others start then and find the prompt there, so the
        prompt is computed about once, not n times."""
        reqs = []
        for i in range(body["n"]):
            r = type(req)()
            r.CopyFrom(req)
            if req.params.HasField("seed"):
                r.params.seed = req.params.seed + i
            reqs.append(r)
        answers = [_Answer(kind, self.orch, r, body) for r in reqs]
        relays = [_Relay(self.orch, self.pool, reqs[0], _caller(request))]
        watcher = asyncio.create_task(_watch_disconnect(request, _All(relays)))
        try:
            first = relays[0].__aiter__()
            async for msg in first:
                answers[0].take(msg)
                if msg.HasField("delta") or answers[0].final is not None:
                    break
            relays += [_Relay(self.orch, self.pool, r, _caller(request)) for r in reqs[1:]]
            await asyncio.gather(_drain(first, answers[0]),
                                 *(_drain(rl.__aiter__(), a)
                                   for rl, a in zip(relays[1:], answers[1:])))
        except RequestError as e:
            _All(relays).cancel()
            self.metrics.record(kind, error=e)
            return _error(e)
        finally:
            watcher.cancel()
        for a in answers:
            self.metrics.record(kind, a.final)
        return _json(_merge(answers))

    async def _complete(self, answer: _Answer, relay: _Relay, request: Request) -> Response:
        watcher = asyncio.create_task(_watch_disconnect(request, relay))
        try:
            async for msg in relay:
                answer.take(msg)
        except RequestError as e:
            self.metrics.record(answer.kind, error=e)
            return _error(e)
        finally:
            watcher.cancel()
        self.metrics.record(answer.kind, answer.final)
        return _json(answer.body())

    async def _stream(self, answer: _Answer, relay: _Relay, request: Request) -> Response:
        """Headers go out with the first message, once the first token is certain: an error
        before it is a plain error response; after it, an error event ends the stream."""
        messages = relay.__aiter__()
        watcher = asyncio.create_task(_watch_disconnect(request, relay))
        try:
            first = await messages.__anext__()
        except RequestError as e:
            self.metrics.record(answer.kind, error=e)
            return _error(e)
        finally:
            watcher.cancel()
        return StreamingResponse(self._events(answer, relay, first, messages),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _events(self, answer: _Answer, relay: _Relay, first, messages):
        try:
            for event in answer.opening(first):
                yield event
            async for msg in messages:
                for event in answer.events(msg):
                    yield event
            self.metrics.record(answer.kind, answer.final)
            yield b"data: [DONE]\n\n"
        except RequestError as e:
            self.metrics.record(answer.kind, error=e)
            yield _sse({"error": {"message": e.message, "type": _ERROR_TYPE.get(
                e.status, "server_error"), "code": e.status.name}})
        finally:  # also when the client went away (the response task is cancelled)
            relay.cancel()


class _Answer:
    """One request's answer in the OpenAI shapes: the whole body, or its stream's events."""

    def __init__(self, kind: str, orch: Orchestrator, req, body: dict) -> None:
        self.kind, self.tokenizer = kind, orch.tokenizer
        # as OpenAI names them: chatcmpl-... for chat, cmpl-... for completions
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id, self.created, self.model = f"{prefix}-{uuid.uuid4().hex}", int(time.time()), \
            orch.model
        self.want_lp = req.params.HasField("logprobs")
        self.want_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        # tools in play, or a reasoning model thinking under a grammar: the orchestrator splits
        # the whole answer into tool calls, content and reasoning in its final message; a
        # stream holds the text back until then (the calls go as one delta.tool_calls)
        self.split = kind == "chat" and any(answer_shape(req, orch.tokenizer.chat_template))
        self.text = ""
        self.lps: list = []
        self.final = None
        self.obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def take(self, msg) -> None:
        if msg.HasField("delta"):
            self.text += msg.delta.text
            self.lps += msg.delta.logprobs
        else:
            self.final = msg.final

    def body(self) -> dict:
        f = self.final
        assert f is not None  # the orchestrator ends every request with a final or an error
        lp = _logprobs(self.tokenizer, self.kind, self.lps) if self.want_lp else None
        reason = _finish(f.finish_reason)
        if self.kind == "chat":
            message, reason = self._message(reason)
            choice = {"index": 0, "message": message, "finish_reason": reason, "logprobs": lp}
        else:
            choice = {"index": 0, "text": self.text, "finish_reason": reason, "logprobs": lp}
        return {"id": self.id, "object": "chat.completion" if self.kind == "chat"
                else "text_completion", "created": self.created, "model": self.model,
                "choices": [choice], "usage": _usage(f),
                "baton": {"path": f.path, "retries": f.retries, "migrations": f.migrations,
                          "prefill_worker": f.prefill_worker, "decode_worker": f.decode_worker}}

    def _message(self, reason: str) -> tuple[dict, str]:
        """The assistant message (reasoning, content and tool calls as the orchestrator split
        the answer) and finish reason."""
        f = self.final
        if not self.split or f is None:
            return {"role": "assistant", "content": self.text}, reason
        extra = {"reasoning_content": f.reasoning_content} if f.reasoning_content else {}
        if not f.tool_calls:
            return {"role": "assistant", "content": f.content, **extra}, reason
        calls = [{"index": i, "id": c.id, "type": "function",
                  "function": {"name": c.name, "arguments": c.arguments}}
                 for i, c in enumerate(f.tool_calls)]
        return ({"role": "assistant", "content": f.content or None, **extra,
                 "tool_calls": calls}, "tool_calls" if reason == "stop" else reason)

    def opening(self, msg) -> list[bytes]:
        """The stream's first events: the chat role, then ``msg``'s."""
        head = [_sse(self._chunk(None, None, first=True))] if self.kind == "chat" else []
        return head + self.events(msg)

    def events(self, msg) -> list[bytes]:
        if msg.HasField("delta"):
            if self.split:  # held back: a call, or reasoning
                self.text += msg.delta.text
                return []
            return [_sse(self._chunk(msg.delta.text, None, lps=msg.delta.logprobs))]
        self.final = f = msg.final
        reason, out = _finish(f.finish_reason), []
        if self.split:
            message, reason = self._message(reason)
            if message.get("reasoning_content"):
                chunk = self._chunk(None, None)
                chunk["choices"][0]["delta"] = {"reasoning_content":
                                                message["reasoning_content"]}
                out.append(_sse(chunk))
            if message["content"]:
                out.append(_sse(self._chunk(message["content"], None)))
            if message.get("tool_calls"):
                chunk = self._chunk(None, None)
                chunk["choices"][0]["delta"] = {"tool_calls": message["tool_calls"]}
                out.append(_sse(chunk))
        out += [_sse(self._chunk(None if self.kind == "chat" else "", reason))]
        if self.want_usage:
            out.append(_sse({"id": self.id, "object": self.obj, "created": self.created,
                             "model": self.model, "choices": [], "usage": _usage(f)}))
        return out

    def _chunk(self, text: str | None, reason: str | None, first: bool = False,
               lps=()) -> dict:
        lp = _logprobs(self.tokenizer, self.kind, lps) if self.want_lp and lps else None
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if first else (
                {"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": lp}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": lp}
        return {"id": self.id, "object": self.obj, "created": self.created,
                "model": self.model, "choices": [choice]}


class _ApiKeyCheck:
    """ASGI middleware: with API keys set, /v1/* needs one as the bearer token (the OpenAI
    client's api_key); /health and /metrics stay open for probes and scrapers."""

    def __init__(self, app, keys: ApiKeys) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] != "http" or not self.keys or not scope["path"].startswith("/v1/")
                or self.keys.allows(_header(scope, b"authorization"))):
            await self.app(scope, receive, send)
            return
        await _error(RequestError(Status.UNAUTHENTICATED, "missing or wrong API key "
                                  "(Authorization: Bearer ...)"))(scope, receive, send)


def _header(scope, name: bytes) -> str | None:
    for k, v in scope["headers"]:
        if k == name:
            return v.decode("latin-1")
    return None


def _caller(request: Request) -> Caller:
    metadata = tuple((k, request.headers[k]) for k in _PROPAGATED if request.headers.get(k))
    host, port = request.client if request.client else ("", 0)
    return Caller.of(metadata, f"ipv4:{host}:{port}")


async def _not_found(request: Request, exc) -> Response:
    return _json({"error": {"message": f"no route {request.method} {request.url.path}",
                                   "type": "not_found", "param": None, "code": None}}, 404)


def _error(e: RequestError) -> Response:
    return _json({"error": {"message": e.message, "type": _ERROR_TYPE.get(
        e.status, "server_error"), "param": e.field, "code": None}},
        _HTTP_STATUS.get(e.status, 500))


def _json(obj: dict, status_code: int = 200) -> Response:
    # json.dumps as it is: a log-probability of -inf goes out as -Infinity, as OpenAI's does
    return Response(json.dumps(obj), status_code, media_type="application/json")


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _logprobs(tok, kind: str, lps) -> dict:
    """baton.v1.TokenLogprob list -> the OpenAI chat or legacy completions shape."""

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


def _finish(reason: str) -> str:
    return {"stop": "stop", "length": "length"}.get(reason, reason or "stop")


def _usage(final) -> dict:
    u = final.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {
                "cached_tokens": u.cached_tokens,
                # Baton's: where the cached tokens' KV was (the workers' pools or KV tiers)
                "cached_tokens_by_tier": {
                    "pool": max(0, u.cached_tokens - u.cached_tokens_host - u.cached_tokens_disk),
                    "host": u.cached_tokens_host, "disk": u.cached_tokens_disk}}}


# ---- the server ----------------------------------------------------------------------------------


class HttpServer:
    """uvicorn serving the front on its own thread and event loop; ``port`` is the bound one."""

    def __init__(self, front: OpenAIFront, host: str, port: int,
                 tls: tuple[str, str] | None = None) -> None:
        import uvicorn

        self._sock = socket.create_server((host, port), reuse_port=False)
        self.port = self._sock.getsockname()[1]
        cert, key = tls if tls else (None, None)
        config = uvicorn.Config(front.app(), log_level="warning", access_log=False,
                                timeout_keep_alive=30, backlog=2048, ssl_certfile=cert,
                                ssl_keyfile=key, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="openai-http", daemon=True)

    def start(self) -> HttpServer:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, let the requests in flight finish (within ``timeout``), then close
        the connections left. Those are idle keep-alive ones, and uvicorn waits for each to
        close: over TLS a close waits for the client's close_notify, up to the event loop's
        30 s SSL shutdown timeout, which a client's idle pool (httpx, the openai client) never
        sends. Without the abort every drain of an HTTPS router with such a client took its
        whole timeout."""
        deadline = time.monotonic() + timeout
        self._server.should_exit = True
        state = self._server.server_state
        # uvicorn has closed its listening sockets (no new requests) and its task set holds
        # the requests in flight
        while self._thread.is_alive() and time.monotonic() < deadline and (
                any(s.is_serving() for s in getattr(self._server, "servers", ())) or state.tasks):
            time.sleep(0.02)
        for conn in list(state.connections):
            transport = getattr(conn, "transport", None)
            if transport is not None:
                conn.loop.call_soon_threadsafe(transport.abort)
        self._thread.join(max(0.0, deadline - time.monotonic()))


def serve_http(orchestrator: Orchestrator, host: str, port: int, keys: ApiKeys | None = None,
               tls: tuple[str, str] | None = None, threads: int = 1024,
               unknown_fields: str = "refuse") -> HttpServer:
    """Start the HTTP front on its own thread; returns the server (``port`` is the bound one).
    ``tls``: (certificate file, key file) to serve HTTPS; ``unknown_fields``: refuse or ignore
    request fields the front does not know."""
    return HttpServer(OpenAIFront(orchestrator, keys, threads, unknown_fields), host, port,
                      tls).start()
