"""Scale-down under load fails no request: a decode worker told to drain (SIGTERM, what an
autoscaler's scale-down or Kubernetes sends) while it streams a request longer than its
--drain-timeout, and while short requests keep arriving. The long stream is migrated to the
other decode worker when the drain time is up, not cut: the client sees every token, equal to
the greedy reference, and one migration; the short requests all succeed; the drained worker
exits 0. Real processes: redis, a prefill and two decode workers, a router, on a tiny model."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from baton_client.v1 import api_pb2, api_pb2_grpc

from tests.support.cluster import Cluster
from tests.support.reference import REFERENCE_POOL

pytestmark = pytest.mark.slow


def req(n_tokens: int, max_tokens: int, start: int = 5) -> api_pb2.GenerateRequest:
    r = api_pb2.GenerateRequest(params=api_pb2.SamplingParams(max_tokens=max_tokens,
                                                                 ignore_eos=True))
    r.token_ids.ids.extend((start + 7 * i) % 390 + 5 for i in range(n_tokens))
    return r


def collect(call) -> tuple[list[int], api_pb2.GenerateFinal]:
    ids, final = [], None
    for m in call:
        if m.HasField("delta"):
            ids += m.delta.token_ids
        else:
            final = m.final
    assert final is not None
    return ids, final


def test_a_stream_longer_than_the_drain_timeout_is_migrated_not_cut(tiny_llama):
    from baton.engine.engine import LLMEngine
    from baton.engine.params import SamplingParams

    args = ["--model", str(tiny_llama[0]), "--block-size", "4", "--num-blocks", "256"]
    # steps of 20 ms at least: 300 tokens outlast the 1 s drain on any machine
    with Cluster(prefill=1, decode=2, worker_args=args,
                 decode_args=lambda c, i: ["--drain-timeout", "1",
                                           "--faults", "step_delay=0.02"],
                 routers=[["--local-prefill-max-tokens", "0"]]) as c:
        stub = api_pb2_grpc.BatonStub(c.router.channel)
        long = req(40, 300, start=3)
        want = LLMEngine.from_path(str(tiny_llama[0]), REFERENCE_POOL).generate(
            [list(long.token_ids.ids)], SamplingParams(max_tokens=300, ignore_eos=True))[0]

        out: dict = {}
        call = stub.Generate(long, timeout=600)
        reader = threading.Thread(target=lambda: out.update(r=collect(call)))
        reader.start()
        serving = None
        while serving is None:  # the decode worker the long stream runs on
            for w in c.decode:
                if w.info().running_requests:
                    serving = w
            time.sleep(0.02)
        other = next(w for w in c.decode if w is not serving)

        short: list = []
        stop = threading.Event()

        def keep_asking() -> None:  # short requests all through the drain
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    ids, final = collect(stub.Generate(req(20, 4, start=50 + i), timeout=120))
                    short.append(("OK", len(ids), final.decode_worker))
                except grpc.RpcError as e:
                    short.append((e.code().name, e.details(), ""))

        asker = threading.Thread(target=keep_asking)
        asker.start()
        serving.proc.terminate()  # SIGTERM: drain, as a scale-down does
        assert serving.proc.wait(60) == 0, serving.log_tail()
        reader.join(300)
        stop.set()
        asker.join(120)

        ids, final = out["r"]
        assert ids == want.token_ids and final.finish_reason == "length"
        assert final.migrations == 1 and list(final.migrated_from) == [serving.worker_id]
        assert final.decode_worker == other.worker_id
        assert short and all(s[0] == "OK" and s[1] == 4 for s in short), short
        c.decode.remove(serving)
        c.assert_quiet()
