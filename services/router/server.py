"""The router: Baton's public gRPC API in front of the prefill and decode pools.

``python -m baton.services.router --redis-url URL [--port 50051]``. Per request: validate and
tokenize (the workers' own tokenizer, fetched from one of them at start-up), choose the path,
call the workers, relay the stream, end with usage, path and timings::

    remote: Prefill on a prefill worker ─handle─► Decode on a decode worker (KV by NIXL) ─► client
    local:  Generate on a decode worker (it prefills itself) ───────────────────────────► client

The path is remote when the prompt is longer than ``--local-prefill-max-tokens`` and a prefill
worker is registered; the final message always says which was taken. Nothing reaches the client
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
import threading
import time
import uuid
from contextlib import contextmanager

import grpc
from baton.control.registry import WorkerRecord, WorkerRegistry
from baton.engine.errors import InvalidRequestError
from baton.engine.tokenizer import BatonTokenizer
from baton.services.common.worker import (
    abort_with,
    add_standard_services,
    announce,
    make_server,
    new_incarnation,
    params_from_proto,
    serve_forever,
    setup_logging,
)
from baton.v1 import api_pb2, api_pb2_grpc, worker_pb2, worker_pb2_grpc

log = logging.getLogger("baton.services.router")

DEFAULT_TIMEOUT_S = 600.0


class NoWorkerError(Exception):
    pass


class WorkerPool:
    """Live workers from the registry (re-read at most every ``refresh_s``), one channel per
    address, and the router's own count of requests in flight on each (least-loaded first)."""

    def __init__(self, registry: WorkerRegistry, refresh_s: float = 1.0) -> None:
        self.registry, self.refresh_s = registry, refresh_s
        self._workers: list[WorkerRecord] = []
        self._read_at = 0.0
        self._channels: dict[str, grpc.Channel] = {}
        self._inflight: dict[str, int] = {}
        self._turns: dict[str, int] = {}
        self._lock = threading.Lock()

    def workers(self, role: str | None = None) -> list[WorkerRecord]:
        with self._lock:
            if time.monotonic() - self._read_at > self.refresh_s:
                self._workers = self.registry.workers()
                self._read_at = time.monotonic()
            ws = self._workers
        return [w for w in ws if role is None or w.role == role or
                (w.role == "both" and role != "both")]

    def pick(self, role: str, exclude: set[str]) -> WorkerRecord:
        candidates = [w for w in self.workers(role) if w.address not in exclude]
        if not candidates:
            known = len(self.workers(role))
            raise NoWorkerError(f"no {role} worker available ({known} registered, "
                                f"{len(exclude)} failed for this request)")
        with self._lock:
            least = min(self._inflight.get(w.address, 0) for w in candidates)
            ties = [w for w in candidates if self._inflight.get(w.address, 0) == least]
            turn = self._turns[role] = self._turns.get(role, -1) + 1
            return ties[turn % len(ties)]  # round-robin (per role) among the least loaded

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

    def forget(self) -> None:
        """Re-read the registry on the next pick (a worker just failed)."""
        with self._lock:
            self._read_at = 0.0


class _Retry(Exception):
    """A worker was unavailable before anything reached the client: try another."""

    def __init__(self, address: str, detail: str) -> None:
        super().__init__(detail)
        self.address = address


class RouterService(api_pb2_grpc.BatonServicer):
    def __init__(self, pool: WorkerPool, tokenizer: BatonTokenizer, model: str,
                 max_model_len: int, fingerprint: str, local_max_tokens: int = 0,
                 max_retries: int = 2) -> None:
        self.pool, self.tokenizer, self.model = pool, tokenizer, model
        self.max_model_len, self.fingerprint = max_model_len, fingerprint
        self.local_max_tokens, self.max_retries = local_max_tokens, max_retries

    # ---- API -------------------------------------------------------------------------------------

    def ListModels(self, request, context):
        return api_pb2.ListModelsResponse(models=[api_pb2.ModelCard(
            id=self.model, max_model_len=self.max_model_len, fingerprint=self.fingerprint)])

    def Generate(self, request, context):
        t0 = time.monotonic()
        rid = request.request_id or uuid.uuid4().hex
        try:
            ids = self._prompt_ids(request)
            params_from_proto(request.params)  # validation only: the workers get the proto
        except InvalidRequestError as e:
            abort_with(context, e)
        calls: list = []  # outbound calls in flight, cancelled if the client goes away
        context.add_callback(lambda: [c.cancel() for c in list(calls)])
        failed: set[str] = set()
        for attempt in range(self.max_retries + 1):
            # a retry is a new request on the workers (the failed attempt may still be known)
            state = _State(rid if attempt == 0 else f"{rid}.retry{attempt}", ids, t0, attempt)
            try:
                remote = (len(ids) > self.local_max_tokens and self.pool.workers("prefill"))
                steps = (self._remote(request, state, calls, failed, context) if remote
                         else self._local(request, state, calls, failed, context))
                yield from steps
                return
            except _Retry as e:
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

    # ---- paths -----------------------------------------------------------------------------------

    def _remote(self, request, st, calls, failed, context):
        prefill = self.pool.pick("prefill", failed)
        try:  # never hand a request's KV from a worker to itself (a colocated worker)
            decode = self.pool.pick("decode", failed | {prefill.address})
        except NoWorkerError:
            if prefill.role != "both":
                raise
            yield from self._local(request, st, calls, failed, context, worker=prefill)
            return
        st.prefill_worker = prefill.worker_id
        p = request.params
        t = time.monotonic()
        with self.pool.busy(prefill.address):
            fut = worker_pb2_grpc.PrefillWorkerStub(self.pool.channel(prefill.address)).Prefill \
                .future(worker_pb2.PrefillRequest(request_id=st.rid, prompt_token_ids=st.ids,
                                                  params=p), timeout=_left(context))
            calls.append(fut)
            try:
                pre = fut.result()
            except grpc.RpcError as e:
                _fail(e, prefill.address, context, sent=False)
            finally:
                calls.remove(fut)
        st.prefill_s = time.monotonic() - t
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
                lambda stub: stub.Decode(worker_pb2.DecodeRequest(
                    request_id=st.rid, prompt_token_ids=st.ids,
                    first_token_id=pre.first_token_id, params=p, handle=pre.handle,
                    sampler_state=pre.sampler_state), timeout=_left(context)))
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

    def _local(self, request, st, calls, failed, context, worker=None):
        decode = worker or self.pool.pick("decode", failed)
        p = request.params
        yield from self._stream(
            decode, "local", st, calls, context,
            lambda stub: stub.Generate(worker_pb2.LocalRequest(
                request_id=st.rid, prompt_token_ids=st.ids, params=p), timeout=_left(context)))

    def _stream(self, decode, path, st, calls, context, start):
        st.decode_worker = decode.worker_id
        with self.pool.busy(decode.address):
            call = start(worker_pb2_grpc.DecodeWorkerStub(self.pool.channel(decode.address)))
            calls.append(call)
            reason = ""
            try:
                for chunk in call:
                    if chunk.HasField("transfer"):
                        t = chunk.transfer
                        st.transfer_s = t.handshake_s + t.read_s + t.release_s
                        st.transports = t.transports
                    if chunk.num_cached_tokens:
                        st.cached = chunk.num_cached_tokens
                    lps = list(chunk.logprobs)
                    if not st.tokens and st.first_logprob and len(lps) < len(chunk.token_ids):
                        lps = st.first_logprob + lps  # the hand-off's first token: prefill's
                    st.tokens.extend(chunk.token_ids)
                    yield st.delta(chunk.token_ids, chunk.text, lps)
                    reason = chunk.finish_reason or reason
            except grpc.RpcError as e:
                _fail(e, decode.address, context, sent=st.sent)
            finally:
                calls.remove(call)
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

    def __init__(self, rid: str, ids: list[int], t0: float, attempt: int) -> None:
        self.rid, self.ids, self.t0, self.attempt = rid, ids, t0, attempt
        self.tokens: list[int] = []
        self.sent = False
        self.cached = 0
        self.prefill_s = self.transfer_s = 0.0
        self.first_at: float | None = None
        self.transports = self.prefill_worker = self.decode_worker = ""
        self.first_logprob: list = []

    def delta(self, token_ids, text, logprobs=()):
        if self.first_at is None:
            self.first_at = time.monotonic()
        self.sent = True
        return api_pb2.GenerateResponse(delta=api_pb2.GenerateDelta(
            text=text, token_ids=token_ids, logprobs=logprobs))

    def final(self, reason: str, path: str):
        now = time.monotonic()
        first = self.first_at or now
        return api_pb2.GenerateResponse(final=api_pb2.GenerateFinal(
            finish_reason=reason, path=path, prefill_worker=self.prefill_worker,
            decode_worker=self.decode_worker, transports=self.transports, retries=self.attempt,
            prompt_token_ids=self.ids,
            usage=api_pb2.Usage(prompt_tokens=len(self.ids), cached_tokens=self.cached,
                                completion_tokens=len(self.tokens)),
            timing=api_pb2.Timing(prefill_s=self.prefill_s, transfer_s=self.transfer_s,
                                  first_token_s=first - self.t0, decode_s=now - first,
                                  total_s=now - self.t0)))


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
    ap.add_argument("--redis-url", required=True, help="the worker registry")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=50051, help="gRPC port (0: pick a free one)")
    ap.add_argument("--http-port", type=int, default=8000,
                    help="OpenAI-compatible HTTP port (0: pick a free one, -1: no HTTP)")
    ap.add_argument("--local-prefill-max-tokens", type=int, default=0,
                    help="prompts up to this many tokens are prefilled on the decode worker "
                         "(local path); longer ones go to a prefill worker (default 0: all)")
    ap.add_argument("--max-retries", type=int, default=2,
                    help="other workers to try when one is unavailable before the first token")
    ap.add_argument("--startup-timeout", type=float, default=300.0,
                    help="seconds to wait for a first worker to register")
    ap.add_argument("--drain-timeout", type=float, default=30.0)
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    setup_logging(args.log_level)
    pool = WorkerPool(WorkerRegistry.from_url(args.redis_url))
    tok, worker = fetch_tokenizer(pool, args.startup_timeout)
    service = RouterService(pool, BatonTokenizer.from_json(json.loads(tok.tokenizer_json)),
                            tok.model, tok.max_model_len, worker.fingerprint,
                            args.local_prefill_max_tokens, args.max_retries)
    server = make_server(max_workers=256)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    api_pb2_grpc.add_BatonServicer_to_server(service, server)
    health = add_standard_services(server, ["baton.v1.Baton"])
    server.start()
    address = f"{args.host}:{port}"
    log.info("router serving %s on %s (workers from %s)", tok.model, address, args.redis_url)
    if args.http_port >= 0:
        from baton.services.router.openai_http import serve_http

        http = serve_http(service, args.host, args.http_port)
        http_address = f"{args.host}:{http.server_address[1]}"
        log.info("OpenAI-compatible HTTP on http://%s/v1", http_address)
        print(f"BATON_HTTP {http_address}", flush=True)
    announce(address, f"router-{args.host}-{port}", new_incarnation())
    serve_forever(server, lambda: None, None, args.drain_timeout, health=health)


if __name__ == "__main__":
    main()
