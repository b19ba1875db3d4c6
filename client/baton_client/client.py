"""``Client`` and ``AsyncClient``: Baton's public gRPC API (``baton.v1.Baton``) for applications.

    from baton_client import Client

    with Client("127.0.0.1:50051") as c:
        r = c.generate("The capital of France is", max_tokens=8)
        print(r.text, r.usage, r.path, r.timing)
        for delta in c.stream("Tell me a story", max_tokens=64):
            print(delta.text, end="", flush=True)

Every call has a deadline (``timeout``, default the client's); a request that is unavailable
before its first token is retried with backoff (``max_retries``), never after (tokens would be
repeated); failures raise the typed errors of :mod:`baton_client.errors`. Breaking out of a
stream, or calling ``cancel()``, cancels the request on the cluster and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from baton_client.errors import CancelledError, ServerError, UnavailableError, from_rpc_error
from baton_client.v1 import api_pb2, api_pb2_grpc

DEFAULT_TARGET = "127.0.0.1:50051"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class Delta:
    """One streamed piece: new text and token ids (and their logprobs when asked for)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Usage:
    prompt_tokens: int
    cached_tokens: int  # reused, not computed: from a worker's KV pool or its tiers
    completion_tokens: int
    cached_tokens_host: int = 0  # of cached_tokens, loaded back from a host-memory KV tier
    cached_tokens_disk: int = 0  # of cached_tokens, loaded back from a disk KV tier


@dataclass
class ToolCall:
    """A tool call the model made, parsed out of its answer in the model's call format."""

    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI sends it

    def parsed_arguments(self) -> dict:
        import json

        return json.loads(self.arguments)


@dataclass
class Timing:
    """Seconds, measured by the router: where the time to first token went."""

    route_s: float
    queue_s: float
    prefill_s: float
    transfer_s: float
    first_token_s: float
    first_decode_step_s: float
    decode_s: float
    total_s: float
    # before the first token, at the router: waiting for a slot (--max-concurrent), and for a
    # decode worker with room in its batch (a decode-pool shortage; not in route_s)
    admission_wait_s: float = 0.0
    decode_wait_s: float = 0.0


@dataclass
class Result:
    """A finished request."""

    text: str
    token_ids: list[int]
    finish_reason: str  # stop | length
    usage: Usage
    path: str  # remote (prefill worker -> decode worker) | local (decode worker prefilled)
    route_reason: str
    timing: Timing
    prompt_token_ids: list[int]
    prefill_worker: str
    decode_worker: str
    retries: int
    logprobs: list[TokenLogprob] = field(default_factory=list)
    request_id: str = ""  # yours, echoed
    router_request_id: str = ""  # the router's own (its logs and traces know it)
    # a chat with tools: the calls parsed out of ``text`` and the text outside them; a
    # reasoning model's thinking block under a response format or tools
    tool_calls: list[ToolCall] = field(default_factory=list)
    content: str = ""
    reasoning_content: str = ""
    transports: str = ""  # UCX transports of the KV hand-off ("" on the local path)
    # prompt tokens the prefix index said the prefilling worker holds, and whether the index
    # was read at all (False: routed on load only)
    index_cached_tokens: int = 0
    index_used: bool = False
    # remote path: KV blocks read over NIXL, and blocks the decode worker already held
    kv_blocks_read: int = 0
    kv_blocks_local: int = 0
    # times the request moved to another decode worker after tokens were streamed, and the
    # failed workers in order
    migrations: int = 0
    migrated_from: list[str] = field(default_factory=list)


def build_request(prompt: str | None = None, *, token_ids: Sequence[int] | None = None,
                  messages: Sequence[dict] | None = None, max_tokens: int = 16,
                  temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                  seed: int | None = None, stop: Sequence[str] = (),
                  stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                  logprobs: int | None = None, cache_salt: str | None = None,
                  model: str = "", request_id: str = "", presence_penalty: float = 0.0,
                  frequency_penalty: float = 0.0, repetition_penalty: float | None = None,
                  logit_bias: dict[int, float] | None = None, min_p: float = 0.0,
                  min_tokens: int = 0, response_format: dict | None = None,
                  tools: Sequence[dict] | None = None, tool_choice: str | dict | None = None,
                  parallel_tool_calls: bool | None = None) -> api_pb2.GenerateRequest:
    """The GenerateRequest for exactly one of ``prompt`` (text), ``token_ids`` or ``messages``
    (chat, ``[{"role": ..., "content": ...}]``, assistant ``tool_calls`` and ``tool``
    messages included). The sampling fields are OpenAI's and vLLM's (docs/openai.md);
    ``response_format`` is OpenAI's (``{"type": "json_schema", "json_schema": {...}}``);
    ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` OpenAI's, for chats: the result's
    ``tool_calls`` are typed."""
    given = [x is not None for x in (prompt, token_ids, messages)]
    if sum(given) != 1:
        raise ValueError("give exactly one of prompt, token_ids or messages")
    params = api_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos)
    if seed is not None:
        params.seed = seed
    if logprobs is not None:
        params.logprobs = logprobs
    if cache_salt is not None:
        params.cache_salt = cache_salt
    _processing(params, presence_penalty, frequency_penalty, repetition_penalty, logit_bias,
                min_p, min_tokens)
    # the last tokens come inside the final message: one message less per request
    req = api_pb2.GenerateRequest(params=params, model=model, request_id=request_id,
                                  last_delta_in_final=True)
    if prompt is not None:
        req.text = prompt
    elif token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    else:
        assert messages is not None
        _chat(req.chat, messages, tools, tool_choice, parallel_tool_calls)
    if response_format is not None:
        req.response_format_json = json.dumps(response_format)
    return req


def _processing(params, presence: float, frequency: float, repetition: float | None,
                bias: dict[int, float] | None, min_p: float, min_tokens: int) -> None:
    params.presence_penalty, params.frequency_penalty = presence, frequency
    if repetition is not None:
        params.repetition_penalty = repetition
    for tok, b in (bias or {}).items():
        params.logit_bias[int(tok)] = b
    params.min_p, params.min_tokens = min_p, min_tokens


def _chat(chat, messages: Sequence[dict], tools, tool_choice, parallel) -> None:
    for m in messages:
        msg = chat.messages.add(role=m["role"], content=m.get("content") or "")
        if m.get("tool_calls"):
            msg.tool_calls_json = json.dumps(m["tool_calls"])
        if m.get("tool_call_id"):
            msg.tool_call_id = m["tool_call_id"]
        if m.get("name"):
            msg.name = m["name"]
    if tools:
        chat.tools_json = json.dumps(list(tools))
    if tool_choice is not None:
        chat.tool_choice_json = json.dumps(tool_choice)
    if parallel is not None:
        chat.parallel_tool_calls = parallel


def _logprobs(lps) -> list[TokenLogprob]:
    return [TokenLogprob(lp.token_id, lp.logprob, {t.token_id: t.logprob for t in lp.top})
            for lp in lps]


def _result(final, text: str, ids: list[int], lps: list[TokenLogprob]) -> Result:
    t, u = final.timing, final.usage
    return Result(
        text=text, token_ids=ids, finish_reason=final.finish_reason,
        usage=Usage(u.prompt_tokens, u.cached_tokens, u.completion_tokens,
                    u.cached_tokens_host, u.cached_tokens_disk), path=final.path,
        route_reason=final.route_reason,
        timing=Timing(t.route_s, t.queue_s, t.prefill_s, t.transfer_s, t.first_token_s,
                      t.first_decode_step_s, t.decode_s, t.total_s, t.admission_wait_s,
                      t.decode_wait_s),
        prompt_token_ids=list(final.prompt_token_ids), prefill_worker=final.prefill_worker,
        decode_worker=final.decode_worker, retries=final.retries, logprobs=lps,
        tool_calls=[ToolCall(c.id, c.name, c.arguments) for c in final.tool_calls],
        content=final.content, reasoning_content=final.reasoning_content,
        request_id=final.request_id, router_request_id=final.router_request_id,
        transports=final.transports, index_cached_tokens=final.index_cached_tokens,
        index_used=final.index_used, kv_blocks_read=final.kv_blocks_read,
        kv_blocks_local=final.kv_blocks_local, migrations=final.migrations,
        migrated_from=list(final.migrated_from))


Metadata = Sequence[tuple[str, str]]


def _timeout(timeout: float | None, default: float) -> float:
    """``timeout`` (seconds), or ``default`` when None; anything but a positive finite number
    is refused (0 would otherwise be an instant failure, or silently the default)."""
    if timeout is None:
        return default
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) \
            or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def _call_metadata(metadata: Metadata | None) -> tuple[tuple[str, str], ...]:
    """Per-call gRPC metadata, checked here rather than failing inside gRPC: lower-case keys
    of letters, digits, ``-_.``, not ``grpc-`` (reserved) nor ``authorization`` (the client's
    ``token``); text values (a ``-bin`` key takes bytes)."""
    out = []
    for item in metadata or ():
        key, value = item
        ok = isinstance(key, str) and key and all(c in _KEY_CHARS for c in key)
        if not ok or key.startswith("grpc-") or key == "authorization":
            raise ValueError(f"metadata key {key!r}: lower-case letters, digits and -_. only, "
                             "not grpc-* nor authorization (use token=)")
        if not isinstance(value, bytes if key.endswith("-bin") else str):
            raise ValueError(f"metadata {key!r}: value must be "
                             f"{'bytes' if key.endswith('-bin') else 'str'}, got {value!r}")
        out.append((key, value))
    return tuple(out)


_KEY_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_.")


def _channel_args(tls: bool, root_certificates: bytes | None, token: str | None):
    creds = None
    if tls:
        creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    return creds, metadata


_inject: Callable | bool | None = None  # opentelemetry's inject, once looked up; False: none


def _trace_metadata() -> tuple:
    """The caller's current OpenTelemetry context as W3C trace-context metadata, so that the
    cluster's spans join the caller's trace (nothing without OpenTelemetry installed)."""
    global _inject
    if _inject is None:
        try:
            from opentelemetry.propagate import inject as found
        except ImportError:
            _inject = False
        else:
            _inject = found
    if not callable(_inject):
        return ()
    carrier: dict[str, str] = {}
    _inject(carrier)
    return tuple(carrier.items())


def _finished(stream) -> Result:
    """An exhausted stream's result; a stream that ended without its final message is the
    server's fault, never an empty success."""
    if stream.result is None:
        raise ServerError(grpc.StatusCode.INTERNAL, "the stream ended without a final message")
    return stream.result


class _Collector:
    """Accumulates deltas into the final Result."""

    def __init__(self) -> None:
        self.text = ""
        self.ids: list[int] = []
        self.lps: list[TokenLogprob] = []
        self.result: Result | None = None
        self.started = False

    def add(self, msg) -> Delta | None:
        """The delta ``msg`` carries (a final message may carry the last one), or None."""
        if msg.HasField("delta"):
            return self._delta(msg.delta)
        delta = self._delta(msg.final.last_delta) if msg.final.HasField("last_delta") else None
        self.result = _result(msg.final, self.text, self.ids, self.lps)
        return delta

    def _delta(self, d) -> Delta:
        self.started = True
        delta = Delta(d.text, list(d.token_ids), _logprobs(d.logprobs))
        self.text += delta.text
        self.ids += delta.token_ids
        self.lps += delta.logprobs
        return delta


def _retry_delay(e: grpc.RpcError, col: _Collector, attempt: int, client,
                 deadline: float) -> float:
    """Seconds to wait before retry number ``attempt``; raises the typed error instead when a
    retry is not safe (not UNAVAILABLE, or a token already reached the caller) or none is left.
    """
    err = from_rpc_error(e)
    if not isinstance(err, UnavailableError) or col.started or attempt > client.max_retries:
        raise err from None
    return min(client.backoff_s * 2 ** (attempt - 1), max(deadline - time.monotonic(), 0))


class _Attempts:
    """What the sync and async streams share: one request's deadline, metadata and collected
    output, each attempt's call (a new one per retry) and the wait before the next attempt.
    The subclasses only drive the calls, blocking or awaiting."""

    def __init__(self, client, request, timeout: float, metadata: Metadata | None = None) -> None:
        self._client, self._request = client, request
        self._deadline = time.monotonic() + timeout
        self._metadata = client._metadata + _call_metadata(metadata) + _trace_metadata()
        self._col = _Collector()
        self._call = None
        self._attempt = 0
        self._gen = self._run()

    @property
    def result(self) -> Result | None:
        return self._col.result

    def _start(self):
        """This attempt's call, with what is left of the deadline."""
        left = self._deadline - time.monotonic()
        self._call = self._client._stub.Generate(self._request, timeout=max(left, 0.001),
                                                  metadata=self._metadata)
        return self._call

    def _backoff(self, e: grpc.RpcError) -> float:
        """Seconds before the next attempt; raises the typed error when none may be made."""
        self._attempt += 1
        return _retry_delay(e, self._col, self._attempt, self._client, self._deadline)

    def _run(self):
        raise NotImplementedError


class Stream(_Attempts):
    """Iterator of :class:`Delta`; ``result`` is set once it is exhausted. Closing it early
    (``break``, ``close()``, ``cancel()``, leaving a ``with`` block) cancels the request."""

    def __iter__(self) -> Iterator[Delta]:
        return self

    def __next__(self) -> Delta:
        return next(self._gen)

    def _run(self) -> Iterator[Delta]:
        while True:
            call = self._start()
            try:
                for msg in call:
                    delta = self._col.add(msg)
                    if delta is not None:
                        yield delta
                return
            except grpc.RpcError as e:
                time.sleep(self._backoff(e))
            finally:
                call.cancel()  # no-op when it finished; frees the request otherwise

    def cancel(self) -> None:
        if self._call is not None:
            self._call.cancel()
        self._gen.close()

    close = cancel

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


class Client:
    """Synchronous client. ``tls=True`` uses TLS (``root_certificates``: PEM bytes of the CA,
    default the system's); ``token`` is sent as ``authorization: Bearer <token>``."""

    def __init__(self, target: str = DEFAULT_TARGET, *, tls: bool = False,
                 root_certificates: bytes | None = None, token: str | None = None,
                 timeout: float = 600.0, max_retries: int = 2, backoff_s: float = 0.2,
                 options: Sequence[tuple[str, object]] = ()) -> None:
        creds, self._metadata = _channel_args(tls, root_certificates, token)
        self._channel = (grpc.secure_channel(target, creds, options=list(options)) if creds
                         else grpc.insecure_channel(target, options=list(options)))
        self._stub = api_pb2_grpc.BatonStub(self._channel)
        self.timeout = _timeout(timeout, 600.0)
        self.max_retries, self.backoff_s = max_retries, backoff_s

    def stream(self, prompt: str | None = None, *, timeout: float | None = None,
               metadata: Metadata | None = None, **kwargs) -> Stream:
        """Stream a completion; keyword arguments as :func:`build_request`. ``timeout``:
        seconds for the whole request, retries included (None: the client's); ``metadata``:
        this call's gRPC metadata, ``[(key, value), ...]``."""
        return Stream(self, build_request(prompt, **kwargs), _timeout(timeout, self.timeout),
                      metadata)

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 metadata: Metadata | None = None, **kwargs) -> Result:
        """The whole completion at once (streamed underneath)."""
        s = self.stream(prompt, timeout=timeout, metadata=metadata, **kwargs)
        for _ in s:
            pass
        return _finished(s)

    def chat(self, messages: Sequence[dict], *, stream: bool = False, **kwargs):
        """Chat messages rendered with the model's template; a Stream or a Result."""
        if stream:
            return self.stream(messages=messages, **kwargs)
        return self.generate(messages=messages, **kwargs)

    def models(self, timeout: float = 30.0,
               metadata: Metadata | None = None) -> list[api_pb2.ModelCard]:
        try:
            return list(self._stub.ListModels(
                api_pb2.ListModelsRequest(), timeout=_timeout(timeout, 30.0),
                metadata=self._metadata + _call_metadata(metadata)).models)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncStream(_Attempts):
    """Async iterator of :class:`Delta` (``async for``); ``result`` once exhausted;
    ``cancel()`` or ``aclose()`` cancels the request."""

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self

    async def __anext__(self) -> Delta:
        return await self._gen.__anext__()

    async def _run(self) -> AsyncIterator[Delta]:
        while True:
            call = self._start()
            try:
                async for msg in call:
                    delta = self._col.add(msg)
                    if delta is not None:
                        yield delta
                return
            except grpc.RpcError as e:
                await asyncio.sleep(self._backoff(e))
            finally:  # also on asyncio.CancelledError: frees the request
                call.cancel()

    def cancel(self) -> None:
        if self._call is not None:
            self._call.cancel()

    async def aclose(self) -> None:
        self.cancel()
        await self._gen.aclose()


class AsyncClient:
    """asyncio client (grpc.aio); same arguments and methods as :class:`Client`, awaitable."""

    def __init__(self, target: str = DEFAULT_TARGET, *, tls: bool = False,
                 root_certificates: bytes | None = None, token: str | None = None,
                 timeout: float = 600.0, max_retries: int = 2, backoff_s: float = 0.2,
                 options: Sequence[tuple[str, object]] = ()) -> None:
        creds, self._metadata = _channel_args(tls, root_certificates, token)
        self._channel = (grpc.aio.secure_channel(target, creds, options=list(options)) if creds
                         else grpc.aio.insecure_channel(target, options=list(options)))
        self._stub = api_pb2_grpc.BatonStub(self._channel)
        self.timeout = _timeout(timeout, 600.0)
        self.max_retries, self.backoff_s = max_retries, backoff_s

    def stream(self, prompt: str | None = None, *, timeout: float | None = None,
               metadata: Metadata | None = None, **kwargs) -> AsyncStream:
        return AsyncStream(self, build_request(prompt, **kwargs),
                           _timeout(timeout, self.timeout), metadata)

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                       metadata: Metadata | None = None, **kwargs) -> Result:
        s = self.stream(prompt, timeout=timeout, metadata=metadata, **kwargs)
        async for _ in s:
            pass
        return _finished(s)

    async def chat(self, messages: Sequence[dict], *, stream: bool = False, **kwargs):
        if stream:
            return self.stream(messages=messages, **kwargs)
        return await self.generate(messages=messages, **kwargs)

    async def models(self, timeout: float = 30.0,
                     metadata: Metadata | None = None) -> list[api_pb2.ModelCard]:
        try:
            resp = await self._stub.ListModels(
                api_pb2.ListModelsRequest(), timeout=_timeout(timeout, 30.0),
                metadata=self._metadata + _call_metadata(metadata))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return list(resp.models)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


__all__ = ["AsyncClient", "AsyncStream", "CancelledError", "Client", "Delta", "Result",
           "Stream", "Timing", "TokenLogprob", "Usage", "build_request"]
