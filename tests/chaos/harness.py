"""Fault injection for the chaos suite: a real cluster (redis-server, one prefill worker, two
decode workers, a router; the real SmolLM2 model), a load of streaming clients with deadlines,
and the checks every fault must pass::

    every request ends by its deadline + MARGIN_S    success, or a typed gRPC status
    every success equals the engine's greedy output  (migrated ones included)
    once quiet: free == total blocks, no leases      on every surviving worker, integrity checked

Each fault's counts (sent, succeeded, failed by status, migrated, retried) are printed and, with
``BATON_CHAOS_REPORT=FILE``, appended to FILE as JSON lines.
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
from baton.control.redis_server import EmbeddedRedis
from baton.services.common.launch import WorkerProcess
from baton.v1 import api_pb2, api_pb2_grpc, worker_pb2, worker_pb2_grpc

from tests.chaos.proxy import FaultyProxy

MARGIN_S = 3.0
# what a request may end with besides OK: each names what went wrong; never UNKNOWN or INTERNAL
TYPED = {"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "RESOURCE_EXHAUSTED", "ABORTED"}

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers greater than 100.",
    "Explain what a KV cache is in one sentence.",
    "Name the planets of the solar system.",
    "Why is the sky blue?",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(i: int, max_tokens: int, cache_salt: str | None = None) -> api_pb2.GenerateRequest:
    req = api_pb2.GenerateRequest(params=worker_pb2.SamplingParams(max_tokens=max_tokens,
                                                                   cache_salt=cache_salt))
    req.chat.messages.add(role="user", content=PROMPTS[i % len(PROMPTS)])
    return req


def reference(engine, max_tokens: int) -> list[list[int]]:
    """The engine's greedy output for each prompt, computed in-process."""
    from baton.engine.params import SamplingParams

    ids = [engine.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    return [o.token_ids for o in engine.generate(ids, SamplingParams(max_tokens=max_tokens))]


def info(w: WorkerProcess, timeout: float = 30.0) -> worker_pb2.InfoResponse:
    """A worker's Info with an integrity check, waiting for its channel (which may be
    reconnecting after a network fault) rather than failing at once."""
    stub = (worker_pb2_grpc.PrefillWorkerStub(w.channel) if w.role == "prefill"
            else worker_pb2_grpc.DecodeWorkerStub(w.channel))
    end = time.monotonic() + timeout
    while True:
        try:
            return stub.Info(worker_pb2.InfoRequest(check_integrity=True), timeout=timeout,
                             wait_for_ready=True)
        except grpc.RpcError as e:  # a connection the fault broke, seen once
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > end:
                raise
            time.sleep(0.2)


class ChaosCluster:
    def __init__(self, router_args: tuple[str, ...] = ()) -> None:
        self.redis = EmbeddedRedis().start()
        # one torch thread each: four processes on a small CI machine with torch's default
        # (every core per process) spin against each other and decode ~20x slower
        self.common = ["--num-blocks", "200", "--redis-url", self.redis.url,
                       "--registry-ttl", "2", "--threads", "1"]
        self.prefill = self.start("prefill")
        # the second decode worker is reached through a proxy that can delay, stall or cut
        # its traffic (routers and peers use the port it advertises: the proxy's)
        port = free_port()
        self.proxy = FaultyProxy(port)
        self.decode = [self.start("decode"),
                       self.start("decode", "--port", str(port), "--advertise-port",
                                  str(self.proxy.port))]
        # a decode worker silent for 3 s mid-stream is hung: its requests move elsewhere
        self.router_args = ["--redis-url", self.redis.url, "--http-port", "-1",
                            "--local-prefill-max-tokens", "0", "--stall-timeout", "3",
                            *router_args]
        self.router = WorkerProcess("router", self.router_args)
        self.loads: list[Load] = []  # every Load started, halted after each test
        self.extra: list[WorkerProcess] = []  # workers a test added for itself alone

    def start(self, role: str, *args: str) -> WorkerProcess:
        """A new worker of ``role`` (it joins through the registry; nothing else restarts)."""
        # short lease TTL: blocks leased to a reader that died come back within the test
        extra = ["--transfer-timeout", "5"] if role == "decode" else ["--lease-ttl", "8"]
        return WorkerProcess(role, [*self.common, *extra, *args])

    def workers(self) -> list[WorkerProcess]:
        return [w for w in (self.prefill, *self.decode) if w.proc.poll() is None]

    def restart_router(self) -> None:
        self.router.kill()
        self.router = WorkerProcess("router", self.router_args)

    def blocks_held(self) -> list[tuple[str, int, int, int]]:
        """(worker, blocks in use, active leases, running requests) of each live worker that
        holds anything."""
        held = []
        for w in self.workers():
            i = info(w)
            assert i.integrity_ok, (w.worker_id, i.integrity_error)
            if i.num_free_blocks != i.num_blocks or i.active_leases or i.running_requests:
                held.append((w.worker_id, i.num_blocks - i.num_free_blocks, i.active_leases,
                             i.running_requests))
        return held

    def assert_quiet_and_nothing_held(self, timeout: float = 40.0) -> None:
        """free == total, no leases, nothing running, on every live worker (leases of requests
        whose reader died end at the lease TTL at the latest)."""
        end = time.monotonic() + timeout
        while (held := self.blocks_held()) and time.monotonic() < end:
            time.sleep(0.25)
        assert not held, held

    def start_extra(self, role: str, *args: str) -> WorkerProcess:
        """A worker for one test: :meth:`after_test` kills it if the test did not."""
        w = self.start(role, *args)
        self.extra.append(w)
        return w

    def after_test(self) -> None:
        """Leave nothing of a test (passed or failed) to the next: its clients stop sending and
        the workers it added for itself are killed, so one failure does not fail every test
        after it."""
        for load in self.loads:
            load.halt()
        self.loads.clear()
        for w in self.extra:
            if w.proc.poll() is None:
                w.kill()
        self.extra.clear()

    def stop(self) -> None:
        self.after_test()
        for w in (self.router, *self.decode, self.prefill):
            w.stop()
        self.proxy.close()
        self.redis.stop()


@dataclass
class Outcome:
    prompt: int
    code: str  # "OK" or the gRPC status name
    ids: list[int]
    elapsed: float
    deadline: float
    final: api_pb2.GenerateFinal | None = None
    details: str = ""


@dataclass
class Load:
    """``clients`` threads, each sending one streaming request after another (prompt chosen in
    turn) with ``deadline`` seconds each, until :meth:`stop`. ``cancel_after``: a client drops
    its call after a delay drawn from this list (0 = right after sending; None = never)."""

    cluster: ChaosCluster
    clients: int = 4
    deadline: float = 30.0
    max_tokens: int = 32
    cancel_after: list[float] | None = None
    # a salt of its own for every request: no cached prefix steers the routing, which then
    # spreads requests by load alone (one salt for all lets each prompt stick to the worker
    # that first served it)
    salt_each: bool = False
    outcomes: list[Outcome] = field(default_factory=list)
    # tokens received so far by each client's request in flight, and its prompt's index
    progress: dict[int, int] = field(default_factory=dict)
    prompt_of: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._n = 0
        self._nonce = time.time_ns()
        self._threads = [threading.Thread(target=self._client, args=(c,), daemon=True)
                         for c in range(self.clients)]

    def start(self) -> Load:
        self.cluster.loads.append(self)
        for t in self._threads:
            t.start()
        return self

    def halt(self) -> None:
        """Stop sending and wait a while for the calls in flight (cleanup: asserts nothing)."""
        self._stop.set()
        for t in self._threads:
            t.join(self.deadline + 2 * MARGIN_S)

    def stop(self) -> list[Outcome]:
        self.halt()
        assert not any(t.is_alive() for t in self._threads), "a client never got an answer"
        return self.outcomes

    def wait_for(self, n: int, timeout: float = 120.0) -> None:
        """Until ``n`` requests have ended."""
        end = time.monotonic() + timeout
        while len(self.outcomes) < n:
            assert time.monotonic() < end, f"only {len(self.outcomes)} of {n} requests ended"
            time.sleep(0.05)

    def wait_more(self, k: int, timeout: float = 120.0) -> None:
        """Until ``k`` more requests have ended than have now."""
        self.wait_for(len(self.outcomes) + k, timeout)

    def _client(self, c: int) -> None:
        rng = random.Random(c)
        while not self._stop.is_set():
            with self._lock:
                i, self._n = self._n, self._n + 1
            cancel = rng.choice(self.cancel_after) if self.cancel_after else None
            self.prompt_of[c] = i % len(PROMPTS)
            self.progress[c] = 0
            out = self._one(c, i, cancel)
            del self.progress[c]
            self.outcomes.append(out)
            if out.code not in ("OK", "CANCELLED"):
                time.sleep(0.2)  # as a client would back off before trying again

    def streaming(self, want: list[list[int]] | None = None, left: int = 0) -> bool:
        """Every request in flight has had tokens (none is still before its first) and, given
        the ``want``ed outputs, has at least ``left`` still to come (none is about to end)."""
        now = list(self.progress.items())
        if not now or min(n for _, n in now) == 0:
            return False
        if want is None:
            return True
        return all(len(want[self.prompt_of[c]]) - n >= left for c, n in now)

    def _one(self, c: int, i: int, cancel: float | None) -> Outcome:
        ids, final = [], None
        t0 = time.monotonic()
        try:
            stub = api_pb2_grpc.BatonStub(self.cluster.router.channel)
            salt = f"{self._nonce}-{i}" if self.salt_each else None
            call = stub.Generate(request(i, self.max_tokens, salt),
                                 timeout=self.deadline)
            if cancel is not None:
                threading.Timer(cancel, call.cancel).start()
            for msg in call:
                if msg.HasField("delta"):
                    ids += msg.delta.token_ids
                    self.progress[c] = len(ids)
                else:
                    final = msg.final
        except grpc.RpcError as e:
            return Outcome(i % len(PROMPTS), e.code().name, ids, time.monotonic() - t0,
                           self.deadline, details=e.details() or "")
        except (ValueError, AttributeError) as e:  # a router replaced meanwhile: its channel
            # is closed (ValueError) or already dropped (None)
            return Outcome(i % len(PROMPTS), "UNAVAILABLE", ids, time.monotonic() - t0,
                           self.deadline, details=str(e))
        return Outcome(i % len(PROMPTS), "OK", ids, time.monotonic() - t0, self.deadline, final)


def check(name: str, outcomes: list[Outcome], want: list[list[int]],
          allowed: set[str] = TYPED) -> Counter:
    """The per-request promises; returns the counts by status, printed and reported."""
    assert outcomes, "no request was sent"
    for o in outcomes:
        assert o.elapsed <= o.deadline + MARGIN_S, (name, o)
        assert o.code == "OK" or o.code in allowed, (name, o.code, o.details)
        if o.code == "OK":
            assert o.final is not None and o.final.finish_reason, (name, o)
            assert o.ids == want[o.prompt], (name, o.prompt, o.final.path, o.ids,
                                             want[o.prompt])
    counts = Counter(o.code for o in outcomes)
    oks = [o.final for o in outcomes if o.code == "OK"]
    row = {"fault": name, "sent": len(outcomes), "succeeded": counts.pop("OK", 0),
           "failed": dict(counts), "migrated": sum(f.migrations > 0 for f in oks),
           "retried": sum(f.retries > 0 for f in oks),
           "max_elapsed_s": round(max(o.elapsed for o in outcomes), 2)}
    print(f"\nchaos {json.dumps(row)}")
    report = os.environ.get("BATON_CHAOS_REPORT")
    if report:
        with open(report, "a") as f:
            f.write(json.dumps(row) + "\n")
    return Counter({"OK": row["succeeded"], **counts})
