"""Limits and backpressure on a real cluster (tiny model; redis-server, workers and router on
loopback): the router's slots and bounded queue (RESOURCE_EXHAUSTED naming the limit), prompt and
max_tokens caps (INVALID_ARGUMENT naming the field), and a prefill worker that refuses new prompts
while decode workers are slow to take its leased blocks, the router then prefilling locally."""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest
from baton.control.redis_server import EmbeddedRedis
from baton.services.launch.local import WorkerProcess
from baton.v1 import worker_pb2
from baton_client.v1 import api_pb2, api_pb2_grpc

pytestmark = pytest.mark.slow


def req(n_tokens: int, max_tokens: int, start: int = 5) -> api_pb2.GenerateRequest:
    r = api_pb2.GenerateRequest(params=api_pb2.SamplingParams(max_tokens=max_tokens,
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
        procs.append(WorkerProcess("decode", [*common, "--faults", "delay_release=1.5"]))
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


def test_a_full_decode_pool_queues_at_the_router_then_refuses_past_max_queued(tiny_llama):
    """Every decode worker runs its --max-num-seqs requests: the next request waits at the
    router (sent to no worker), one more past --max-queued is refused RESOURCE_EXHAUSTED naming
    the limit, and the waiting one runs, with the greedy result, as soon as a running one ends
    (here: its client cancels); one whose client goes away while it waits leaves the queue.
    The worker never holds more than its batch."""
    import urllib.request

    from baton.engine.engine import LLMEngine
    from baton.engine.params import SamplingParams

    from tests.support.cluster import Cluster
    from tests.support.reference import REFERENCE_POOL

    args = ["--model", str(tiny_llama[0]), "--block-size", "4", "--num-blocks", "128"]
    with Cluster(prefill=1, decode=1, worker_args=args,
                 decode_args=lambda c, i: ["--max-num-seqs", "2", "--faults", "step_delay=0.05"],
                 routers=[["--http-port", "0", "--max-queued", "1",
                           "--local-prefill-max-tokens", "0"]]) as c:
        stub = api_pb2_grpc.BatonStub(c.router.channel)
        decode = c.decode[0]

        def queued() -> float:
            text = urllib.request.urlopen(f"http://{c.router.http_address}/metrics",
                                          timeout=30).read().decode()
            line = next(ln for ln in text.splitlines()
                        if ln.startswith("baton_router_decode_queued "))
            return float(line.split()[1])

        def until(cond, what):  # the bound is a hang detector, not a timing assertion
            end = time.monotonic() + 120
            while not cond():
                assert time.monotonic() < end, f"never happened: {what}"
                time.sleep(0.02)

        got: dict[str, list] = {}
        finals: dict[str, object] = {}

        def stream(name, call):
            got[name] = []
            try:
                for m in call:
                    if m.HasField("delta"):
                        got[name] += m.delta.token_ids
                    if m.HasField("final"):
                        got[name].append(m.final.finish_reason)
                        finals[name] = m.final
            except grpc.RpcError as e:
                got[name].append(e.code().name)

        def workload():
            return [json.loads(line) for line in urllib.request.urlopen(
                f"http://{c.router.http_address}/v1/baton/workload", timeout=30).read()
                .decode().splitlines()]

        def start(name, request):
            call = stub.Generate(request, timeout=300)
            th = threading.Thread(target=stream, args=(name, call))
            th.start()
            return call, th

        # the greedy reference first: made while the batch is full, its engine's start (a pool
        # to fault in) could outlast the two requests that fill it
        short = req(30, 4, start=9)
        want = LLMEngine.from_path(str(tiny_llama[0]), REFERENCE_POOL).generate(
            [list(short.token_ids.ids)], SamplingParams(max_tokens=4, ignore_eos=True))[0]

        # fill the batch: 2 requests of 400 tokens at 50 ms or more a step
        (a, ta), (b, tb) = start("a", req(30, 400, start=1)), start("b", req(30, 400, start=2))
        until(lambda: len(got.get("a", ())) and len(got.get("b", ())), "both stream")

        # a waiting request whose client goes away leaves the queue at once
        gone, tg = start("gone", req(30, 4, start=7))
        until(lambda: queued() == 1, "a request waits at the router")
        gone.cancel()
        tg.join(60)
        assert got["gone"] == ["CANCELLED"]
        until(lambda: queued() == 0, "the cancelled request leaves the queue")

        _, tc = start("c", short)
        until(lambda: queued() == 1, "the third request waits at the router")
        info = decode.info()
        assert info.running_requests == 2 and info.handoffs_in_flight == 0  # not sent
        assert got["c"] == []
        # the live workload shows the tuner the requests still running and waiting (under
        # overload most are), not only the finished; the cancelled one is not in it
        running = [r for r in workload() if r.get("in_flight") and r["prompt_tokens"] == 30]
        assert sorted(r["max_tokens"] for r in running) == [4, 400, 400]

        with pytest.raises(grpc.RpcError) as e:  # --max-queued 1 already waits
            list(stub.Generate(req(30, 4, start=11), timeout=60))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_queued=1" in e.value.details() and "decode" in e.value.details()
        assert decode.info().running_requests == 2

        a.cancel()  # a slot frees: the waiting request takes it
        tc.join(120)
        assert got["c"] == [*want.token_ids, "length"]
        assert queued() == 0
        # its wait is the decode pool's, in its own field (the autoscaler's decode signal), not
        # in the routing time nor the time the prefill side took
        t = finals["c"].timing
        assert 0 < t.decode_wait_s < t.first_token_s and t.route_s < t.decode_wait_s
        text = urllib.request.urlopen(f"http://{c.router.http_address}/metrics",
                                      timeout=30).read().decode()
        assert 'baton_ttft_phase_seconds_count{phase="decode_wait"}' in text
        # and the live workload has it, finished, with its phases, as lengths and times only
        rows = workload()
        mine = [r for r in rows if r["prompt_tokens"] == 30 and r["output_tokens"] == 4
                and not r.get("in_flight")]
        assert len(mine) == 1 and mine[0]["phases"]["decode_wait"] == round(t.decode_wait_s, 5)
        assert mine[0]["blocks"] and "token_ids" not in mine[0]
        assert [r["max_tokens"] for r in rows if r.get("in_flight")] in ([], [400])  # b's
        b.cancel()
        for th in (ta, tb):
            th.join(60)
        assert got["a"][-1] == got["b"][-1] == "CANCELLED"
        c.assert_quiet()


def test_a_hand_off_with_no_room_before_its_deadline_is_resource_exhausted(tiny_llama, redis):
    """A decode worker whose one batch slot stays taken refuses a hand-off when its wait for
    room ends: RESOURCE_EXHAUSTED naming what was short, as a plain generated stub sees it. (Its
    refusal was a context.abort inside a handler that maps exceptions to statuses, which turned
    the abort's own bare Exception into INTERNAL "Exception: ".)"""
    from baton.v1 import worker_pb2_grpc

    common = ["--model", str(tiny_llama[0]), "--num-blocks", "128", "--redis-url", redis.url]
    # steps of at least 50 ms: the long request holds the slot for its whole context (~500
    # tokens), not the second or so a fast machine takes for it
    procs = [WorkerProcess("decode", [*common, "--max-num-seqs", "1",
                                      "--transfer-timeout", "1", "--faults", "step_delay=0.05"])]
    try:
        procs.append(WorkerProcess("router", ["--redis-url", redis.url, "--http-port", "-1"]))
        stub = api_pb2_grpc.BatonStub(procs[-1].channel)
        long = stub.Generate(req(10, 100000), timeout=120)  # takes the one slot
        next(long)  # its first token: it runs
        ids = [5 + i for i in range(20)]
        call = worker_pb2.DecodeRequest(
            request_id="no-room", prompt_token_ids=ids, first_token_id=7,
            params=api_pb2.SamplingParams(max_tokens=4),
            handle=worker_pb2.KVHandle(worker_id="p", incarnation="i", address="127.0.0.1:1",
                                       lease_id="l", block_ids=list(range(5)), num_tokens=20,
                                       fingerprint="f", expires_at=time.time() + 60))
        with pytest.raises(grpc.RpcError) as e:
            list(worker_pb2_grpc.DecodeWorkerStub(procs[0].channel).Decode(call))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
        assert "no room for the hand-off" in e.value.details()
        long.cancel()
    finally:
        for p in reversed(procs):
            p.stop()


def test_a_worker_runs_as_many_streams_at_once_as_its_max_num_seqs(tiny_llama):
    """Every stream a worker's batch admits starts at once. A Generate stream holds a gRPC
    thread for its whole output, and the worker had 32 threads: with --max-num-seqs 40, the
    33rd stream waited for one of the first 32 to end. Each stream notes, at its first token,
    how many streams had ended by then: none, for every one of them."""
    from baton.v1 import worker_pb2_grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    n = 40
    w = WorkerProcess("decode", ["--model", str(tiny_llama[0]), "--num-blocks", "512",
                                 "--max-num-seqs", str(n), "--faults", "step_delay=0.05"])
    stub = worker_pb2_grpc.DecodeWorkerStub(w.channel)
    lock, ended, ended_before_first = threading.Lock(), [0], {}
    all_started = threading.Event()
    calls = []

    def one(i: int) -> None:
        call = stub.Generate(worker_pb2.LocalRequest(
            request_id=f"s{i}", prompt_token_ids=[5 + i, 6, 7, 8],
            params=api_pb2.SamplingParams(max_tokens=100000, ignore_eos=True)), timeout=300)
        calls.append(call)
        try:
            for k, _ in enumerate(call):
                if k == 0:
                    with lock:
                        ended_before_first[i] = ended[0]
                        if len(ended_before_first) == n:
                            all_started.set()
        except grpc.RpcError:
            pass  # cancelled below
        with lock:
            ended[0] += 1

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    try:
        for t in threads:
            t.start()
        assert all_started.wait(240), f"{len(ended_before_first)} of {n} streams started"
        assert ended_before_first == dict.fromkeys(range(n), 0)
        # every stream running: the probe and a role switch still answer (own threads)
        assert health_pb2_grpc.HealthStub(w.channel).Check(
            health_pb2.HealthCheckRequest(), timeout=30).status == \
            health_pb2.HealthCheckResponse.SERVING
        assert worker_pb2_grpc.WorkerAdminStub(w.channel).SetRole(
            worker_pb2.SetRoleRequest(role="decode"), timeout=30).role == "decode"
    finally:
        for c in calls:
            c.cancel()
        for t in threads:
            t.join(60)
        w.stop()
