"""Limits and backpressure on a real cluster (tiny model; redis-server, workers and router on
loopback): the router's slots and bounded queue (RESOURCE_EXHAUSTED naming the limit), prompt and
max_tokens caps (INVALID_ARGUMENT naming the field), and a prefill worker that refuses new prompts
while decode workers are slow to take its leased blocks, the router then prefilling locally."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from baton.control.redis_server import EmbeddedRedis
from baton.services.common.launch import WorkerProcess
from baton.v1 import api_pb2, api_pb2_grpc, worker_pb2

pytestmark = pytest.mark.slow


def req(n_tokens: int, max_tokens: int, start: int = 5) -> api_pb2.GenerateRequest:
    r = api_pb2.GenerateRequest(params=worker_pb2.SamplingParams(max_tokens=max_tokens,
                                                                 ignore_eos=True))
    r.token_ids.ids.extend((start + 7 * i) % 390 + 5 for i in range(n_tokens))
    return r


def run_all(stub, reqs, stagger: float = 0.0):
    """Send ``reqs`` at once (``stagger`` s apart); [(code name, final or details)]."""
    out = [None] * len(reqs)

    def one(i):
        try:
            out[i] = ("OK", list(stub.Generate(reqs[i], timeout=60))[-1].final)
        except grpc.RpcError as e:
            out[i] = (e.code().name, e.details())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
        time.sleep(stagger)
    for t in threads:
        t.join()
    return out


@pytest.fixture(scope="module")
def redis():
    r = EmbeddedRedis().start()
    yield r
    r.stop()


def test_router_slots_queue_and_size_caps(tiny_llama, redis):
    common = ["--model", str(tiny_llama[0]), "--num-blocks", "128", "--redis-url", redis.url]
    procs = [WorkerProcess("decode", common)]
    try:
        procs.append(WorkerProcess("router", [
            "--redis-url", redis.url, "--http-port", "-1", "--max-concurrent", "1",
            "--max-queued", "1", "--max-prompt-tokens", "120", "--max-tokens", "400"]))
        stub = api_pb2_grpc.BatonStub(procs[-1].channel)
        # one runs, one waits for its slot, the third is refused at once: 400 tokens keep the
        # first one running for far longer than the 40 ms over which the three arrive (100
        # tokens of the tiny model once took less than the 0.2 s the third used to come after)
        out = run_all(stub, [req(40, 400, s) for s in range(3)], stagger=0.02)
        codes = sorted(c for c, _ in out)
        assert codes == ["OK", "OK", "RESOURCE_EXHAUSTED"], out
        refused = next(d for c, d in out if c == "RESOURCE_EXHAUSTED")
        assert "max_queued=1" in refused
        assert all(f.usage.completion_tokens == 400 for c, f in out if c == "OK")
        for bad, field in ((req(121, 4), "prompt"), (req(10, 401), "params.max_tokens")):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(bad, timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"invalid {field}=" in e.value.details()
        at_limits = run_all(stub, [req(120, 100), req(40, 400)])  # one runs, one queues
        assert [c for c, _ in at_limits] == ["OK", "OK"], at_limits
    finally:
        for p in reversed(procs):
            p.stop()


def test_prefill_refuses_while_its_leased_blocks_wait_and_the_router_goes_local(tiny_llama,
                                                                              redis):
    common = ["--model", str(tiny_llama[0]), "--num-blocks", "64", "--redis-url", redis.url]
    # the prefill worker takes no new prompt while 8+ of its 64 blocks wait under leases; the
    # decode worker holds each lease 1.5 s after reading it (a slow decode side)
    procs = [WorkerProcess("prefill", [*common, "--max-leased-share", "0.125"])]
    try:
        procs.append(WorkerProcess("decode", [*common, "--fault-delay-release", "1.5"]))
        procs.append(WorkerProcess("router", ["--redis-url", redis.url, "--http-port", "-1",
                                              "--local-prefill-max-tokens", "0",
                                              "--prefill-saturation", "0"]))
        stub = api_pb2_grpc.BatonStub(procs[-1].channel)
        out = run_all(stub, [req(150, 8, s) for s in range(4)], stagger=0.2)  # 10 blocks each
        assert all(c == "OK" for c, _ in out), out
        finals = [f for _, f in out]
        assert any(f.path == "remote" for f in finals)
        pushed = [f for f in finals if f.path == "local"]
        assert pushed and all(f.retries >= 1 for f in pushed), finals
        info = procs[0].info()
        end = time.monotonic() + 10
        while info.active_leases and time.monotonic() < end:
            time.sleep(0.2)
            info = procs[0].info()
        assert info.active_leases == 0 and info.num_free_blocks == info.num_blocks
    finally:
        for p in reversed(procs):
            p.stop()
