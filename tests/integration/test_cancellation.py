"""A client that goes away while its request's KV blocks are being pulled (the decode worker
READs them from the prefill worker): on the gRPC API and the OpenAI API alike, the request
ends there. Nothing is decoded for it, and every block is freed on both workers. A decode
worker that keeps each lease 2 s after its read (a test-only fault flag) holds the pull open
long enough to cancel inside it."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.request

import grpc
import pytest
from baton_client.v1 import api_pb2, api_pb2_grpc

pytestmark = pytest.mark.slow

PROMPT = list(range(10, 70))  # 60 tokens: the remote path (the router never prefills locally)


@pytest.fixture(scope="module")
def cluster(start_cluster, tiny_llama):
    return start_cluster(
        prefill=1, decode=1,
        worker_args=["--model", str(tiny_llama[0]), "--block-size", "4", "--num-blocks", "128"],
        role_args={"decode": ["--faults", "delay_release=2.0"]},
        routers=[["--http-port", "0", "--local-prefill-max-tokens", "0"]])


def metric(address: str, name: str) -> float:
    """The sum of a Prometheus counter's samples on a worker."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def wait_for_pull(decode, ended=lambda: None, timeout: float = 60.0) -> None:
    """Until the decode worker is pulling a request's blocks (a hang fails, not slowness);
    ``ended()``: how the request ended if it already has (None while it runs)."""
    end = time.monotonic() + timeout
    while decode.info().handoffs_in_flight == 0:
        assert ended() is None, f"the request ended before its hand-off: {ended()}"
        assert time.monotonic() < end, "no hand-off reached the decode worker"
        time.sleep(0.01)


def decoded_nothing_and_freed_all(cluster, before: float) -> None:
    cluster.assert_quiet()
    decode = cluster.decode[0]
    assert metric(decode.metrics_address, "baton_worker_generated_tokens_total") == before


def test_a_grpc_call_cancelled_during_the_kv_pull_decodes_nothing(cluster):
    decode = cluster.decode[0]
    before = metric(decode.metrics_address, "baton_worker_generated_tokens_total")
    req = api_pb2.GenerateRequest(params=api_pb2.SamplingParams(max_tokens=200,
                                                                   ignore_eos=True))
    req.token_ids.ids.extend(PROMPT)
    call = api_pb2_grpc.BatonStub(cluster.router.channel).Generate(req, timeout=60)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(_drain(call)))
    reader.start()
    wait_for_pull(decode, lambda: got[0] if got else None)
    call.cancel()
    reader.join(60)
    assert got == [grpc.StatusCode.CANCELLED]
    decoded_nothing_and_freed_all(cluster, before)


def _drain(call):
    try:
        for _ in call:
            pass
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_an_http_client_gone_during_the_kv_pull_decodes_nothing(cluster):
    decode = cluster.decode[0]
    before = metric(decode.metrics_address, "baton_worker_generated_tokens_total")
    host, port = cluster.router.http_address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(
        {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}),
        {"Content-Type": "application/json"})
    wait_for_pull(decode)
    conn.sock.close()  # gone without a word, as a killed client is
    decoded_nothing_and_freed_all(cluster, before)
