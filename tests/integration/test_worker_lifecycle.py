"""Workers in the Redis registry: they appear when ready, vanish within the TTL when killed, and
drain on SIGTERM (deregister, refuse new work, finish what they have, exit 0)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from baton.control.redis_server import EmbeddedRedis
from baton.control.registry import WorkerRegistry
from baton.engine.engine import LLMEngine
from baton.engine.params import SamplingParams
from baton.services.launch.local import WorkerProcess
from baton_client.v1 import api_pb2, api_pb2_grpc

from tests.support.pair import Pair
from tests.support.reference import REFERENCE_POOL

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def redis_url():
    with EmbeddedRedis() as r:
        yield r.url


def test_register_expire_and_drain(redis_url):
    registry = WorkerRegistry.from_url(redis_url)
    common = ["--num-blocks", "128", "--redis-url", redis_url, "--registry-ttl", "2"]
    prefill = WorkerProcess("prefill", common)
    decode = WorkerProcess("decode", [*common, "--peers", prefill.address])
    p = Pair(prefill, decode)
    try:
        by_role = {w.role: w for w in registry.workers()}
        assert set(by_role) == {"prefill", "decode"}
        for w in (prefill, decode):
            rec = by_role[w.role]
            assert (rec.address, rec.worker_id, rec.incarnation) == (
                w.address, w.worker_id, w.incarnation)
            assert rec.fingerprint == w.info().fingerprint and rec.model.startswith("SmolLM2")
        time.sleep(2.5)  # the heartbeat keeps them past the TTL
        assert len(registry.workers()) == 2

        # SIGTERM during a stream: it completes, new work is refused, the worker exits 0
        engine = LLMEngine.from_path(None, REFERENCE_POOL)
        ids = engine.tokenizer.encode("Once upon a time, in a village by the river,")
        params = SamplingParams(max_tokens=48, ignore_eos=True)
        expected = engine.generate([ids], params)[0].token_ids
        pre = p.prefill_call(ids, params, "draining")
        got, errors = [], []

        def stream():
            try:
                got.extend(p.decode_call(ids, params, "draining", pre)[0])
            except grpc.RpcError as e:
                errors.append(e)

        t = threading.Thread(target=stream)
        t.start()
        time.sleep(0.7)  # mid-stream
        decode.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert [w.role for w in registry.workers()] == ["prefill"]  # deregistered first
        pre2 = p.prefill_call(ids, params, "late")
        with pytest.raises(grpc.RpcError) as e:
            p.decode_call(ids, params, "late", pre2)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        t.join(60)
        assert not errors and got == expected  # the in-flight request finished, complete
        assert decode.proc.wait(30) == 0

        # SIGKILL: no drain, the entry lapses within the TTL
        prefill.kill()
        t0 = time.monotonic()
        while registry.workers() and time.monotonic() - t0 < 5:
            time.sleep(0.1)
        assert registry.workers() == [] and time.monotonic() - t0 <= 2.5
    finally:
        p.stop()


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_worker_whose_engine_thread_died_leaves_and_exits_nonzero(tiny_llama, role):
    """A worker whose engine thread fails (injected after a few steps) reports NOT_SERVING,
    leaves the registry and exits 1 so its supervisor replaces it; the requests it had taken
    are retried (no token sent yet) or migrated by the router, and every one succeeds on the
    other worker of its role."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tests.support.cluster import Cluster

    args = ["--model", str(tiny_llama[0]), "--block-size", "4", "--num-blocks", "128",
            "--registry-ttl", "2"]
    crash = ["--faults", "crash_engine_after=1"]  # its first step: it surely takes one
    with Cluster(prefill=2 if role == "prefill" else 1, decode=2 if role == "decode" else 1,
                 worker_args=args, routers=[["--local-prefill-max-tokens", "0"]],
                 prefill_args=lambda c, i: crash if role == "prefill" and i == 0 else [],
                 decode_args=lambda c, i: crash if role == "decode" and i == 0 else []) as c:
        victim = (c.decode if role == "decode" else c.prefill)[0]
        health = health_pb2_grpc.HealthStub(victim.channel)
        prompts = [list(range(10 + i, 70 + i)) for i in range(8)]
        ref = LLMEngine.from_path(str(tiny_llama[0]), REFERENCE_POOL)
        want = [o.token_ids for o in ref.generate(prompts, SamplingParams(max_tokens=12,
                                                                          ignore_eos=True))]
        stub = api_pb2_grpc.BatonStub(c.router.channel)
        done: list = []

        def one(i: int) -> None:
            req = api_pb2.GenerateRequest(params=api_pb2.SamplingParams(max_tokens=12,
                                                                           ignore_eos=True))
            req.token_ids.ids.extend(prompts[i])
            try:
                msgs = list(stub.Generate(req, timeout=120))
            except grpc.RpcError as e:
                done.append((i, e.code().name, e.details()))
                return
            done.append((i, [t for m in msgs if m.HasField("delta")
                             for t in m.delta.token_ids], msgs[-1].final))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        assert victim.proc.wait(timeout=120) == 1, victim.log_tail()
        for t in threads:
            t.join(120)
        assert len(done) == 8
        for i, ids, final in done:
            assert ids == want[i], (i, final)
        assert "engine thread died" in victim.log_tail(200)
        assert victim.worker_id not in {w.worker_id for w in
                                        WorkerRegistry.from_url(c.redis.url).workers()}
        with pytest.raises(grpc.RpcError):  # gone: nothing answers for it any more
            health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        c.assert_quiet()


TIDY_SCRIPT = """
import json, os, signal, sys
from baton.services.launch.local import WorkerProcess
args = ["--model", sys.argv[1], "--num-blocks", "16", "--threads", "1"]
stopped, killed, crashed = workers = [WorkerProcess("decode", args) for _ in range(3)]
held = [sorted(os.listdir(w.log_path.parent)) for w in workers]  # while they serve
stopped.stop()
killed.kill()
os.kill(crashed.pid, signal.SIGKILL)  # not through its WorkerProcess: a crash to look into
crashed.proc.wait()
crashed.stop()  # already dead: this stop did not end it
print(json.dumps({"logs": [str(w.log_path) for w in workers],
                  "pids": [w.pid for w in workers], "held": held}))
"""


def test_worker_logs_in_their_own_folders_go_at_exit_unless_the_worker_failed(tiny_llama):
    """WorkerProcess without ``log_dir`` logs into a temporary folder: at the parent's exit the
    folders of workers stopped or killed through it go (test runs and benchmarks left hundreds
    in /tmp); a worker that died otherwise keeps its log, and the exit names it."""
    out = subprocess.run([sys.executable, "-c", TIDY_SCRIPT, str(tiny_llama[0])],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    stopped, killed, crashed = map(Path, got["logs"])
    # each worker's UCX log is in its folder beside its log (not in the temporary folder)
    for log, pid, held in zip(got["logs"], got["pids"], got["held"]):
        assert held == sorted([Path(log).name, f"baton-ucx.{pid}.log"])
    assert not stopped.parent.exists() and not killed.parent.exists()
    assert crashed.is_file() and "serving on" in crashed.read_text()
    assert (crashed.parent / f"baton-ucx.{got['pids'][2]}.log").is_file()  # kept with it
    assert f"worker logs kept: {crashed} (decode, exit -9)" in out.stderr
    shutil.rmtree(crashed.parent)
