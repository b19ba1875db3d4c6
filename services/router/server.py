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
import hashlib
import json
import logging
import math
import os
import threading
import time
import uuid
from contextlib import contextmanager

import grpc
import grpc.experimental
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
from baton.services.router.limits import (
    Admission,
    ApiKeys,
    LimitExceededError,
    Limits,
    StallWatch,
    WaitEndedError,
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
        self._read_at = -math.inf  # never read
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[tuple, object] = {}
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
                # streams are read on the thread that relays them (no channel thread started
                # per call): ~0.3 ms less per request on a small machine
                ch = self._channels[address] = grpc.insecure_channel(address, options=[
                    (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)])
            return ch

    def stub(self, cls, address: str):
        """A ``cls`` stub on ``address``'s channel, made once (a stub builds a callable per
        method)."""
        key = (cls, address)
        stub = self._stubs.get(key)
        if stub is None:
            stub = self._stubs[key] = cls(self.channel(address))
        return stub

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
            self._read_at = -math.inf
            return True


class _Retry(Exception):
    """A worker was unavailable before anything reached the client: try another."""

    def __init__(self, address: str, detail: str) -> None:
        super().__init__(detail)
        self.address = address


class _Lost(_Retry):
    """A worker failed after tokens reached the client: resume elsewhere (migrate)."""


class RouterService(api_pb2_grpc.BatonServicer):
    def __init__(self, pool: WorkerPool, tokenizer: BatonTokenizer, model: str,
                 max_model_len: int, fingerprint: str, policy: RoutingPolicy | None = None,
                 max_retries: int = 2, max_migrations: int = 2, limits: Limits | None = None,
                 max_prompt_tokens: int = 0, max_tokens: int = 0,
                 stall_timeout_s: float = 30.0) -> None:
        self.pool, self.tokenizer, self.model = pool, tokenizer, model
        self.max_model_len, self.fingerprint = max_model_len, fingerprint
        self.policy = policy or RoutingPolicy(pool, None)
        self.max_retries, self.max_migrations = max_retries, max_migrations
        self.admission = Admission(limits or Limits())
        self.stall = StallWatch(stall_timeout_s)
        # 0: the context length bounds the prompt, and prompt + output
        self.max_prompt_tokens = min(max_prompt_tokens or max_model_len - 1, max_model_len - 1)
        self.max_tokens = max_tokens
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
            for msg in self._admitted(request, context, t0, rid, span):
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

    def _admitted(self, request, context, t0: float, rid: str, span):
        """Validate, then run under the admission limits (see baton.services.router.limits)."""
        try:
            ids = self._prompt_ids(request)
            p = params_from_proto(request.params)  # validation: the workers get the proto
            if self.max_tokens and p.max_tokens > self.max_tokens:
                raise InvalidRequestError("params.max_tokens", p.max_tokens,
                                          f"this router allows at most {self.max_tokens} "
                                          "(--max-tokens)")
        except InvalidRequestError as e:
            abort_with(context, e)
        try:
            with self.admission.slot(client_key(context), context.time_remaining,
                                     context.is_active):
                span.event("baton.admitted")
                yield from self._generate(request, context, t0, rid, span, ids)
        except LimitExceededError as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{type(e).__name__}: {e}")
        except WaitEndedError as e:
            context.abort(grpc.StatusCode.CANCELLED if "client" in e.reason
                          else grpc.StatusCode.DEADLINE_EXCEEDED, f"{type(e).__name__}: {e}")

    def _generate(self, request, context, t0: float, rid: str, span, ids: list[int]):
        calls: list = []  # outbound calls in flight, cancelled if the client goes away
        context.add_callback(lambda: [c.cancel() for c in list(calls)])
        failed: set[str] = set()
        state, retries = None, 0
        hashes, hashed_len = None, -1  # hashed once per prompt: retries reuse, migrations extend
        while True:
            # every attempt is a new request on the workers (a failed one may still be known)
            n = retries + (state.migrations if state else 0)
            state = _State(rid if n == 0 else f"{rid}.{n}", ids, t0, retries, self.metrics,
                           span, before=state,
                           last_delta_in_final=request.last_delta_in_final)
            try:
                t = time.monotonic()
                if self.policy.mode != "round-robin" and hashed_len != len(state.ids):
                    workers = self.pool.workers()
                    bs = workers[0].block_size if workers else 16
                    salt = (request.params.cache_salt if request.params.HasField("cache_salt")
                            else None)
                    hashes = self.policy.prompt_hashes(state.ids, self.fingerprint, salt, bs)
                    hashed_len = len(state.ids)
                try:
                    decision = self.policy.decide(state.ids, hashes, failed)
                except NoWorkerError:  # the registry read may predate a worker's start
                    if not self.pool.forget(if_older_than=0.1):
                        raise
                    decision = self.policy.decide(state.ids, hashes, failed)
                state.route(decision, t, time.monotonic())
                self.metrics.routed(decision)
                yield from self._attempt(request, state, decision, calls, context)
                return
            except _Lost as e:  # tokens were streamed: resume elsewhere, or end typed
                failed.add(e.address)
                self.pool.forget()
                why = self._cannot_migrate(state, request)
                if why:
                    context.abort(grpc.StatusCode.UNAVAILABLE,
                                  f"worker {e.address} failed after tokens were streamed "
                                  f"({e}); not migrated: {why}")
                state.migrated(state.decode_worker, self.tokenizer)
                self.metrics.migrations.inc()
                span.event("baton.migrate", {"baton.worker.address": e.address,
                                             "baton.migrate.tokens_sent": len(state.tokens)})
                log.warning("request %s: %s after %d tokens; migrating (%d)", rid, e,
                            len(state.tokens), state.migrations)
            except _Retry as e:
                if not context.is_active():  # the client went away: nothing to retry for
                    return
                span.event("baton.retry", {"baton.worker.address": e.address,
                                           "baton.retry.reason": str(e)})
                failed.add(e.address)
                self.pool.forget()
                retries += 1
                if retries > self.max_retries:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "every attempt failed on an "
                                  f"unavailable worker ({sorted(failed)})")
                log.warning("request %s: %s; retrying elsewhere (attempt %d)", rid, e, retries)
            except NoWorkerError as e:
                context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            if not context.is_active():
                return

    def _cannot_migrate(self, st, request) -> str:
        """Why the request cannot resume on another worker ("" when it can)."""
        if st.migrations >= self.max_migrations:
            return f"already migrated {st.migrations} times (--max-migrations)"
        p = request.params
        if len(st.tokens) >= (p.max_tokens if p.HasField("max_tokens") else 16):
            return "every requested token was sent, but not the finish"
        if len(st.prompt) + len(st.tokens) >= self.max_model_len:
            return f"prompt and output fill the context length {self.max_model_len}"
        return ""

    def _attempt(self, request, st, decision: Decision, calls, context):
        """One attempt on the decided workers, counted in flight on them (in Redis too): on the
        decode worker until the attempt ends, on the prefill worker until its prefill does (a
        prefill worker counted through every decode it handed off to would look saturated to
        the routers while it idles, and they would prefill on the decode workers instead)."""
        index = self.policy.index
        if index is not None:
            index.claim(st.rid, [decision.decode.worker_id])
            if decision.prefill is not None:
                index.claim(_prefill_key(st.rid), [decision.prefill.worker_id])
        try:
            if decision.path == "remote":
                yield from self._remote(request, st, decision.prefill, decision.decode, calls,
                                        context)
            else:
                yield from self._local(request, st, decision.decode, calls, context)
        finally:
            if index is not None:
                index.release(st.rid)
                index.release(_prefill_key(st.rid))

    # ---- paths -----------------------------------------------------------------------------------

    def _remote(self, request, st, prefill, decode, calls, context):
        st.prefill_worker = prefill.worker_id
        p = st.params(request.params)
        t = time.monotonic()
        with self.pool.busy(prefill.address):
            cs = _call_span(st.span, prefill, "PrefillWorker", "Prefill")
            fut = self.pool.stub(worker_pb2_grpc.PrefillWorkerStub, prefill.address).Prefill \
                .future(worker_pb2.PrefillRequest(request_id=st.rid, prompt_token_ids=st.ids,
                                                  params=p), timeout=_left(context),
                        metadata=cs.metadata())
            calls.append(fut)
            try:
                pre = fut.result()
            except grpc.FutureCancelledError:  # the client went away: the loop sees it
                raise _Retry(prefill.address, "client went away") from None
            except grpc.RpcError as e:
                cs.end(error=e.code())
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # backpressure: elsewhere
                    raise _Retry(prefill.address,
                                 f"{prefill.address} refused: {e.details()}") from None
                _fail(e, prefill.address, context, sent=False)
            finally:
                calls.remove(fut)
                if self.policy.index is not None:
                    self.policy.index.release(_prefill_key(st.rid))
            cs.end()
        st.prefill_s = time.monotonic() - t
        st.queue_s = pre.queue_s
        st.cached = pre.num_cached_tokens
        first_lp = [pre.first_logprob] if pre.HasField("first_logprob") else []
        if pre.finish_reason:  # the first token ended the request: nothing to hand off
            st.tokens.append(pre.first_token_id)
            text = self.tokenizer.decode([pre.first_token_id])
            yield from st.ending(st.delta([pre.first_token_id], text, first_lp),
                                 pre.finish_reason, "remote")
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
            self.pool.stub(worker_pb2_grpc.KVSourceStub, address).ReleaseLease(
                worker_pb2.ReleaseLeaseRequest(lease_id=handle.lease_id,
                                               incarnation=handle.incarnation), timeout=2)
        except grpc.RpcError as e:
            log.info("could not give lease %s back to %s: %s", handle.lease_id, address,
                     e.code())

    def _local(self, request, st, decode, calls, context):
        p = st.params(request.params)
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
            call = start(self.pool.stub(worker_pb2_grpc.DecodeWorkerStub, decode.address),
                         cs.metadata())
            calls.append(call)
            reason = ""
            watch = None
            final = None
            try:
                for chunk in call:
                    if watch is None:  # mid-stream from here: a silent worker is a hung one
                        watch = self.stall.watch(call)
                    watch.beat()
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
                    if (len(st.tokens) == st.start and st.first_logprob
                            and len(lps) < len(chunk.token_ids)):
                        lps = st.first_logprob + lps  # the hand-off's first token: prefill's
                    st.tokens.extend(chunk.token_ids)
                    delta = st.delta(chunk.token_ids, chunk.text, lps)
                    reason = chunk.finish_reason or reason
                    if reason and final is None:
                        # the finishing chunk is the worker's last message: the client gets
                        # the final one now, while the worker's status is still on its way
                        for final in st.ending(delta, reason, path):
                            yield final
                    else:
                        yield delta
            except grpc.RpcError as e:
                cs.end(error=e.code())
                if final is not None:  # everything was delivered; only the status was lost
                    log.info("request %s: %s failed after its finish (%s); already complete",
                             st.rid, decode.address, e.code())
                    return
                if watch is not None and watch.stalled:
                    raise _Lost(decode.address, f"{decode.address} sent nothing for "
                                f"{self.stall.timeout_s:g}s (--stall-timeout)") from None
                _fail(e, decode.address, context, sent=st.sent)
            finally:
                if watch is not None:
                    self.stall.unwatch(watch)
                calls.remove(call)
            cs.end()
        if not reason:  # the stream ended without a finish: never report that as success
            context.abort(grpc.StatusCode.INTERNAL,
                          f"decode worker {decode.worker_id} ended the stream unfinished")

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
        if len(ids) > self.max_prompt_tokens:
            raise InvalidRequestError(
                "prompt", f"<{len(ids)} tokens>",
                f"does not fit the context length {self.max_model_len}"
                if self.max_prompt_tokens == self.max_model_len - 1 else
                f"this router takes at most {self.max_prompt_tokens} tokens "
                "(--max-prompt-tokens)")
        return ids


class _State:
    """One attempt's progress and the timings for the final message. An attempt after a
    migration starts from the one ``before``: what the client was sent carries over, and the
    workers get the prompt plus those tokens (``ids``) with ``max_tokens`` reduced by them."""

    def __init__(self, rid: str, prompt: list[int], t0: float, attempt: int,
                 metrics=None, span=tracing.NO_SPAN, before: _State | None = None,
                 last_delta_in_final: bool = False) -> None:
        self.rid, self.prompt, self.t0, self.attempt = rid, prompt, t0, attempt
        self.last_delta_in_final = last_delta_in_final
        self.metrics, self.span = metrics, span
        b = before
        self.tokens: list[int] = list(b.tokens) if b else []  # every token sent to the client
        self.start = len(self.tokens)  # this attempt's first token's index in ``tokens``
        self.ids = prompt + self.tokens  # the prompt the workers get
        self.text = b.text if b else ""  # every character sent to the client
        self.unsent_text = b.unsent_text if b else ""  # goes out before this attempt's text
        self.sent = b.sent if b else False
        self.first_at: float | None = b.first_at if b else None
        self.second_at: float | None = b.second_at if b else None  # after the first token
        self.last_at = b.last_at if b else None
        self.migrations = b.migrations if b else 0
        self.migrated_from: list[str] = list(b.migrated_from) if b else []
        self.cached = 0
        self.prefill_s = self.transfer_s = 0.0
        self.transports = self.prefill_worker = self.decode_worker = ""
        self.first_logprob: list = []
        self.route_s = self.queue_s = 0.0
        self.decision: Decision | None = None
        self.blocks_read = self.blocks_local = 0

    def params(self, p):
        """The request's sampling parameters for this attempt (``max_tokens`` less the tokens
        already sent)."""
        if self.start == 0:
            return p
        q = type(p)()
        q.CopyFrom(p)
        q.max_tokens = (p.max_tokens if p.HasField("max_tokens") else 16) - self.start
        return q

    def migrated(self, worker_id: str, tokenizer: BatonTokenizer) -> None:
        """The decode worker failed after streaming ``tokens``: the next attempt resumes after
        them. Text the worker held back (an unfinished UTF-8 character, a possible stop string's
        start) was never sent; it goes out first, from the router's own decode of the tokens."""
        self.migrations += 1
        self.migrated_from.append(worker_id)
        seed = self.prompt[-5:]  # as the workers' detokenizer: context for a leading space
        full = tokenizer.decode(seed + self.tokens)[len(tokenizer.decode(seed)):]
        sent = self.text
        if full.startswith(sent):
            self.unsent_text = full[len(sent):].rstrip("\ufffd")

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
        if self.unsent_text:
            text, self.unsent_text = self.unsent_text + text, ""
        self.text += text
        return api_pb2.GenerateResponse(delta=api_pb2.GenerateDelta(
            text=text, token_ids=token_ids, logprobs=logprobs))

    def ending(self, delta, reason: str, path: str) -> tuple:
        """The messages that end the request: its last ``delta`` and then the final message,
        or the final message alone, carrying the delta, when the client asked for that
        (``GenerateRequest.last_delta_in_final``)."""
        if self.last_delta_in_final:
            return (self.final(reason, path, delta.delta),)
        return (delta, self.final(reason, path))

    def final(self, reason: str, path: str, last_delta=None):
        if self.migrations:
            path = "migrated"
        now = time.monotonic()
        first = self.first_at or now
        d = self.decision
        return api_pb2.GenerateResponse(final=api_pb2.GenerateFinal(
            finish_reason=reason, path=path, prefill_worker=self.prefill_worker,
            decode_worker=self.decode_worker, transports=self.transports, retries=self.attempt,
            prompt_token_ids=self.prompt, route_reason=d.reason if d else "",
            migrations=self.migrations, migrated_from=self.migrated_from,
            index_cached_tokens=d.cached_tokens if d else 0,
            index_used=d.used_index if d else False, kv_blocks_read=self.blocks_read,
            kv_blocks_local=self.blocks_local, last_delta=last_delta,
            usage=api_pb2.Usage(prompt_tokens=len(self.prompt),
                                cached_tokens=min(self.cached, len(self.prompt)),
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


def _prefill_key(rid: str) -> str:
    """The in-flight claim of a request's prefill, apart from its decode's."""
    return f"{rid}/prefill"


def _left(context) -> float:
    left = context.time_remaining()
    return DEFAULT_TIMEOUT_S if left is None else max(left, 0.001)


# before anything reached the client: the worker is gone, or the hand-off's lease was lost
# (expired while a worker stalled; its blocks were discarded, never decoded): start over
_RETRY_BEFORE_FIRST_TOKEN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)


def _fail(e: grpc.RpcError, address: str, context, sent: bool):
    """A worker call failed: retry elsewhere if the worker was unavailable (migrate if tokens
    were sent already); otherwise end the client's stream with the worker's status (raises
    either way)."""
    code = e.code()
    if code == grpc.StatusCode.CANCELLED and not context.is_active():
        raise _Retry(address, "client went away")  # the loop sees the inactive context
    left = context.time_remaining()
    if not sent and (code in _RETRY_BEFORE_FIRST_TOKEN or (
            # the worker's own timeout (a KV hand-off from a stalled peer), not the client's
            code == grpc.StatusCode.DEADLINE_EXCEEDED and (left is None or left > 1.0))):
        raise _Retry(address, f"{address}: {code.name} {e.details()}")
    if sent and code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        raise _Lost(address, f"{address} failed: {code.name} {e.details()}")
    context.abort(code, e.details() or code.name)


def client_key(context) -> str:
    """Whose request this is, for --max-concurrent-per-key: a digest of its bearer token, else
    its peer's host."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and value:
            return "key:" + hashlib.sha256(value.encode()).hexdigest()[:16]
    peer = context.peer() if hasattr(context, "peer") else ""
    return "peer:" + peer.rsplit(":", 1)[0]


class TokenAuth(grpc.ServerInterceptor):
    """Every call but health checks (probes cannot send tokens) needs
    ``authorization: Bearer <key>`` metadata with one of ``keys``; others end UNAUTHENTICATED."""

    OPEN = ("/grpc.health.v1.Health/",)

    def __init__(self, keys: ApiKeys) -> None:
        self._ok = keys.allows

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
    ap.add_argument("--redis-url", default=os.environ.get("BATON_REDIS_URL"),
                    required="BATON_REDIS_URL" not in os.environ,
                    help="Redis: the worker registry, the prefix index, shared in-flight counts "
                         "(redis://:PASSWORD@host:port/0 for AUTH, rediss:// for TLS; default "
                         "$BATON_REDIS_URL, which keeps a password off the command line)")
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
                        "saturated; when all are, decode workers prefill prompts up to "
                        "--saturated-local-max-tokens themselves (0: never saturated) "
                        "(default 8)")
    g.add_argument("--saturated-local-max-tokens", type=int, default=256,
                   help="when every prefill worker is saturated, the decode worker prefills a "
                        "prompt itself only if it lacks at most this many of its tokens; a "
                        "longer one waits for a prefill worker, as a long local prefill would "
                        "stall every stream the decode worker runs (default 256; -1: any)")
    g.add_argument("--inflight-ttl", type=float, default=30.0,
                   help="seconds a router's in-flight entries in Redis outlive the router "
                        "(re-armed while it runs) (default 30)")
    ap.add_argument("--max-retries", type=int, default=2,
                    help="other workers to try when one is unavailable before the first token")
    lim = ap.add_argument_group("limits (over them: RESOURCE_EXHAUSTED / HTTP 429, or "
                                "INVALID_ARGUMENT naming the field)")
    lim.add_argument("--max-concurrent", type=int, default=256,
                     help="requests this router runs at once (0: no limit) (default 256)")
    lim.add_argument("--max-queued", type=int, default=1024,
                     help="requests that may wait for one of those slots, first come first "
                          "served, within their deadlines; more are refused at once "
                          "(default 1024)")
    lim.add_argument("--max-concurrent-per-key", type=int, default=0,
                     help="requests one API key (else one client host) may have running or "
                          "waiting (0: no limit) (default 0)")
    lim.add_argument("--max-prompt-tokens", type=int, default=0,
                     help="longest prompt accepted (0: the model's context length)")
    lim.add_argument("--max-tokens", type=int, default=0,
                     help="largest max_tokens accepted (0: no limit beyond the context)")
    ap.add_argument("--max-migrations", type=int, default=2,
                    help="times a request resumes on another decode worker when its own fails "
                         "after tokens were streamed (from the prompt plus those tokens; "
                         "0: end such requests UNAVAILABLE) (default 2)")
    ap.add_argument("--stall-timeout", type=float, default=30.0,
                    help="seconds a decode worker may stay silent in the middle of a stream "
                         "before the router takes the request elsewhere (migrates it): a hung "
                         "worker costs this, not the whole deadline (0: wait for the deadline) "
                         "(default 30)")
    ap.add_argument("--startup-timeout", type=float, default=300.0,
                    help="seconds to wait for a first worker to register")
    ap.add_argument("--drain-timeout", type=float, default=30.0)
    ap.add_argument("--log-level", default="INFO")
    sec = ap.add_argument_group("security")
    sec.add_argument("--auth-token", default=os.environ.get("BATON_AUTH_TOKEN"),
                     help="require 'authorization: Bearer TOKEN' on gRPC calls and "
                          "'Authorization: Bearer TOKEN' (the OpenAI api_key) on /v1/*; health "
                          "checks and /metrics stay open (default $BATON_AUTH_TOKEN)")
    sec.add_argument("--api-keys-file", default=os.environ.get("BATON_API_KEYS_FILE"),
                     help="more accepted keys, one per line ('#' comments), like --auth-token; "
                          "--max-concurrent-per-key counts each key separately "
                          "(default $BATON_API_KEYS_FILE)")
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
    try:
        limits = Limits(args.max_concurrent, args.max_queued, args.max_concurrent_per_key)
    except ValueError as e:
        ap.error(str(e))
    setup_logging(args.log_level)
    import redis

    # short timeouts: a Redis that hangs must not stall routing (the index degrades instead)
    client = redis.Redis.from_url(args.redis_url, socket_timeout=0.5, socket_connect_timeout=0.5)
    pool = WorkerPool(WorkerRegistry(client))
    tok, worker = fetch_tokenizer(pool, args.startup_timeout)
    try:
        keys = ApiKeys.load(args.auth_token, args.api_keys_file)
    except OSError as e:
        ap.error(f"--api-keys-file: {e}")
    interceptors = [TokenAuth(keys)] if keys else []
    # a thread per running or waiting request, and a few for health and listing; past that the
    # gRPC server itself refuses (RESOURCE_EXHAUSTED) rather than queueing without bound
    threads = limits.max_concurrent + limits.max_queued + 16 if limits.max_concurrent else 1024
    server = make_server(max_workers=threads, interceptors=interceptors,
                         max_concurrent_rpcs=threads)
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
                           prefill_saturation=args.prefill_saturation,
                           saturated_local_max_tokens=args.saturated_local_max_tokens)
    policy.prompt_hashes([0] * 256, worker.fingerprint, None, 16)  # builds the native hasher
    service = RouterService(pool, BatonTokenizer.from_json(json.loads(tok.tokenizer_json)),
                            tok.model, tok.max_model_len, worker.fingerprint, policy,
                            args.max_retries, args.max_migrations, limits,
                            args.max_prompt_tokens, args.max_tokens, args.stall_timeout)
    api_pb2_grpc.add_BatonServicer_to_server(service, server)
    health = add_standard_services(server, ["baton.v1.Baton"])
    server.start()
    address = f"{args.host}:{port}"
    http_address = ""
    log.info("router serving %s on %s (workers from %s)", tok.model, address, args.redis_url)
    if args.http_port >= 0:
        from baton.services.router.openai_http import serve_http

        http = serve_http(service, args.host, args.http_port, keys=keys,
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
