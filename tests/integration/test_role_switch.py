"""Roles switch while serving (`baton role`), under streaming load from both APIs, on a real
cluster: redis, two prefill and two decode workers on a tiny model, a router with its HTTP
front. A prefill worker becomes a decode worker while it holds leases (its readers delay their
releases), then a decode worker becomes a prefill worker while it streams. Every request of
the plain gRPC stub and of the official openai client equals the greedy reference; none fails;
the leases held at the switch are read and released normally; routers put each worker in its
new role's candidate set; nothing leaks."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
from baton_client.v1 import api_pb2, api_pb2_grpc

from tests.support.cluster import Cluster
from tests.support.reference import REFERENCE_POOL

pytestmark = pytest.mark.slow
PROMPTS = [[(s + 7 * i) % 390 + 5 for i in range(24 + 3 * s)] for s in range(6)]
MAX_TOKENS = 10


def until(cond, what: str, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout  # a hang bound, not a timing assertion
    while not cond():
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.02)


class Load:
    """gRPC streams (two threads) and openai streams (one thread), greedy, until stopped;
    every answer is checked against the reference and kept with its workers."""

    def __init__(self, cluster: Cluster, refs: list[list[int]], texts: list[str]) -> None:
        from openai import OpenAI

        self.stub = api_pb2_grpc.BatonStub(cluster.router.channel)
        self.oc = OpenAI(base_url=f"http://{cluster.router.http_address}/v1", api_key="x")
        self.model = self.oc.models.list().data[0].id
        self.refs, self.texts = refs, texts
        self.done: list[tuple[str, str, str]] = []  # (api, prefill worker, decode worker)
        self.wrong: list = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._grpc, args=(k,)) for k in range(2)]
        self.threads.append(threading.Thread(target=self._openai))
        for t in self.threads:
            t.start()

    def _grpc(self, k: int) -> None:
        i = k
        while not self.stop.is_set():
            i += 1
            n = i % len(PROMPTS)
            r = api_pb2.GenerateRequest(params=api_pb2.SamplingParams(
                max_tokens=MAX_TOKENS, ignore_eos=True))
            r.token_ids.ids.extend(PROMPTS[n])
            ids, final = [], None
            try:
                for m in self.stub.Generate(r, timeout=120):  # a plain generated stub
                    if m.HasField("delta"):
                        ids += m.delta.token_ids
                    else:
                        final = m.final
            except Exception as e:  # noqa: BLE001 -- every failure is the test's finding
                self.wrong.append(("grpc", n, repr(e)))
                continue
            if ids != self.refs[n] or final is None:
                self.wrong.append(("grpc", n, ids))
            else:
                self.done.append(("grpc", final.prefill_worker, final.decode_worker))

    def _openai(self) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            n = i % len(PROMPTS)
            try:
                text = "".join(c.choices[0].text for c in self.oc.completions.create(
                    model=self.model, prompt=PROMPTS[n], max_tokens=MAX_TOKENS, temperature=0,
                    stream=True, extra_body={"ignore_eos": True}))
            except Exception as e:  # noqa: BLE001
                self.wrong.append(("openai", n, repr(e)))
                continue
            if text != self.texts[n]:
                self.wrong.append(("openai", n, text))
            else:
                self.done.append(("openai", "", ""))

    def end(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)


def baton(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "baton.cli.main", *args],
                          capture_output=True, text=True, timeout=120)


def test_roles_switch_under_streaming_load_without_a_failed_request(tiny_llama):
    from baton.engine.engine import LLMEngine
    from baton.engine.params import SamplingParams

    eng = LLMEngine.from_path(str(tiny_llama[0]), REFERENCE_POOL)
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    refs = [o.token_ids for o in outs]
    texts = [o.text for o in outs]
    args = ["--model", str(tiny_llama[0]), "--block-size", "4", "--num-blocks", "256"]
    with Cluster(prefill=2, decode=2, worker_args=args,
                 # readers hold each lease's release 0.5 s: a prefill worker always has some
                 decode_args=lambda c, i: ["--faults", "delay_release=0.5"],
                 routers=[["--http-port", "0", "--local-prefill-max-tokens", "0"]]) as c:
        url = c.redis.url
        p0, d0 = c.prefill[0], c.decode[0]
        load = Load(c, refs, texts)
        try:
            # prefill -> decode while it holds leases its readers have not released
            until(lambda: p0.info().active_leases > 0, "prefill-0 holds a lease")
            r = baton("role", p0.worker_id, "decode", "--redis-url", url)
            assert r.returncode == 0, r.stderr
            assert r.stdout.strip() == f"{p0.worker_id}: prefill -> decode (switch 1)"
            Cluster.wait_router_sees(c.router, prefill=1, decode=3)
            until(lambda: p0.info().active_leases == 0, "its leases read and released")
            until(lambda: any(d == p0.worker_id for _, _, d in load.done),
                  "the router decodes on the switched worker")
            # decode -> prefill while it streams
            until(lambda: d0.info().running_requests > 0, "decode-0 streams")
            r = baton("role", d0.worker_id, "prefill", "--redis-url", url)
            assert r.returncode == 0, r.stderr
            Cluster.wait_router_sees(c.router, prefill=2, decode=2)
            until(lambda: any(p == d0.worker_id for _, p, _ in load.done),
                  "the router prefills on the switched worker")
            count = len(load.done)
            until(lambda: len(load.done) > count + 10, "requests after both switches")
        finally:
            load.end()
        assert load.wrong == [], load.wrong[:5]
        assert {api for api, _, _ in load.done} == {"grpc", "openai"}
        # baton status --json: every worker's id and its current role
        s = json.loads(baton("status", "--json", "--redis-url", url).stdout)
        roles = {w["id"]: w["role"] for w in s["workers"]}
        assert roles[p0.worker_id] == "decode" and roles[d0.worker_id] == "prefill"
        # refused, naming why: the last worker that decodes cannot stop decoding
        for w in (c.decode[1], p0):
            if w is p0:
                r = baton("role", w.worker_id, "prefill", "--redis-url", url)
                assert r.returncode == 1 and "last worker that decodes" in r.stderr, r.stderr
            else:
                assert baton("role", w.worker_id, "prefill", "--redis-url", url).returncode == 0
        r = baton("role", "no-such-worker", "decode", "--redis-url", url)
        assert r.returncode == 1 and "no worker 'no-such-worker'" in r.stderr
        c.assert_quiet()
