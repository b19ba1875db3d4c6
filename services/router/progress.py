"""What the client has been sent so far, across a request's attempts, and the final message.

One :class:`Attempt` per attempt on the workers, and one :class:`Sent` per request: an attempt
after a migration shares the request's ``Sent``, so the tokens and text already streamed carry
over and the workers get the prompt plus those tokens. The final message's timings, path,
workers and usage are built here too, as are the tracing attributes that describe a request
and its worker calls.
"""

from __future__ import annotations

import time
import uuid

from baton.control.registry import WorkerRecord
from baton.engine import tool_calls
from baton.engine.tokenizer import BatonTokenizer
from baton.services.common import tracing
from baton.services.router.routing import Decision
from baton_client.v1 import api_pb2


class Sent:
    """What the client has been sent, across every attempt of a request (a migration hands the
    same record to the next attempt, so nothing is sent twice or lost)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []  # every token sent to the client
        self.text = ""  # every character sent to the client
        self.unsent_text = ""  # goes out before the next attempt's text (see Attempt.migrated)
        self.any = False  # anything at all reached the client
        self.first_at: float | None = None
        self.second_at: float | None = None  # after the first token
        self.last_at: float | None = None
        self.migrations = 0
        self.migrated_from: list[str] = []  # the failed decode workers, in order
        # before the first token: waiting for a router slot, and for a decode slot
        self.admission_wait_s = self.decode_wait_s = 0.0
        # how the final message splits the answer: tool calls in this format, a thinking block
        self.tool_format: str | None = None
        self.think = False


class Attempt:
    """One attempt on the workers and its figures for the final message. ``sent`` is the
    request's :class:`Sent`, shared with the attempts before and after this one: the workers
    get the prompt plus the tokens already sent (``ids``), with ``max_tokens`` reduced by
    them."""

    def __init__(self, rid: str, prompt: list[int], t0: float, attempt: int, sent: Sent,
                 metrics=None, span=tracing.NO_SPAN, last_delta_in_final: bool = False,
                 request_ids: tuple[str, str] = ("", "")) -> None:
        """``rid``: this attempt's id on the workers; ``request_ids``: the client's label and
        the router's id for the whole request, echoed in the final message."""
        self.rid, self.prompt, self.t0, self.attempt = rid, prompt, t0, attempt
        self.sent, self.request_ids = sent, request_ids
        self.last_delta_in_final = last_delta_in_final
        self.metrics, self.span = metrics, span
        self.start = len(sent.tokens)  # this attempt's first token's index in sent.tokens
        self.ids = prompt + sent.tokens  # the prompt the workers get
        self.cached = 0
        self.cached_host = self.cached_disk = 0  # of cached: loaded from the workers' KV tiers
        self.prefill_s = self.transfer_s = 0.0
        self.transports = self.prefill_worker = self.decode_worker = ""
        self.first_logprob: list = []
        self.route_s = self.queue_s = 0.0
        self.decision: Decision | None = None
        self.blocks_read = self.blocks_local = 0

    @property
    def tokens(self) -> list[int]:
        return self.sent.tokens

    @property
    def migrations(self) -> int:
        return self.sent.migrations

    def params(self, p):
        """The request's sampling parameters for this attempt: ``max_tokens`` less the tokens
        already sent, which end the prompt the workers get and count as output there
        (``output_prefix``: penalties and ``min_tokens`` see them as the earlier attempt did)."""
        if self.start == 0:
            return p
        q = type(p)()
        q.CopyFrom(p)
        q.max_tokens = p.max_tokens - self.start
        q.output_prefix = p.output_prefix + self.start
        return q

    def migrated(self, worker_id: str, tokenizer: BatonTokenizer) -> None:
        """The decode worker failed after streaming ``tokens``: the next attempt resumes after
        them. Text the worker held back (an unfinished UTF-8 character, a possible stop string's
        start) was never sent; it goes out first, from the router's own decode of the tokens."""
        sent = self.sent
        sent.migrations += 1
        sent.migrated_from.append(worker_id)
        seed = self.prompt[-5:]  # as the workers' detokenizer: context for a leading space
        full = tokenizer.decode(seed + sent.tokens)[len(tokenizer.decode(seed)):]
        if full.startswith(sent.text):
            sent.unsent_text = full[len(sent.text):].rstrip("\ufffd")

    def route(self, decision: Decision, start: float, end: float, waited: float = 0.0) -> None:
        """The routing decision, made between ``start`` and ``end``, ``waited`` of it in the
        decode queue (counted in the request's decode wait while no token was sent)."""
        self.decision, self.route_s = decision, end - start - waited
        if not self.sent.any:
            self.sent.decode_wait_s += waited
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
        now, sent = time.monotonic(), self.sent
        if sent.first_at is None:
            sent.first_at = now
        elif sent.second_at is None and token_ids:
            sent.second_at = now
        if sent.last_at is not None and self.metrics is not None:
            self.metrics.itl.observe(now - sent.last_at)
        sent.last_at = now
        sent.any = True
        if sent.unsent_text:
            text, sent.unsent_text = sent.unsent_text + text, ""
        sent.text += text
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
        sent = self.sent
        if sent.migrations:
            path = "migrated"
        now = time.monotonic()
        first = sent.first_at or now
        d = self.decision
        reasoning: str = ""
        content: str | None = ""
        calls: list[tool_calls.ToolCall] = []
        if sent.tool_format or sent.think:
            reasoning, content, calls = tool_calls.answer_parts(sent.text, sent.tool_format,
                                                                sent.think)
        return api_pb2.GenerateResponse(final=api_pb2.GenerateFinal(
            tool_calls=[api_pb2.ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=c.name,
                                         arguments=c.arguments) for c in calls],
            content=content or "", reasoning_content=reasoning,
            finish_reason=reason, path=path, prefill_worker=self.prefill_worker,
            decode_worker=self.decode_worker, transports=self.transports, retries=self.attempt,
            prompt_token_ids=self.prompt, route_reason=d.reason if d else "",
            migrations=sent.migrations, migrated_from=sent.migrated_from,
            index_cached_tokens=d.cached_tokens if d else 0,
            index_used=d.used_index if d else False, kv_blocks_read=self.blocks_read,
            kv_blocks_local=self.blocks_local, last_delta=last_delta,
            request_id=self.request_ids[0], router_request_id=self.request_ids[1],
            usage=api_pb2.Usage(prompt_tokens=len(self.prompt),
                                cached_tokens=min(self.cached, len(self.prompt)),
                                completion_tokens=len(sent.tokens),
                                cached_tokens_host=self.cached_host,
                                cached_tokens_disk=self.cached_disk),
            timing=api_pb2.Timing(prefill_s=self.prefill_s, transfer_s=self.transfer_s,
                                  first_token_s=first - self.t0, decode_s=now - first,
                                  total_s=now - self.t0, route_s=self.route_s,
                                  queue_s=self.queue_s,
                                  first_decode_step_s=(sent.second_at - first
                                                       if sent.second_at else 0.0),
                                  admission_wait_s=sent.admission_wait_s,
                                  decode_wait_s=sent.decode_wait_s)))


def request_attrs(request, model: str, rid: str) -> tuple[str, dict]:
    """The request span's name and attributes (OpenTelemetry GenAI conventions, plus Baton's)."""
    op = "chat" if request.WhichOneof("input") == "chat" else "text_completion"
    p = request.params
    return f"{op} {model}", {
        "gen_ai.operation.name": op, "gen_ai.provider.name": "baton",
        "gen_ai.request.model": request.model or model,
        "gen_ai.request.max_tokens": p.max_tokens,
        "gen_ai.request.temperature": p.temperature,
        "gen_ai.request.top_p": p.top_p if p.HasField("top_p") else None,
        "gen_ai.request.top_k": p.top_k or None,
        "gen_ai.request.seed": p.seed if p.HasField("seed") else None,
        "gen_ai.request.stop_sequences": list(p.stop) or None,
        "gen_ai.response.id": rid, "gen_ai.response.model": model,
        "baton.request_id": rid, "baton.client_request_id": request.request_id or None}


def final_attrs(f) -> dict:
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


def call_span(span, worker: WorkerRecord, service: str, method: str):
    """The client span of a call to a worker, under the request's ``span``."""
    if not span.recording:
        return tracing.NO_SPAN
    host, _, port = worker.address.rpartition(":")
    return span.child(f"baton.v1.{service}/{method}", "client", {
        "rpc.system": "grpc", "rpc.service": f"baton.v1.{service}", "rpc.method": method,
        "server.address": host, "server.port": int(port) if port.isdigit() else None,
        "baton.worker.id": worker.worker_id})
