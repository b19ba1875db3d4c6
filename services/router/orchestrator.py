"""The life of one request in the router, apart from any client transport.

:meth:`Orchestrator.generate` takes a request, a :class:`Deadline` and a :class:`Cancellation`
and yields ``GenerateResponse`` messages: deltas, then one final message. It raises
:class:`RequestError` and nothing else. Both fronts (``grpc_api``, ``openai_http``) are adapters
around it::

    validate ─► admission slot ─► attempt 1 ─► attempt 2 ... ─► final
                                     │
      decide (routing.RoutingPolicy) ┤
       remote: Prefill on a prefill worker ─handle─► Decode on a decode worker (KV by NIXL)
       local:  Generate on a decode worker (it prefills itself)
                                     │
                                     └─► Outcome: Done | Retry | Migrate | Failed

Each attempt ends in one explicit :data:`Outcome`. ``Retry``: a worker was unavailable before
anything reached the client, so another is tried (``max_retries``). ``Migrate``: the decode worker
failed after tokens were streamed, so the request resumes on another from the prompt plus those
tokens (``max_migrations``). ``Failed``: the request ends with the error. Nothing is sent to the
client before the decode worker's first chunk. Every worker call's timeout is what is left of
the deadline; cancelling cancels the calls in flight, which frees the request's blocks on every
worker. Imports no torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from baton.engine import grammar, tool_calls
from baton.engine.errors import InvalidRequestError
from baton.engine.tokenizer import BatonTokenizer
from baton.services.common import tracing
from baton.services.common.metrics import RouterMetrics
from baton.services.common.protocol import params_from_proto
from baton.services.router import liveness
from baton.services.router.errors import RequestError, Status
from baton.services.router.limits import (
    Admission,
    DecodeQueue,
    LimitExceededError,
    Limits,
    StallWatch,
    WaitEndedError,
)
from baton.services.router.progress import Attempt, Sent, call_span, final_attrs, request_attrs
from baton.services.router.routing import Decision, NoWorkerError, RoutingPolicy
from baton.services.router.workers import Stream, WorkerError, WorkerPool
from baton.services.router.workload_log import WorkloadLog, sampling_filters
from baton.v1 import worker_pb2
from baton_client.v1 import api_pb2

log = logging.getLogger("baton.services.router")


# ---- the request's deadline, its cancellation, its caller ----------------------------------------


class Deadline:
    """When the request must be over, on the monotonic clock."""

    def __init__(self, at: float) -> None:
        self.at = at

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds)

    def remaining(self) -> float:
        """Seconds left, never below 1 ms (a worker call's timeout must be positive)."""
        return max(self.at - time.monotonic(), 0.001)

    def passed(self) -> bool:
        return time.monotonic() >= self.at


class Cancellation:
    """The client's "stop", set once by the front that noticed the client went away. Calls in
    flight are :meth:`linked` to it and cancelled when it is set. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: set = set()
        self.cancelled = False

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            calls, self._calls = self._calls, set()
        for call in calls:
            call.cancel()

    @contextmanager
    def linked(self, call):
        """Cancel ``call`` (anything with ``cancel()``) if the request is cancelled during the
        ``with`` body, or if the body ends by an exception (the consumer stopped reading)."""
        with self._lock:
            cancelled = self.cancelled
            self._calls.add(call)
        if cancelled:
            call.cancel()
        try:
            yield call
        except BaseException:
            call.cancel()
            raise
        finally:
            with self._lock:
                self._calls.discard(call)


@dataclass(frozen=True)
class Caller:
    """Who asks: ``key`` counts against ``--max-concurrent-per-key`` (a digest of the API key,
    else the client's host); ``trace`` is the W3C trace context as (name, value) pairs."""

    key: str = "anonymous"
    trace: tuple = ()

    @classmethod
    def of(cls, metadata: tuple, peer: str) -> Caller:
        """From a call's metadata (or HTTP headers) as (name, value) pairs and its peer
        (``ipv4:HOST:PORT``): the key is a digest of its bearer token, else its host."""
        key = "peer:" + peer.rsplit(":", 1)[0]
        for name, value in metadata:
            if name == "authorization" and value:
                key = "key:" + hashlib.sha256(value.encode()).hexdigest()[:16]
                break
        return cls(key, metadata)


# ---- outcomes of an attempt ----------------------------------------------------------------------


@dataclass(frozen=True)
class Done:
    """The final message was sent."""


@dataclass(frozen=True)
class Retry:
    """The worker at ``address`` was unavailable before anything reached the client."""

    address: str
    detail: str


@dataclass(frozen=True)
class Migrate:
    """The decode worker at ``address`` failed after tokens reached the client."""

    address: str
    detail: str


@dataclass(frozen=True)
class Failed:
    """The request ends with ``error``."""

    error: RequestError


Outcome = Done | Retry | Migrate | Failed


# ---- one request, as the orchestrator carries it ------------------------------------------------


@dataclass
class _Call:
    """One request from validation to its end: what the client asked (``request``; its
    ``params`` with ``max_tokens`` resolved, converted once), its prompt, deadline and
    cancellation, the router's id for it, what was sent so far, and the workers that failed."""

    request: api_pb2.GenerateRequest
    ids: list[int]
    deadline: Deadline
    cancel: Cancellation
    rid: str
    t0: float
    span: tracing.NoSpan  # a tracing.Span when tracing is on
    hashes: _PromptHashes
    sent: Sent = field(default_factory=Sent)
    failed: set[str] = field(default_factory=set)
    retries: int = 0

    @property
    def params(self) -> api_pb2.SamplingParams:
        return self.request.params

    def attempt(self, metrics) -> Attempt:
        """The next attempt: a new request on the workers (a failed one may still be known
        there), resuming after what was sent."""
        n = self.retries + self.sent.migrations
        return Attempt(self.rid if n == 0 else f"{self.rid}.{n}", self.ids, self.t0,
                       self.retries, self.sent, metrics, self.span,
                       last_delta_in_final=self.request.last_delta_in_final,
                       request_ids=(self.request.request_id, self.rid))

    def left(self) -> float:
        return self.deadline.at - time.monotonic()

    def waiting(self) -> bool:
        """Still wanted: the client has not gone."""
        return not self.cancel.cancelled

    def ended_wait(self, e: Exception) -> RequestError:
        """A wait (admission, the decode queue) that ended without a place."""
        status = Status.CANCELLED if self.cancel.cancelled else Status.DEADLINE_EXCEEDED
        return RequestError(status, f"{type(e).__name__}: {e}")


# the chat template's variables Baton sets itself
_TEMPLATE_OWN = {"messages", "add_generation_prompt", "bos_token", "eos_token",
                 "raise_exception", "strftime_now", "tools"}


def _template_kwargs(chat) -> dict:
    """A chat request's template variables (``chat_template_kwargs``), checked: a JSON object
    whose keys are not the ones the template gets from Baton."""
    if not chat.template_kwargs_json:
        return {}
    try:
        kwargs = json.loads(chat.template_kwargs_json)
    except ValueError as e:
        raise InvalidRequestError("chat_template_kwargs", chat.template_kwargs_json[:100],
                                  f"not JSON: {e}") from None
    if not isinstance(kwargs, dict):
        raise InvalidRequestError("chat_template_kwargs", kwargs, "must be a JSON object")
    for key in kwargs:
        if key in _TEMPLATE_OWN or not key.isidentifier():
            raise InvalidRequestError(f"chat_template_kwargs.{key}", kwargs[key],
                                      "is set by Baton, or not a template variable name")
    return kwargs


def resolve_max_tokens(request: api_pb2.GenerateRequest, default: int) -> None:
    """Set ``params.max_tokens`` to the front's API default when the client left it unset: the
    workers get it always (the worker API has no default of its own)."""
    if not request.params.HasField("max_tokens"):
        request.params.max_tokens = default


# ---- settings ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RouterSettings:
    """What the orchestrator is told at start-up (``baton router`` flags; the model's identity
    from the workers)."""

    model: str
    max_model_len: int
    fingerprint: str
    max_retries: int = 2
    max_migrations: int = 2
    max_prompt_tokens: int = 0  # 0: the context length bounds the prompt
    max_tokens: int = 0  # 0: the context length bounds prompt + output
    stall_timeout_s: float = 30.0
    request_timeout_s: float = 600.0  # the deadline of a request whose client set none
    limits: Limits = field(default_factory=Limits)
    workload_window_s: float = 900.0  # the live workload kept (workload_log.py); 0: none

    @property
    def prompt_limit(self) -> int:
        return min(self.max_prompt_tokens or self.max_model_len - 1, self.max_model_len - 1)


class Orchestrator:
    """Runs requests on the workers of ``pool``; one per router process, shared by its fronts."""

    def __init__(self, pool: WorkerPool, tokenizer: BatonTokenizer, settings: RouterSettings,
                 policy: RoutingPolicy | None = None) -> None:
        self.pool, self.tokenizer, self.settings = pool, tokenizer, settings
        self.liveness: liveness.Liveness | None = None  # the workers that answer (/health)
        self.policy = policy or RoutingPolicy(pool, None)
        self.admission = Admission(settings.limits)
        self.decode_queue = DecodeQueue(settings.limits.max_queued)
        self.stall = StallWatch(settings.stall_timeout_s)
        self.metrics = RouterMetrics(self.policy.index, self.admission, self.decode_queue)
        self.workload = (WorkloadLog(settings.workload_window_s)
                         if settings.workload_window_s > 0 else None)

    @property
    def model(self) -> str:
        return self.settings.model

    def deadline(self, client_seconds: float | None) -> Deadline:
        """The request's deadline: the client's, or the router's default when it set none (or
        a longer one)."""
        limit = self.settings.request_timeout_s
        if client_seconds is None or client_seconds > limit:
            client_seconds = limit
        return Deadline.after(client_seconds)

    def health(self) -> tuple[bool, dict]:
        """(whether this router can serve, what ``/health`` says): from the workers that
        answer its probes (``liveness``, set by the router's main), else from the registry."""
        if self.liveness is not None:
            return liveness.report(self.pool, self.liveness)
        counts = self.pool.role_counts()
        ok = counts.get("decode", 0) + counts.get("both", 0) > 0
        return ok, {"status": "ok" if ok else "degraded", "workers": counts}

    def model_card(self) -> api_pb2.ModelCard:
        s = self.settings
        return api_pb2.ModelCard(id=s.model, max_model_len=s.max_model_len,
                                 fingerprint=s.fingerprint)

    # ---- one request -----------------------------------------------------------------------------

    def generate(self, request: api_pb2.GenerateRequest, deadline: Deadline,
                 cancel: Cancellation, caller: Caller = Caller()
                 ) -> Iterator[api_pb2.GenerateResponse]:
        """Deltas, then the final message; raises RequestError. A consumer that stops reading
        cancels the request's worker calls."""
        t0 = time.monotonic()
        # the router's own id: the client's request_id is only a label (echoed in the final
        # message), so two clients choosing the same one never share worker or index keys
        rid = uuid.uuid4().hex
        span = tracing.NO_SPAN
        if tracing.enabled():
            span = tracing.request_span(caller.trace, *request_attrs(request, self.model, rid),
                                        at=t0)
        status = "CANCELLED"  # unless it ends otherwise: the consumer stopped reading
        try:
            call = _Call(request, self.validate(request), deadline, cancel, rid, t0, span,
                         _PromptHashes(self, request))
            call.sent.tool_format, call.sent.think = answer_shape(request,
                                                                  self.tokenizer.chat_template)
            arrived = time.time() - (time.monotonic() - t0)
            if self.workload is not None:
                self.workload.arrive(rid, arrived, len(call.ids), call.params.max_tokens,
                                     call.hashes.of(call.ids), call.hashes.block_size,
                                     sampling_filters(call.params))
            for msg in self._admitted(call, caller):
                if msg.HasField("final"):
                    status = "OK"
                    self.metrics.finished(msg.final)
                    if self.workload is not None:
                        self.workload.record(msg.final, arrived, rid=rid)  # arrive()'s blocks
                    span.set(final_attrs(msg.final))
                yield msg
        except RequestError as e:
            status = e.status.name
            raise
        finally:
            if status == "OK":
                span.end()
            else:
                self.metrics.failed(status)
                span.end(error=status)
                if self.workload is not None:
                    self.workload.forget(rid)

    def _response_format(self, request: api_pb2.GenerateRequest) -> None:
        """The gRPC API's ``response_format_json`` as the request's grammar."""
        if not request.response_format_json:
            return
        if request.params.grammar:
            raise InvalidRequestError("response_format_json", "...", "give params.grammar or "
                                      "response_format_json, not both")
        try:
            rf = json.loads(request.response_format_json)
        except ValueError as e:
            raise InvalidRequestError("response_format_json", request.response_format_json[:80],
                                      f"not JSON: {e}") from None
        request.params.grammar = grammar.from_response_format(
            rf, thinks(request, self.tokenizer.chat_template))

    def _prepare_tools(self, request: api_pb2.GenerateRequest) -> None:
        """A chat with tools: a forced call (``required``, a named function) becomes the
        grammar of the model's call format; raises InvalidRequestError naming the field."""
        chat = request.chat if request.WhichOneof("input") == "chat" else None
        if chat is None or not chat.tools_json:
            return
        choice = json.loads(chat.tool_choice_json) if chat.tool_choice_json else None
        parallel = not chat.HasField("parallel_tool_calls") or chat.parallel_tool_calls
        _, forced = tool_calls.prepare(self.tokenizer.chat_template, json.loads(chat.tools_json),
                                       choice, parallel,
                                       thinks(request, self.tokenizer.chat_template))
        if forced:
            if request.params.grammar:
                raise InvalidRequestError("tool_choice", choice, "a forced tool call cannot "
                                          "take response_format or structured_outputs too")
            request.params.grammar = forced

    def validate(self, request: api_pb2.GenerateRequest) -> list[int]:
        """The prompt's token ids; raises RequestError (INVALID_ARGUMENT) naming the field."""
        try:
            ids = self._prompt_ids(request)
            self._response_format(request)
            self._prepare_tools(request)
            if not request.params.HasField("max_tokens"):  # a chat to EOS or the context
                room, cap = self.settings.max_model_len - len(ids), self.settings.max_tokens
                request.params.max_tokens = max(1, min(room, cap) if cap else room)
                request.params.fit_pool = True  # and each worker to what its pool holds
            p = params_from_proto(request.params)  # validation: the workers get the proto
            if self.settings.max_tokens and p.max_tokens > self.settings.max_tokens:
                raise InvalidRequestError("params.max_tokens", p.max_tokens,
                                          f"this router allows at most "
                                          f"{self.settings.max_tokens} (--max-tokens)")
        except InvalidRequestError as e:
            raise RequestError.invalid(e) from None
        return ids

    def _admitted(self, call: _Call, caller: Caller):
        """Run the request under the admission limits (see baton.services.router.limits)."""
        t = time.monotonic()
        try:
            with self.admission.slot(caller.key, call.left, call.waiting):
                call.sent.admission_wait_s = time.monotonic() - t
                call.span.event("baton.admitted")
                yield from self._attempts(call)
        except LimitExceededError as e:
            raise RequestError(Status.RESOURCE_EXHAUSTED, f"{type(e).__name__}: {e}") from None
        except WaitEndedError as e:
            raise call.ended_wait(e) from None

    def _attempts(self, call: _Call):
        """Attempts until one is done or the request fails."""
        while True:
            st = call.attempt(self.metrics)
            decision = self._route(call, st)
            outcome = yield from self._attempt(call, st, decision)
            if isinstance(outcome, Done):
                return
            if isinstance(outcome, Failed):
                raise outcome.error
            call.failed.add(outcome.address)
            self.pool.forget()
            if call.cancel.cancelled:
                raise _client_gone()
            if call.deadline.passed():
                raise RequestError(Status.DEADLINE_EXCEEDED, f"the deadline passed after "
                                   f"{outcome.address} failed ({outcome.detail})")
            if isinstance(outcome, Migrate):
                self._migrate(call, st, outcome)
            else:
                call.retries += 1
                self._retry(call, st, outcome)

    def _route(self, call: _Call, st: Attempt) -> Decision:
        """The workers for this attempt; waits in the decode queue while every decode worker's
        batch is full (see baton.services.router.limits)."""
        t = time.monotonic()
        picked = [t]  # when the last pick started: the time before it was the decode queue's

        def decide() -> Decision:
            picked[0] = time.monotonic()
            try:
                return self.policy.decide(st.ids, call.hashes.of(st.ids), call.failed)
            except NoWorkerError:  # the registry read may predate a worker's start
                if not self.pool.forget(if_older_than=0.1):
                    raise
                return self.policy.decide(st.ids, call.hashes.of(st.ids), call.failed)

        try:
            decision = self.decode_queue.first(decide, call.left, call.waiting)
        except NoWorkerError as e:
            raise RequestError(Status.UNAVAILABLE, str(e)) from None
        except LimitExceededError as e:
            raise RequestError(Status.RESOURCE_EXHAUSTED, f"{type(e).__name__}: {e}") from None
        except WaitEndedError as e:
            raise call.ended_wait(e) from None
        st.route(decision, t, time.monotonic(), waited=picked[0] - t)
        self.metrics.routed(decision)
        return decision

    def _migrate(self, call: _Call, st: Attempt, m: Migrate) -> None:
        """Resume after the tokens sent, on another decode worker; or end UNAVAILABLE."""
        why = self._cannot_migrate(call, st)
        if why:
            raise RequestError(Status.UNAVAILABLE,
                               f"worker {m.address} failed after tokens were streamed "
                               f"({m.detail}); not migrated: {why}")
        st.migrated(st.decode_worker, self.tokenizer)
        self.metrics.migrations.inc()
        call.span.event("baton.migrate", {"baton.worker.address": m.address,
                                          "baton.migrate.tokens_sent": len(call.sent.tokens)})
        log.warning("request %s: %s after %d tokens; migrating (%d)", st.rid, m.detail,
                    len(call.sent.tokens), call.sent.migrations)

    def _retry(self, call: _Call, st: Attempt, r: Retry) -> None:
        """Try another worker; or end UNAVAILABLE when ``max_retries`` are spent."""
        call.span.event("baton.retry", {"baton.worker.address": r.address,
                                        "baton.retry.reason": r.detail})
        if call.retries > self.settings.max_retries:
            raise RequestError(Status.UNAVAILABLE, "every attempt failed on an unavailable "
                               f"worker ({sorted(call.failed)})")
        log.warning("request %s: %s; retrying elsewhere (attempt %d)", st.rid, r.detail,
                    call.retries)

    def _cannot_migrate(self, call: _Call, st: Attempt) -> str:
        """Why the request cannot resume on another worker ("" when it can)."""
        sent = call.sent
        if sent.migrations >= self.settings.max_migrations:
            return f"already migrated {sent.migrations} times (--max-migrations)"
        if len(sent.tokens) >= call.params.max_tokens:
            return "every requested token was sent, but not the finish"
        if len(st.prompt) + len(sent.tokens) >= self.settings.max_model_len:
            return f"prompt and output fill the context length {self.settings.max_model_len}"
        return ""

    # ---- one attempt -----------------------------------------------------------------------------

    def _attempt(self, call: _Call, st: Attempt, decision: Decision):
        """One attempt on the decided workers, counted in flight on its decode worker (in Redis
        too) until the attempt ends; the prefill worker counts it while it prefills
        (:meth:`_prefill`)."""
        index = self.policy.index
        if index is not None:
            index.claim(st.rid, [decision.decode.worker_id])
        try:
            if decision.path == "remote":
                return (yield from self._remote(call, st, decision))
            return (yield from self._local(call, st, decision.decode))
        finally:
            if index is not None:
                index.release(st.rid)
            self.decode_queue.wake()  # its decode slot is free

    def _remote(self, call: _Call, st: Attempt, decision: Decision):
        """Prefill on the prefill worker, then decode from its KV handle on the decode worker.
        A hand-off that does not end in Done gives the lease back at once."""
        prefill, p = decision.prefill, st.params(call.params)
        assert prefill is not None  # the remote path always names its prefill worker
        pre = self._prefill(call, st, prefill, p)
        if not isinstance(pre, worker_pb2.PrefillResponse):
            return pre
        first_lp = [pre.first_logprob] if pre.HasField("first_logprob") else []
        if pre.finish_reason:  # the first token ended the request: nothing to hand off
            st.tokens.append(pre.first_token_id)
            # the worker's text for it: cut before a stop string it completes, as on the
            # local path (decoding the token here sent the stop string too)
            yield from st.ending(st.delta([pre.first_token_id], pre.first_text, first_lp),
                                 pre.finish_reason, "remote")
            return Done()
        st.first_logprob = first_lp
        decode = decision.decode
        with self.pool.busy(decode.address):
            cs = call_span(st.span, decode, "DecodeWorker", "Decode")
            stream = self.pool.decode(decode.address, worker_pb2.DecodeRequest(
                request_id=st.rid, prompt_token_ids=st.ids, first_token_id=pre.first_token_id,
                params=p, handle=pre.handle),
                call.deadline.remaining(), cs.metadata())
            outcome = yield from self._relay(call, st, decode, "remote", stream, cs)
        if not isinstance(outcome, Done):
            self.pool.release(pre.handle)  # free the blocks now, not at expiry
        return outcome

    def _prefill(self, call: _Call, st: Attempt, prefill, p
                 ) -> worker_pb2.PrefillResponse | Outcome:
        """The prefill worker's answer (a KV handle and the first token), or the outcome that
        ends the attempt. The worker counts the request in flight (in Redis too) only while it
        prefills: a prefill worker counted through every decode it handed off to would look
        saturated to the routers while it idles, and they would prefill on the decode workers
        instead."""
        st.prefill_worker = prefill.worker_id
        index = self.policy.index
        if index is not None:
            index.claim(_prefill_key(st.rid), [prefill.worker_id])
        t = time.monotonic()
        with self.pool.busy(prefill.address):
            cs = call_span(st.span, prefill, "PrefillWorker", "Prefill")
            try:
                pending = self.pool.prefill(prefill.address, worker_pb2.PrefillRequest(
                    request_id=st.rid, prompt_token_ids=st.ids, params=p),
                    call.deadline.remaining(), cs.metadata())
                with call.cancel.linked(pending):
                    pre = pending.result()
            except WorkerError as e:
                cs.end(error=e.status.name)
                if e.status is Status.RESOURCE_EXHAUSTED:  # backpressure: elsewhere
                    return Retry(prefill.address, f"{prefill.address} refused: {e.detail}")
                return failure_outcome(e, call.deadline, call.cancel, sent=False)
            finally:
                if index is not None:  # the one release of the prefill claim
                    index.release(_prefill_key(st.rid))
            cs.end()
        st.prefill_s = time.monotonic() - t
        st.queue_s, st.cached = pre.queue_s, pre.num_cached_tokens
        st.cached_host, st.cached_disk = pre.cached_tokens_host, pre.cached_tokens_disk
        return pre

    def _local(self, call: _Call, st: Attempt, decode):
        """The decode worker prefills the prompt itself and decodes."""
        with self.pool.busy(decode.address):
            cs = call_span(st.span, decode, "DecodeWorker", "Generate")
            stream = self.pool.generate(decode.address, worker_pb2.LocalRequest(
                request_id=st.rid, prompt_token_ids=st.ids, params=st.params(call.params)),
                call.deadline.remaining(), cs.metadata())
            return (yield from self._relay(call, st, decode, "local", stream, cs))

    def _relay(self, call: _Call, st: Attempt, decode, path: str, stream: Stream, cs):
        """Relay the decode worker's chunks as deltas, then the final message."""
        st.decode_worker = decode.worker_id
        reason, watch, final = "", None, None
        try:
            with call.cancel.linked(stream):
                for chunk in stream:
                    if watch is None:  # mid-stream from here: a silent worker is a hung one
                        watch = self.stall.watch(stream)
                    watch.beat()
                    delta = _absorb(st, chunk)
                    reason = chunk.finish_reason or reason
                    # handing it on waits for the client to read (flow control): the time
                    # that takes is not the worker's silence
                    watch.hold()
                    if not reason or final is not None:
                        yield delta
                        watch.beat()
                        continue
                    # the finishing chunk is the worker's last message: the client gets the
                    # final one now, while the worker's status is still on its way
                    for final in st.ending(delta, reason, path):
                        yield final
                    watch.beat()
        except WorkerError as e:
            cs.end(error=e.status.name)
            return self._after_stream_error(call, e, decode, watch, final)
        finally:
            if watch is not None:
                self.stall.unwatch(watch)
        cs.end()
        if not reason:  # the stream ended without a finish: never report that as success
            return Failed(RequestError(Status.INTERNAL, f"decode worker {decode.worker_id} "
                                       "ended the stream unfinished"))
        return Done()

    def _after_stream_error(self, call: _Call, e: WorkerError, decode, watch, final) -> Outcome:
        if final is not None:  # everything was delivered; only the status was lost
            log.info("request %s: %s failed after its finish (%s); already complete",
                     call.rid, decode.address, e.status.name)
            return Done()
        if watch is not None and watch.stalled:
            return Migrate(decode.address, f"{decode.address} sent nothing for "
                           f"{self.stall.timeout_s:g}s (--stall-timeout)")
        return failure_outcome(e, call.deadline, call.cancel, sent=call.sent.any)

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
            tools = ({"tools": json.loads(request.chat.tools_json)}
                     if request.chat.tools_json else {})
            ids = self.tokenizer.encode_chat(_chat_messages(request.chat.messages),
                                             **_template_kwargs(request.chat), **tools)
        else:
            raise InvalidRequestError("input", None, "give text, token_ids or chat")
        if not ids:
            raise InvalidRequestError("prompt", "", "the prompt has no tokens")
        limit = self.settings.prompt_limit
        if len(ids) > limit:
            raise InvalidRequestError(
                "prompt", f"<{len(ids)} tokens>",
                f"does not fit the context length {self.settings.max_model_len}"
                if limit == self.settings.max_model_len - 1 else
                f"this router takes at most {limit} tokens (--max-prompt-tokens)")
        return ids


def failure_outcome(e: WorkerError, deadline: Deadline, cancel: Cancellation,
                    sent: bool) -> Outcome:
    """What a failed worker call means: retry elsewhere if the worker was unavailable before
    anything was sent, migrate if it failed after, else the request fails with the worker's
    status. The one rule, for every worker call."""
    if e.status is Status.CANCELLED and cancel.cancelled:
        return Failed(_client_gone())
    if not sent and (e.status in _RETRY_BEFORE_FIRST_TOKEN or (
            # the worker's own timeout (a KV hand-off from a stalled peer), not the client's
            e.status is Status.DEADLINE_EXCEEDED and deadline.at - time.monotonic() > 1.0)):
        # without the worker that failed: a decode worker names the prefill worker its
        # hand-off failed on, which is then the one left out
        return Retry(e.culprit, str(e))
    if sent and e.status in (Status.UNAVAILABLE, Status.CANCELLED):
        return Migrate(e.address, f"{e.address} failed: {e.status.name} {e.detail}")
    return Failed(RequestError(e.status, e.detail, e.field))


# before anything reached the client: the worker is gone, or the hand-off's lease was lost
# (expired while a worker stalled; its blocks were discarded, never decoded): start over. A
# call the router did not cancel that ends CANCELLED was ended by the worker's side (a worker
# going away after its engine died: CI saw one, with no message): gone too
_RETRY_BEFORE_FIRST_TOKEN = (Status.UNAVAILABLE, Status.ABORTED, Status.CANCELLED)


class _PromptHashes:
    """The prompt's block hashes for the routing index: computed once per prompt, so retries
    reuse them and a migration (the prompt plus the tokens sent) recomputes them."""

    def __init__(self, orch: Orchestrator, request) -> None:
        self._orch = orch
        p = request.params
        self._salt = p.cache_salt if p.HasField("cache_salt") else None
        self._hashes: bytes | None = None
        self._len = -1
        self.block_size = 16

    def of(self, ids: list[int]) -> bytes | None:
        policy = self._orch.policy
        if policy.mode == "round-robin" or self._len == len(ids):
            return self._hashes
        workers = self._orch.pool.workers()
        bs = self.block_size = workers[0].block_size if workers else 16
        self._hashes = policy.prompt_hashes(ids, self._orch.settings.fingerprint, self._salt, bs)
        self._len = len(ids)
        return self._hashes


def thinks(request: api_pb2.GenerateRequest, chat_template: str | None) -> bool:
    """Whether a request's answer comes after a reasoning model's thinking block."""
    return request.WhichOneof("input") == "chat" and tool_calls.thinking_on(
        chat_template, _template_kwargs(request.chat))


def answer_shape(request: api_pb2.GenerateRequest, chat_template: str | None
                 ) -> tuple[str | None, bool]:
    """(the tool-call format the answer is parsed in, whether a thinking block is split off
    it): tools in play, and a reasoning model thinking under a grammar or tools. The final
    message splits the answer so; the HTTP front holds a stream's text back for it."""
    chat = request.chat if request.WhichOneof("input") == "chat" else None
    fmt = None
    if chat is not None and chat.tools_json and chat.tool_choice_json != '"none"':
        fmt = tool_calls.format_of(chat_template)
    return fmt, thinks(request, chat_template) and bool(fmt or request.params.grammar)


def _chat_messages(messages) -> list[dict]:
    msgs = [_chat_message(m) for m in messages]
    if not msgs:
        raise InvalidRequestError("chat.messages", [], "must not be empty")
    for i, m in enumerate(msgs):
        if m["role"] not in ("system", "user", "assistant", "tool"):
            raise InvalidRequestError(f"chat.messages[{i}].role", m["role"],
                                      "must be system, user, assistant or tool")
    return msgs


def _chat_message(m) -> dict:
    """A chat message as the template reads it: an assistant's tool calls with their arguments
    as objects (as transformers' templates expect), a tool message's call id and name."""
    out: dict = {"role": m.role, "content": m.content}
    if m.tool_calls_json:
        calls = json.loads(m.tool_calls_json)
        for c in calls:
            fn = c.get("function", {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    raise InvalidRequestError("messages.tool_calls.function.arguments",
                                              fn["arguments"][:100], "not JSON") from None
        out["tool_calls"] = calls
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


def _absorb(st: Attempt, chunk) -> api_pb2.GenerateResponse:
    """Take one decode chunk's news into ``st``; the delta message for the client."""
    if chunk.HasField("transfer"):
        t = chunk.transfer
        st.transfer_s = t.handshake_s + t.read_s + t.release_s
        st.blocks_read, st.blocks_local = t.blocks_read, t.blocks_local
        st.transports = t.transports
        st.span.set({"baton.kv.bytes": t.bytes})
    if chunk.num_cached_tokens:
        st.cached = chunk.num_cached_tokens
        st.cached_host, st.cached_disk = chunk.cached_tokens_host, chunk.cached_tokens_disk
    if chunk.queue_s:
        st.queue_s = chunk.queue_s
    lps = list(chunk.logprobs)
    if len(st.tokens) == st.start and st.first_logprob and len(lps) < len(chunk.token_ids):
        lps = st.first_logprob + lps  # the hand-off's first token: prefill's
    st.tokens.extend(chunk.token_ids)
    return st.delta(chunk.token_ids, chunk.text, lps)


def _client_gone() -> RequestError:
    return RequestError(Status.CANCELLED, "the client went away")


def _prefill_key(rid: str) -> str:
    """The in-flight claim of a request's prefill, apart from its decode's."""
    return f"{rid}/prefill"
