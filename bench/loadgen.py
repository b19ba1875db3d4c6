"""Baton's load generator: workloads, arrivals, targets, and the metric arithmetic.

A *workload* is a list of :class:`Req` (prompt token ids, output length, arrival offset). A
*target* runs one request and returns a :class:`Record` of when each token arrived: Baton's
gRPC API (:class:`GrpcTarget`) or any OpenAI-compatible ``/v1/completions`` (:class:`OpenAITarget`:
Baton's HTTP front, vLLM, ...). :func:`run` drives a target open-loop (each request at its
arrival time, from up to 512 clients; its times count from its arrival even when it waited for
a client) or closed-loop (``concurrency`` in flight).
:func:`summarize` turns records into TTFT / TPOT / ITL / end-to-end statistics, throughput and
SLO attainment; :func:`find_goodput` searches the highest rate at which a share (90%) of requests
meet both SLOs.

Prompts are token ids, so every target sees exactly the same lengths; every run salts its
random tokens so that one run never finds another's prompts in a prefix cache (shared-prefix
workloads share within a run, on purpose). Outputs are exact lengths (``ignore_eos``).
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from baton.bench.common import pct
from baton.control.workload import (  # noqa: F401 (the workloads are part of the loadgen API)
    Record,
    Req,
    Tokens,
    azure,
    find_goodput,
    meets,
    mooncake,
    multi_turn,
    poisson,
    request_row,
    sampling_params,
    shared_prefix,
    speed_up,
    synthetic,
    with_sampling,
)

# ---- workloads -----------------------------------------------------------------------------------


class GrpcTarget:
    """Baton's public gRPC API through :mod:`baton.client`."""

    name = "grpc"

    def __init__(self, address: str, token: str | None = None, tls_ca: str | None = None,
                 timeout: float = 600.0) -> None:
        from baton.client import Client

        roots = Path(tls_ca).read_bytes() if tls_ca else None
        self.client = Client(address, tls=bool(tls_ca), root_certificates=roots, token=token,
                             max_retries=0)
        self.timeout = timeout

    def __call__(self, req: Req) -> Record:
        from baton.client import BatonError

        rec = Record(len(req.prompt), req.max_tokens, time.monotonic())
        try:
            stream = self.client.stream(token_ids=req.prompt, max_tokens=req.max_tokens,
                                        ignore_eos=True, timeout=self.timeout,
                                        **sampling_params(req.sampling))
            for delta in stream:
                now = time.monotonic()
                if delta.token_ids:
                    rec.first = rec.first or now
                    rec.chunk_times.append(now)
                    rec.output_tokens += len(delta.token_ids)
            rec.end = time.monotonic()
            rec.path, rec.stages = stream.result.path, ttft_stages(stream.result)
            rec.cached_tokens = stream.result.usage.cached_tokens
        except BatonError as e:
            rec.error, rec.detail = e.code.name, str(e)[:300]
        return rec

    def close(self) -> None:
        self.client.close()


def ttft_stages(result) -> dict[str, float]:
    """Where the router says a request's first token went, in seconds. Both paths: the router's
    waits (``wait``: for a slot, --max-concurrent, and for a decode worker with room in its
    batch) and routing. Remote path: the prefill worker's queue, its prefill, the KV hand-off,
    and the rest until the decode worker's first chunk (it admits the request and streams the
    prefill's token at its next step). Local path: the decode worker's queue, and its
    prefill."""
    t = result.timing
    wait = getattr(t, "admission_wait_s", 0.0) + getattr(t, "decode_wait_s", 0.0)
    if result.path == "local":
        return {"wait": wait, "route": t.route_s, "queue": t.queue_s,
                "prefill": max(t.first_token_s - wait - t.route_s - t.queue_s, 0.0)}
    return {"wait": wait, "route": t.route_s, "queue": t.queue_s,
            "prefill": max(t.prefill_s - t.queue_s, 0.0), "transfer": t.transfer_s,
            "decode_first": max(t.first_token_s - wait - t.route_s - t.prefill_s
                                - t.transfer_s, 0.0)}


class OpenAITarget:
    """Any OpenAI-compatible server's streaming ``/v1/completions`` (token-id prompts,
    ``ignore_eos``: vLLM's extension, which Baton's HTTP front understands too)."""

    name = "openai"

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 timeout: float = 600.0) -> None:
        u = urllib.parse.urlsplit(base_url.rstrip("/"))
        self.https, self.host, self.prefix = u.scheme == "https", u.netloc, u.path or "/v1"
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout
        self.model = model or self._first_model()

    def _conn(self):
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, timeout=self.timeout)

    def _first_model(self) -> str:
        c = self._conn()
        c.request("GET", f"{self.prefix}/models", headers=self.headers)
        r = c.getresponse()
        body = r.read()
        if r.status != 200:
            raise RuntimeError(f"{self.host}{self.prefix}/models: HTTP {r.status} {body[:200]}")
        return json.loads(body)["data"][0]["id"]

    def __call__(self, req: Req) -> Record:
        rec = Record(len(req.prompt), req.max_tokens, time.monotonic())
        body = json.dumps({"model": self.model, "prompt": req.prompt,
                           "max_tokens": req.max_tokens, **sampling_params(req.sampling),
                           "stream": True, "ignore_eos": True,
                           "stream_options": {"include_usage": True}})
        c = self._conn()
        try:
            c.request("POST", f"{self.prefix}/completions", body=body, headers=self.headers)
            r = c.getresponse()
            if r.status != 200:
                rec.error = f"HTTP {r.status}"
                r.read()
                return rec
            usage = None
            for raw in r:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("error"):
                    rec.error = str(msg["error"].get("type") or "error")
                    return rec
                if msg.get("usage"):
                    usage = msg["usage"]
                if msg.get("choices") and msg["choices"][0].get("text"):
                    now = time.monotonic()
                    rec.first = rec.first or now
                    rec.chunk_times.append(now)
                    rec.output_tokens += 1
            rec.end = time.monotonic()
            if usage:  # a chunk may carry several tokens: the server's count is the truth
                rec.output_tokens = usage.get("completion_tokens", rec.output_tokens)
        except (OSError, http.client.HTTPException, ValueError) as e:
            rec.error = type(e).__name__
        finally:
            c.close()
        return rec

    def close(self) -> None:
        pass


def target_for(spec: str, **kw):
    """``grpc://host:port`` or ``host:port`` (Baton's gRPC API) or ``http(s)://host:port/v1``
    (OpenAI API)."""
    if spec.startswith(("http://", "https://")):
        return OpenAITarget(spec, model=kw.get("model"), api_key=kw.get("token"))
    return GrpcTarget(spec.removeprefix("grpc://"), token=kw.get("token"),
                      tls_ca=kw.get("tls_ca"))


# ---- running -------------------------------------------------------------------------------------


OPEN_LOOP_CLIENTS = 512


def run(target: Callable[[Req], Record], reqs: Sequence[Req], concurrency: int = 0,
        progress: Callable[[int, int], None] | None = None,
        clients: int = OPEN_LOOP_CLIENTS) -> tuple[list[Record], float]:
    """Send ``reqs``: open loop at their ``at`` times (``concurrency`` 0), or closed loop with
    ``concurrency`` in flight. Returns the records (in request order) and the wall time.

    Open loop sends from at most ``clients`` threads. A request that arrives while all of
    them wait on earlier ones is sent when one is free, and its times count from its arrival
    (``Record.late``: how long it waited for a client), so a backlog past ``clients`` shows in
    TTFT and end-to-end time instead of vanishing from them; the servers see it late."""
    records: list[Record | None] = [None] * len(reqs)
    done = 0
    lock = threading.Lock()
    t0 = time.monotonic()

    def one(i: int) -> None:
        nonlocal done
        rec = target(reqs[i])
        if concurrency <= 0:
            due = t0 + reqs[i].at
            rec.late, rec.sent = max(rec.sent - due, 0.0), min(rec.sent, due)
        records[i] = rec
        with lock:
            done += 1
            if progress is not None:
                progress(done, len(reqs))

    ex = ThreadPoolExecutor(concurrency if concurrency > 0 else min(clients, max(1, len(reqs))))
    try:
        if concurrency > 0:
            list(ex.map(one, range(len(reqs))))
        else:
            for i, r in enumerate(reqs):
                wait = t0 + r.at - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                ex.submit(one, i)
        ex.shutdown(wait=True)
    except BaseException:
        # Ctrl-C (or an error): a request not yet started never is, and the caller does not
        # wait for those in flight, which end when it stops their servers
        ex.shutdown(wait=False, cancel_futures=True)
        raise
    return records, time.monotonic() - t0  # type: ignore[return-value]


class ClosedLoop:
    """A changing number of closed-loop clients: each sends its next request (from
    ``make(rng)``) when its last one ended, until :meth:`set` takes it away (after its request in
    flight). Counts requests that succeeded and the failures: an error, or fewer tokens than
    asked."""

    def __init__(self, target: Callable[[Req], Record],
                 make: Callable[[random.Random], Req]) -> None:
        self.target, self.make = target, make
        self.ok, self.errors = 0, []  # errors: (time.time(), what)
        self._clients: list[tuple[threading.Thread, threading.Event]] = []
        self._lock = threading.Lock()

    def set(self, n: int) -> None:
        while len(self._clients) > n:
            t, stop = self._clients.pop()
            stop.set()
            t.join()
        while len(self._clients) < n:
            stop = threading.Event()
            t = threading.Thread(target=self._client, args=(stop, len(self._clients)),
                                 daemon=True)
            self._clients.append((t, stop))
            t.start()

    def _client(self, stop: threading.Event, seed: int) -> None:
        rng = random.Random(f"{seed}/{time.time_ns()}")
        while not stop.is_set():
            req = self.make(rng)
            rec = self.target(req)
            err = rec.error or (None if rec.output_tokens == req.max_tokens
                                else f"short: {rec.output_tokens} of {req.max_tokens} tokens")
            with self._lock:
                if err is None:
                    self.ok += 1
                else:
                    self.errors.append((time.time(), err))


# ---- metrics -------------------------------------------------------------------------------------


def warm_up(target: Callable[[Req], Record], vocab: tuple[int, int] = (100, 10000)) -> None:
    """Two short requests, one at a time, before a measured run (first calls pay connection
    set-up and the workers' first-step costs)."""
    run(target, synthetic(2, (32, 32), (4, 4), Tokens(*vocab, "warm")), 1)


def stats(xs: Sequence[float]) -> dict:
    if not xs:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    return {"n": len(xs), "mean": sum(xs) / len(xs), "p50": pct(xs, 0.5),
            "p90": pct(xs, 0.9), "p99": pct(xs, 0.99)}


def summarize(records: Sequence[Record], wall_s: float, ttft_slo: float,
              tpot_slo: float) -> dict:
    ok = [r for r in records if r.error is None]
    errors: dict[str, int] = {}
    said: dict[str, str] = {}  # each error's first message, where the target gives one
    for r in records:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
            if r.detail and r.error not in said:
                said[r.error] = r.detail
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(records), "succeeded": len(ok), "errors": errors,
        "error_details": said, "wall_s": wall_s,
        "ttft_s": stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": stats([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": stats([x for r in ok for x in r.itls()]),
        "e2e_s": stats([r.e2e for r in ok if r.e2e is not None]),
        # open loop: each request's wait for a free client, counted in its TTFT (see run)
        "late_s": {**stats([r.late for r in records]),
                   "max": max((r.late for r in records), default=None)},
        "output_tokens_per_s": out_tokens / wall_s if wall_s > 0 else None,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "slo": {"ttft_s": ttft_slo, "tpot_s": tpot_slo},
        "attainment": (sum(meets(r, ttft_slo, tpot_slo) for r in records) / len(records)
                       if records else None),
        **_stages(ok),
    }


def _stages(ok: Sequence[Record]) -> dict:
    """Per path (Baton targets): how many requests took it, and percentiles of each stage of
    their time to first token (see :func:`ttft_stages`)."""
    by: dict[str, list[Record]] = {}
    for r in ok:
        if r.stages is not None:
            by.setdefault(r.path or "", []).append(r)
    if not by:
        return {}
    return {"ttft_stages_s": {path: {"requests": len(rs), **{
        k: stats([r.stages[k] for r in rs]) for k in rs[0].stages}} for path, rs in by.items()}}


