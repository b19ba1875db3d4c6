"""The router: Baton's public gRPC API in front of the prefill and decode pools.

``python -m baton.services.router --redis-url URL [--port 50051]``. Per request: validate and
tokenize (the workers' own tokenizer, fetched from one of them at start-up), choose the path,
call the workers, relay the stream, end with usage, path and timings::

    remote: Prefill on a prefill worker ─handle─► Decode on a decode worker (KV by NIXL) ─► client
    local:  Generate on a decode worker (it prefills itself) ───────────────────────────► client

Which workers, and which path, ``baton.services.router.routing`` decides from the Redis prefix
index (how much of the prompt each worker's KV cache holds) and the load (requests in flight,
counted across routers in Redis; queues; KV usage). The final message says which path was taken
and why. Nothing reaches the client
before the decode worker's first chunk, so a worker that is unavailable (down, killed, draining)
before that is retried on another one (``--max-retries``); after it, a failure ends the stream
with a typed status, never a truncated success. The client's deadline bounds every call, and a
client that goes away cancels the calls in flight, which frees the request's blocks on every
worker. Imports no torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time
import uuid
from contextlib import contextmanager

import grpc
from baton.control.prefix_index import PrefixIndex
from baton.control.registry import Registration, RouterRecord, WorkerRecord, WorkerRegistry
from baton.engine.errors import InvalidRequestError
from baton.engine.tokenizer import BatonTokenizer
from baton.services.common import tracing
from baton.services.common.metrics import RouterMetrics
from baton.services.common.worker import (
    abort_with,
    add_standard_services,
    advertised_host,
    announce,
    make_server,
    new_incarnation,
    params_from_proto,
    serve_forever,
    setup_logging,
)
from baton.services.router.routing import (
    DEFAULT_WEIGHTS,
    MODES,
    Decision,
    NoWorkerError,
    RoutingPolicy,
    parse_weights,
)
from baton.v1 import api_pb2, api_pb2_grpc, worker_pb2, worker_pb2_grpc
from redis.exceptions import RedisError

log = logging.getLogger("baton.services.router")

DEFAULT_TIMEOUT_S = 600.0


class WorkerPool:
    """Live workers from the registry (re-read at most every ``refresh_s``), one channel per
    address, and the router's own count of requests in flight on each (least-loaded first)."""

    def __init__(self, registry: WorkerRegistry, refresh_s: float = 1.0) -> None:
        self.registry, self.refresh_s = registry, refresh_s
        self._workers: list[WorkerRecord] = []
        self._read_at = 0.0
        self._channels: dict[str, grpc.Channel] = {}
        self._inflight: dict[str, int] = {}
        self._registry_ok = True
        self._lock = threading.Lock()

    def workers(self, role: str | None = None) -> list[WorkerRecord]:
        with self._lock:
            if time.monotonic() - self._read_at > self.refresh_s:
                try:
                    self._workers = self.registry.workers()
                except (RedisError, OSError) as e:  # keep routing to the workers last seen
                    if self._registry_ok:
                        log.warning("worker registry unreadable (%s); using the %d workers "
                                    "last seen", e, len(self._workers))
                    self._registry_ok = False
                else:
                    if not self._registry_ok:
                        log.info("worker registry readable again")
                    self._registry_ok = True
                self._read_at = time.monotonic()
            ws = self._workers
        return [w for w in ws if role is None or w.role == role or
                (w.role == "both" and role != "both")]

    def inflight(self, address: str) -> int:
        """Requests this router has in flight on ``address``."""
        return self._inflight.get(address, 0)

    def channel(self, address: str) -> grpc.Channel:
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = grpc.insecure_channel(address)
            return ch

    @contextmanager
    def busy(self, address: str):
        with self._lock:
            self._inflight[address] = self._inflight.get(address, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._inflight[address] -= 1

    def forget(self, if_older_than: float = 0.0) -> bool:
        """Re-read the registry on the next pick (a worker just failed, or none was found), if
        the last read is older than ``if_older_than`` seconds; whether it will be."""
        with self._lock:
            if time.monotonic() - self._read_at < if_older_than:
                return False
            self._read_at = 0.0
            return True


class _Retry(Exception):
    """A worker was unavailable before anything reached the client: try another."""

    def __init__(self, address: str, detail: str) -> None:
        super().__init__(detail)
        self.address = address


class RouterService(api_pb2_grpc.BatonServicer):
    def __init__(self, pool: WorkerPool, tokenizer: BatonTokenizer, model: str,
                 max_model_len: int, fingerprint: str, policy: RoutingPolicy | None = None,
                 max_retries: int = 2) -> None:
        self.pool, self.tokenizer, self.model = pool, tokenizer, model
        self.max_model_len, self.fingerprint = max_model_len, fingerprint
        self.policy = policy or RoutingPolicy(pool, None)
        self.max_retries = max_retries
        self.metrics = RouterMetrics(self.policy.index)

    # ---- API -------------------------------------------------------------------------------------

    def ListModels(self, request, context):
        return api_pb2.ListModelsResponse(models=[api_pb2.ModelCard(
            id=self.model, max_model_len=self.max_model_len, fingerprint=self.fingerprint)])

    def Generate(self, request, context):
        t0 = time.monotonic()
        rid = request.request_id or uuid.uuid4().hex
        span = tracing.NO_SPAN
        if tracing.enabled():
            span = tracing.server_span(context, *_request_span(request, self.model, rid), at=t0)
        ended = False
        try:
            for msg in self._generate(request, context, t0, rid, span):
                if msg.HasField("final"):
                    ended = True
                    self.metrics.finished(msg.final)
                    span.set(_final_attrs(msg.final))
                yield msg
        finally:
            if ended:
                span.end()
            else:
                code = getattr(context, "code", lambda: None)()
                status = (code.name if isinstance(code, grpc.StatusCode)
                          else "CANCELLED" if not context.is_active() else "ERROR")
                self.metrics.failed(status)
                span.end(error=status)

    def _generate(self, request, context, t0: float, rid: str, span):
        try:
            ids = self._prompt_ids(request)
            params_from_proto(request.params)  # validation only: the workers get the proto
        except InvalidRequestError as e:
            abort_with(context, e)
        calls: list = []  # outbound calls in flight, cancelled if the client goes away
        context.add_callback(lambda: [c.cancel() for c in list(calls)])
        failed: set[str] = set()
        hashes = None
        for attempt in range(self.max_retries + 1):
            # a retry is a new request on the workers (the failed attempt may still be known)
            state = _State(rid if attempt == 0 else f"{rid}.retry{attempt}", ids, t0, attempt,
                           self.metrics, span)
            try:
                t = time.monotonic()
                if hashes is None and self.policy.mode != "round-robin":
                    workers = self.pool.workers()
                    bs = workers[0].block_size if workers else 16
                    salt = (request.params.cache_salt if request.params.HasField("cache_salt")
                            else None)
                    hashes = self.policy.prompt_hashes(ids, self.fingerprint, salt, bs)
                try:
                    decision = self.policy.decide(ids, hashes, failed)
                except NoWorkerError:  # the registry read may predate a worker's start
                    if not self.pool.forget(if_older_than=0.1):
                        raise
                    decision = self.policy.decide(ids, hashes, failed)
                state.route(decision, t, time.monotonic())
                self.metrics.routed(decision)
                yield from self._attempt(request, state, decision, calls, context)
                return
            except _Retry as e:
                span.event("baton.retry", {"baton.worker.address": e.address,
                                           "baton.retry.reason": str(e)})
                failed.add(e.address)
                self.pool.forget()
                log.warning("request %s: %s; retrying elsewhere (attempt %d)", rid, e,
                            attempt + 1)
                if not context.is_active():
                    return
            except NoWorkerError as e:
                context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        context.abort(grpc.StatusCode.UNAVAILABLE,
                      f"every attempt failed on an unavailable worker ({sorted(failed)})")

    def _attempt(self, request, st, decision: Decision, calls, context):
        """One attempt on the decided workers, counted in flight on them (in Redis too)."""
        workers = [w for w in (decision.prefill, decision.decode) if w is not None]
        index = self.policy.index
        if index is not None:
            index.claim(st.rid, [w.worker_id for w in workers])
        try:
            if decision.path == "remote":
                yield from self._remote(request, st, decision.prefill, decision.decode, calls,
                                        context)
            else:
                yield from self._local(request, st, decision.decode, calls, context)
        finally:
            if index is not None:
                index.release(st.rid)

    # ---- paths -----------------------------------------------------------------------------------

    def _remote(self, request, st, prefill, decode, calls, context):
        st.prefill_worker = prefill.worker_id
        p = request.params
        t = time.monotonic()
        with self.pool.busy(prefill.address):
            cs = _call_span(st.span, prefill, "PrefillWorker", "Prefill")
            fut = worker_pb2_grpc.PrefillWorkerStub(self.pool.channel(prefill.address)).Prefill \
                .future(worker_pb2.PrefillRequest(request_id=st.rid, prompt_token_ids=st.ids,
                                                  params=p), timeout=_left(context),
                        metadata=cs.metadata())
            calls.append(fut)
            try:
                pre = fut.result()
            except grpc.RpcError as e:
                cs.end(error=e.code())
                _fail(e, prefill.address, context, sent=False)
            finally:
                calls.remove(fut)
            cs.end()
        st.prefill_s = time.monotonic() - t
        st.queue_s = pre.queue_s
        st.cached = pre.num_cached_tokens
        first_lp = [pre.first_logprob] if pre.HasField("first_logprob") else []
        if pre.finish_reason:  # the first token ended the request: nothing to hand off
            st.tokens.append(pre.first_token_id)
            text = self.tokenizer.decode([pre.first_token_id])
            yield st.delta([pre.first_token_id], text, first_lp)
            yield st.final(pre.finish_reason, "remote")
            return
        st.first_logprob = first_lp
        try:
            yield from self._stream(
                decode, "remote", st, calls, context,
                lambda stub, md: stub.Decode(worker_pb2.DecodeRequest(
                    request_id=st.rid, prompt_token_ids=st.ids,
                    first_token_id=pre.first_token_id, params=p, handle=pre.handle,
                    sampler_state=pre.sampler_state), timeout=_left(context), metadata=md))
        except _Retry:
            self._give_back(prefill.address, pre.handle)  # free the blocks now, not at expiry
            raise

    def _give_back(self, address: str, handle) -> None:
        try:
            worker_pb2_grpc.KVSourceStub(self.pool.channel(address)).ReleaseLease(
                worker_pb2.ReleaseLeaseRequest(lease_id=handle.lease_id,
                                               incarnation=handle.incarnation), timeout=2)
        except grpc.RpcError as e:
            log.info("could not give lease %s back to %s: %s", handle.lease_id, address,
                     e.code())

    def _local(self, request, st, decode, calls, context):
        p = request.params
        yield from self._stream(
            decode, "local", st, calls, context,
            lambda stub, md: stub.Generate(worker_pb2.LocalRequest(
                request_id=st.rid, prompt_token_ids=st.ids, params=p), timeout=_left(context),
                metadata=md))

    def _stream(self, decode, path, st, calls, context, start):
        st.decode_worker = decode.worker_id
        method = "Decode" if path == "remote" else "Generate"
        with self.pool.busy(decode.address):
            cs = _call_span(st.span, decode, "DecodeWorker", method)
            call = start(worker_pb2_grpc.DecodeWorkerStub(self.pool.channel(decode.address)),
                         cs.metadata())
            calls.append(call)
            reason = ""
            try:
                for chunk in call:
                    if chunk.HasField("transfer"):
                        t = chunk.transfer
                        st.transfer_s = t.handshake_s + t.read_s + t.release_s
                        st.blocks_read, st.blocks_local = t.blocks_read, t.blocks_local
                        st.transports = t.transports
                        st.span.set({"baton.kv.bytes": t.bytes})
                    if chunk.num_cached_tokens:
                        st.cached = chunk.num_cached_tokens
                    if chunk.queue_s:
                        st.queue_s = chunk.queue_s
                    lps = list(chunk.logprobs)
                    if not st.tokens and st.first_logprob and len(lps) < len(chunk.token_ids):
                        lps = st.first_logprob + lps  # the hand-off's first token: prefill's
                    st.tokens.extend(chunk.token_ids)
                    yield st.delta(chunk.token_ids, chunk.text, lps)
                    reason = chunk.finish_reason or reason
            except grpc.RpcError as e:
                cs.end(error=e.code())
                _fail(e, decode.address, context, sent=st.sent)
            finally:
                calls.remove(call)
            cs.end()
        if not reason:  # the stream ended without a finish: never report that as success
            context.abort(grpc.StatusCode.INTERNAL,
                          f"decode worker {decode.worker_id} ended the stream unfinished")
        yield st.final(reason, path)

    # ---- input -----------------------------------------------------------------------------------

    def _prompt_ids(self, request) -> list[int]:
        if request.model and request.model != self.model:
            raise InvalidRequestError("model", request.model, f"this cluster serves {self.model!r}")
        kind = request.WhichOneof("input")
        if kind == "text":
            if not request.text:
                raise InvalidRequestError("text", "", "the prompt is empty")
            ids = self.tokenizer.encode(request.text)
        elif kind == "token_ids":
            ids = list(request.token_ids.ids)
        elif kind == "chat":
            msgs = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            if not msgs:
                raise InvalidRequestError("chat.messages", [], "must not be empty")
            for i, m in enumerate(msgs):
                if m["role"] not in ("system", "user", "assistant", "tool"):
                    raise InvalidRequestError(f"chat.messages[{i}].role", m["role"],
                                              "must be system, user, assistant or tool")
            ids = self.tokenizer.encode_chat(msgs)
        else:
            raise InvalidRequestError("input", None, "give text, token_ids or chat")
        if not ids:
            raise InvalidRequestError("prompt", "", "the prompt has no tokens")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError("prompt", f"<{len(ids)} tokens>",
                                      f"does not fit the context length {self.max_model_len}")
        return ids


class _State:
    """One attempt's progress: what was sent and the timings for the final message."""

    def __init__(self, rid: str, ids: list[int], t0: float, attempt: int,
                 metrics=None, span=tracing.NO_SPAN) -> None:
        self.rid, self.ids, self.t0, self.attempt = rid, ids, t0, attempt
        self.metrics, self.last_at, self.span = metrics, None, span
        self.tokens: list[int] = []
        self.sent = False
        self.cached = 0
        self.prefill_s = self.transfer_s = 0.0
        self.first_at: float | None = None
        self.transports = self.prefill_worker = self.decode_worker = ""
        self.first_logprob: list = []
        self.route_s = self.queue_s = 0.0
        self.second_at: float | None = None  # when the token after the first one was sent
        self.decision: Decision | None = None
        self.blocks_read = self.blocks_local = 0

    def route(self, decision: Decision, start: float, end: float) -> None:
        self.decision, self.route_s = decision, end - start
        if self.span.recording:
            d = decision
            self.span.child("baton.route", attrs={
                "baton.route.path": d.path, "baton.route.reason": d.reason,
                "baton.route.index_used": d.used_index,
                "baton.route.cached_tokens": d.cached_tokens,
                "baton.prefill.worker": d.prefill.worker_id if d.prefill else None,
                "baton.decode.worker": d.decode.worker_id if d.decode else None,
                "baton.attempt": self.attempt}, at=start).end(at=end)

    def delta(self, token_ids, text, logprobs=()):
        now = time.monotonic()
        if self.first_at is None:
            self.first_at = now
        elif self.second_at is None and token_ids:
            self.second_at = now
        if self.last_at is not None and self.metrics is not None:
            self.metrics.itl.observe(now - self.last_at)
        self.last_at = now
        self.sent = True
        return api_pb2.GenerateResponse(delta=api_pb2.GenerateDelta(
            text=text, token_ids=token_ids, logprobs=logprobs))

    def final(self, reason: str, path: str):
        now = time.monotonic()
        first = self.first_at or now
        d = self.decision
        return api_pb2.GenerateResponse(final=api_pb2.GenerateFinal(
            finish_reason=reason, path=path, prefill_worker=self.prefill_worker,
            decode_worker=self.decode_worker, transports=self.transports, retries=self.attempt,
            prompt_token_ids=self.ids, route_reason=d.reason if d else "",
            index_cached_tokens=d.cached_tokens if d else 0,
            index_used=d.used_index if d else False, kv_blocks_read=self.blocks_read,
            kv_blocks_local=self.blocks_local,
            usage=api_pb2.Usage(prompt_tokens=len(self.ids), cached_tokens=self.cached,
                                completion_tokens=len(self.tokens)),
            timing=api_pb2.Timing(prefill_s=self.prefill_s, transfer_s=self.transfer_s,
                                  first_token_s=first - self.t0, decode_s=now - first,
                                  total_s=now - self.t0, route_s=self.route_s,
                                  queue_s=self.queue_s,
                                  first_decode_step_s=(self.second_at - first
                                                       if self.second_at else 0.0))))


def _request_span(request, model: str, rid: str) -> tuple[str, dict]:
    """The request span's name and attributes (OpenTelemetry GenAI conventions, plus Baton's)."""
    op = "chat" if request.WhichOneof("input") == "chat" else "text_completion"
    p = request.params
    return f"{op} {model}", {
        "gen_ai.operation.name": op, "gen_ai.provider.name": "baton",
        "gen_ai.request.model": request.model or model,
        "gen_ai.request.max_tokens": p.max_tokens if p.HasField("max_tokens") else 16,
        "gen_ai.request.temperature": p.temperature,
        "gen_ai.request.top_p": p.top_p if p.HasField("top_p") else None,
        "gen_ai.request.top_k": p.top_k or None,
        "gen_ai.request.seed": p.seed if p.HasField("seed") else None,
        "gen_ai.request.stop_sequences": list(p.stop) or None,
        "gen_ai.response.id": rid, "gen_ai.response.model": model,
        "baton.request_id": rid}


def _final_attrs(f) -> dict:
    t, u = f.timing, f.usage
    return {"gen_ai.response.finish_reasons": [f.finish_reason],
            "gen_ai.usage.input_tokens": u.prompt_tokens,
            "gen_ai.usage.output_tokens": u.completion_tokens,
            "baton.usage.cached_tokens": u.cached_tokens, "baton.path": f.path,
            "baton.route.reason": f.route_reason, "baton.retries": f.retries,
            "baton.prefill.worker": f.prefill_worker or None,
            "baton.decode.worker": f.decode_worker or None,
            "baton.kv.blocks_read": f.kv_blocks_read, "baton.kv.blocks_local": f.kv_blocks_local,
            "baton.kv.transport": f.transports or None,
            "baton.timing.route_s": t.route_s, "baton.timing.queue_s": t.queue_s,
            "baton.timing.prefill_s": t.prefill_s, "baton.timing.transfer_s": t.transfer_s,
            "baton.timing.first_token_s": t.first_token_s,
            "baton.timing.first_decode_step_s": t.first_decode_step_s,
            "baton.timing.total_s": t.total_s}


def _call_span(span, worker: WorkerRecord, service: str, method: str):
    """The client span of a call to a worker, under the request's ``span``."""
    if not span.recording:
        return tracing.NO_SPAN
    host, _, port = worker.address.rpartition(":")
    return span.child(f"baton.v1.{service}/{method}", "client", {
        "rpc.system": "grpc", "rpc.service": f"baton.v1.{service}", "rpc.method": method,
        "server.address": host, "server.port": int(port) if port.isdigit() else None,
        "baton.worker.id": worker.worker_id})


def _left(context) -> float:
    left = context.time_remaining()
    return DEFAULT_TIMEOUT_S if left is None else max(left, 0.001)


def _fail(e: grpc.RpcError, address: str, context, sent: bool):
    """A worker call failed: retry elsewhere if nothing was sent and the worker was unavailable;
    otherwise end the client's stream with the worker's status (raises either way)."""
    code = e.code()
    if code == grpc.StatusCode.CANCELLED and not context.is_active():
        raise _Retry(address, "client went away")  # the loop sees the inactive context
    if not sent and code == grpc.StatusCode.UNAVAILABLE:
        raise _Retry(address, f"{address} unavailable: {e.details()}")
    if sent and code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        context.abort(grpc.StatusCode.UNAVAILABLE,
                      f"worker {address} failed after tokens were streamed: {e.details()}")
    context.abort(code, e.details() or code.name)


class TokenAuth(grpc.ServerInterceptor):
    """Every call but health checks (probes cannot send tokens) needs
    ``authorization: Bearer <token>`` metadata; others end UNAUTHENTICATED."""

    OPEN = ("/grpc.health.v1.Health/",)

    def __init__(self, token: str) -> None:
        import hmac

        self._ok = lambda v: hmac.compare_digest(v.encode(), f"Bearer {token}".encode())

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong token (authorization: Bearer ...)")
        self._deny = deny

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


def fetch_tokenizer(pool: WorkerPool, timeout: float) -> worker_pb2.TokenizerResponse:
    """Ask a registered worker for its tokenizer; waits until one is registered and serving."""
    end = time.monotonic() + timeout
    while True:
        for w in pool.workers():
            ch = pool.channel(w.address)
            stub = (worker_pb2_grpc.PrefillWorkerStub(ch) if w.role == "prefill"
                    else worker_pb2_grpc.DecodeWorkerStub(ch))
            try:
                return stub.Tokenizer(worker_pb2.InfoRequest(), timeout=10), w
            except grpc.RpcError as e:
                log.info("tokenizer from %s: %s", w.address, e.code())
        if time.monotonic() > end:
            raise SystemExit(f"no worker answered within {timeout}s; is the registry right?")
        pool.forget()
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m baton.services.router",
        description="Baton router: the public gRPC API (baton.v1.Baton) in front of the prefill "
                    "and decode workers registered in Redis.")
    ap.add_argument("--redis-url", required=True,
                    help="Redis: the worker registry, the prefix index, shared in-flight counts")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--advertise-host", default=os.environ.get("BATON_ADVERTISE_HOST"),
                    help="address this router registers in Redis for `baton status` (default "
                         "$BATON_ADVERTISE_HOST, else --host, else this host's IP when --host "
                         "is 0.0.0.0)")
    ap.add_argument("--port", type=int, default=50051, help="gRPC port (0: pick a free one)")
    ap.add_argument("--http-port", type=int, default=8000,
                    help="OpenAI-compatible HTTP port (0: pick a free one, -1: no HTTP)")
    g = ap.add_argument_group("routing")
    g.add_argument("--routing", choices=MODES, default="cache-aware",
                   help="cache-aware: score workers on the Redis prefix index and load; "
                        "least-loaded: load only; round-robin: in turn, cache-blind "
                        "(default cache-aware)")
    g.add_argument("--scorers", default=DEFAULT_WEIGHTS,
                   help="scorer weights, name=weight,...: prefix (share of the prompt's blocks "
                        "the worker holds), inflight (requests in flight, all routers), queue "
                        "(the worker's waiting requests), kv (free KV blocks) "
                        f"(default {DEFAULT_WEIGHTS})")
    g.add_argument("--local-prefill-max-tokens", type=int, default=64,
                   help="the chosen decode worker prefills the prompt itself when it lacks at "
                        "most this many of its tokens (prefix-cache hits excluded); more go "
                        "to a prefill worker (default 64; 0: always a prefill worker if any)")
    g.add_argument("--prefill-saturation", type=int, default=8,
                   help="a prefill worker with this many requests in flight plus queued is "
                        "saturated; when all are, decode workers prefill locally (0: never) "
                        "(default 8)")
    g.add_argument("--inflight-ttl", type=float, default=30.0,
                   help="seconds a router's in-flight entries in Redis outlive the router "
                        "(re-armed while it runs) (default 30)")
    ap.add_argument("--max-retries", type=int, default=2,
                    help="other workers to try when one is unavailable before the first token")
    ap.add_argument("--startup-timeout", type=float, default=300.0,
                    help="seconds to wait for a first worker to register")
    ap.add_argument("--drain-timeout", type=float, default=30.0)
    ap.add_argument("--log-level", default="INFO")
    sec = ap.add_argument_group("security")
    sec.add_argument("--auth-token", default=os.environ.get("BATON_AUTH_TOKEN"),
                     help="require 'authorization: Bearer TOKEN' on gRPC calls and "
                          "'Authorization: Bearer TOKEN' (the OpenAI api_key) on /v1/*; health "
                          "checks and /metrics stay open (default $BATON_AUTH_TOKEN)")
    sec.add_argument("--tls-cert", default=None, help="PEM certificate: serve gRPC and HTTP "
                                                      "over TLS (with --tls-key)")
    sec.add_argument("--tls-key", default=None, help="PEM private key for --tls-cert")
    args = ap.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        ap.error("--tls-cert and --tls-key go together")
    try:
        weights = parse_weights(args.scorers)
    except ValueError as e:
        ap.error(f"--scorers: {e}")
    setup_logging(args.log_level)
    import redis

    # short timeouts: a Redis that hangs must not stall routing (the index degrades instead)
    client = redis.Redis.from_url(args.redis_url, socket_timeout=0.5, socket_connect_timeout=0.5)
    pool = WorkerPool(WorkerRegistry(client))
    tok, worker = fetch_tokenizer(pool, args.startup_timeout)
    interceptors = [TokenAuth(args.auth_token)] if args.auth_token else []
    server = make_server(max_workers=256, interceptors=interceptors)
    if args.tls_cert:
        with open(args.tls_cert, "rb") as c, open(args.tls_key, "rb") as k:
            creds = grpc.ssl_server_credentials([(k.read(), c.read())])
        port = server.add_secure_port(f"{args.host}:{args.port}", creds)
    else:
        port = server.add_insecure_port(f"{args.host}:{args.port}")
    router_id = f"router-{args.host}-{port}-{new_incarnation()}"
    tracing.setup("router", router_id)
    index = (PrefixIndex(client, router_id, args.inflight_ttl)
             if args.routing == "cache-aware" else None)
    policy = RoutingPolicy(pool, index, mode=args.routing, weights=weights,
                           local_max_new_tokens=args.local_prefill_max_tokens,
                           prefill_saturation=args.prefill_saturation)
    policy.prompt_hashes([0] * 256, worker.fingerprint, None, 16)  # builds the native hasher
    service = RouterService(pool, BatonTokenizer.from_json(json.loads(tok.tokenizer_json)),
                            tok.model, tok.max_model_len, worker.fingerprint, policy,
                            args.max_retries)
    api_pb2_grpc.add_BatonServicer_to_server(service, server)
    health = add_standard_services(server, ["baton.v1.Baton"])
    server.start()
    address = f"{args.host}:{port}"
    http_address = ""
    log.info("router serving %s on %s (workers from %s)", tok.model, address, args.redis_url)
    if args.http_port >= 0:
        from baton.services.router.openai_http import serve_http

        http = serve_http(service, args.host, args.http_port, token=args.auth_token,
                          tls=(args.tls_cert, args.tls_key) if args.tls_cert else None)
        http_address = f"{args.host}:{http.server_address[1]}"
        log.info("OpenAI-compatible HTTP on %s://%s/v1", "https" if args.tls_cert else "http",
                 http_address)
        print(f"BATON_HTTP {http_address}", flush=True)
    # in the registry for `baton status` (routers do not route to each other)
    host = advertised_host(args)
    registration = Registration(WorkerRegistry(client), RouterRecord(
        router_id, f"{host}:{port}",
        f"{host}:{http_address.rsplit(':', 1)[1]}" if http_address else "", tok.model,
        tls=bool(args.tls_cert))).start()
    announce(address, f"router-{args.host}-{port}", new_incarnation())
    serve_forever(server, tracing.shutdown, registration, args.drain_timeout, health=health)


if __name__ == "__main__":
    main()
