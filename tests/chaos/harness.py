"""Fault injection for the chaos suite: a real cluster (tests/support/cluster.py: redis-server,
one prefill worker, two decode workers, a router; the real SmolLM2 model), a load of streaming
clients with deadlines, and the checks every fault must pass::

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
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
from baton_client.v1 import api_pb2, api_pb2_grpc

from tests.chaos.proxy import FaultyProxy
from tests.support.cluster import Cluster
from tests.support.processes import free_port

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


def request(i: int, max_tokens: int, cache_salt: str | None = None) -> api_pb2.GenerateRequest:
    req = api_pb2.GenerateRequest(params=api_pb2.SamplingParams(max_tokens=max_tokens,
                                                                   cache_salt=cache_salt))
    req.chat.messages.add(role="user", content=PROMPTS[i % len(PROMPTS)])
    return req


def reference(engine, max_tokens: int) -> list[list[int]]:
    """The engine's greedy output for each prompt, computed in-process."""
    from baton.engine.params import SamplingParams

    ids = [engine.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    return [o.token_ids for o in engine.generate(ids, SamplingParams(max_tokens=max_tokens))]


def chaos_cluster(start_cluster) -> tuple[Cluster, FaultyProxy]:
    """One prefill worker, two decode workers (the second reached through a proxy that can
    delay, stall or cut its traffic: routers and peers use the port it advertises, the
    proxy's) and a router that takes a decode worker silent for 3 s mid-stream as hung."""
    port = free_port()
    proxy = FaultyProxy(port)
    try:
        c = start_cluster(
            prefill=1, decode=2,
            # short TTLs: a dead worker leaves the registry, and blocks leased to a reader that
            # died come back, within a test
            worker_args=["--num-blocks", "200", "--registry-ttl", "2"],
            # decode steps of at least 20 ms: on a fast machine a worker otherwise generates a
            # whole answer ahead of its client (the tokens wait in socket buffers), and a worker
            # stopped "mid-stream" has nothing left to stall
            role_args={"decode": ["--transfer-timeout", "5", "--faults", "step_delay=0.02"],
                       "prefill": ["--lease-ttl", "8"]},
            decode_args=lambda c, i: (["--port", str(port), "--advertise-port",
                                       str(proxy.port)] if i == 1 else []),
            routers=[["--local-prefill-max-tokens", "0", "--stall-timeout", "3"]])
    except BaseException:
        proxy.close()
        raise
    return c, proxy


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

    cluster: Cluster
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
        self.cluster.on_after_test(self.halt)
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
