"""Workers in the Redis registry: they appear when ready, vanish within the TTL when killed, and
drain on SIGTERM (deregister, refuse new work, finish what they have, exit 0)."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from baton.control.redis_server import EmbeddedRedis
from baton.control.registry import WorkerRegistry
from baton.engine.engine import LLMEngine
from baton.engine.params import SamplingParams
from baton.services.common.launch import WorkerProcess

from tests.integration.test_transfer import Pair

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
        engine = LLMEngine.from_path(None)
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
