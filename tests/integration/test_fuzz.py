"""Fuzzing the public surfaces of a real cluster (tiny model; redis-server, a prefill and a decode
worker, a router, all on loopback; started by the test harness, and by `baton up`):
property-based GenerateRequests on gRPC, and JSON bodies on the OpenAI HTTP API built from the
schema of its fields (right and wrong types, edge values, unknown fields). Whatever comes in:
no INTERNAL/UNKNOWN status and no 5xx, every rejection names the offending field, the router
keeps serving, and no KV block stays allocated afterwards."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import grpc
import pytest
from baton_client.v1 import api_pb2, api_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.cluster import Cluster

pytestmark = pytest.mark.slow

INT32 = st.integers(-(2**31), 2**31 - 1)
EDGE_INTS = st.sampled_from([-(2**31), -1, 0, 1, 2, 20, 21, 399, 400, 511, 512, 2**31 - 1])
# no subnormals: hypothesis refuses them when an earlier test in the process loaded a library
# that flushes them to zero
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32, allow_subnormal=False),
                   st.sampled_from([0.0, -0.0, 1.0, 1e-9, 2.0]))
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["", " ", "\x00", "🙂", "a" * 300]))
GRPC_OK = {"OK", "INVALID_ARGUMENT"}
FIELD = re.compile(r"invalid ([\w.\[\]]+)=")  # "InvalidRequestError: invalid top_p=2.0: ..."
SETTINGS = settings(max_examples=120, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


@pytest.fixture(scope="module", params=["processes", "baton-up"])
def cluster(request, start_cluster, tiny_llama, tmp_path_factory):
    """The same cluster started two ways: process by process (the harness), and as users
    start it, with `baton up`."""
    if request.param == "processes":
        yield start_cluster(prefill=1, decode=1,
                            worker_args=["--model", str(tiny_llama[0]), "--num-blocks", "64"],
                            routers=[["--http-port", "0", "--max-tokens", "64"]])
        return
    from tests.support.up import Up

    up = Up(tmp_path_factory.mktemp("fuzz-up"), "--model", str(tiny_llama[0]),
            "--num-blocks", "64", "--threads", "1", "--http-port", "0",
            "--router-args", "--max-tokens 64")
    yield up
    assert up.stop() == 0, "".join(up.lines[-30:])


def stub(cluster: Cluster) -> api_pb2_grpc.BatonStub:
    return api_pb2_grpc.BatonStub(cluster.router.channel)


# ---- gRPC ----------------------------------------------------------------------------------------

# each field: (values the API accepts, values of any kind the wire can carry)
PARAMS = {
    "max_tokens": (st.integers(1, 32), EDGE_INTS),
    "temperature": (st.floats(0, 2, allow_subnormal=False), FLOATS),
    "top_p": (st.floats(0.01, 1, allow_subnormal=False), FLOATS),
    "top_k": (st.integers(0, 50), EDGE_INTS),
    "seed": (st.integers(0, 2**63 - 1), st.integers(-(2**63), 2**63 - 1)),
    "logprobs": (st.integers(0, 5), EDGE_INTS),
    "cache_salt": (st.text(max_size=8), TEXT),
    "ignore_eos": (st.booleans(), st.booleans()),
}


@st.composite
def generate_requests(draw) -> api_pb2.GenerateRequest:
    """Half well-formed (every field in range), half anything the wire can carry."""
    wild = draw(st.booleans())
    p = api_pb2.SamplingParams()
    for name, (valid, anything) in PARAMS.items():
        if draw(st.booleans()):
            setattr(p, name, draw(anything if wild else valid))
    p.stop.extend(draw(st.lists(TEXT if wild else st.text(min_size=1, max_size=4),
                                max_size=3)))
    p.stop_token_ids.extend(draw(st.lists(EDGE_INTS if wild else st.integers(0, 399),
                                          max_size=3)))
    req = api_pb2.GenerateRequest(
        params=p, model=draw(st.sampled_from(["", "nope", "tiny"]) if wild else st.just("")),
        request_id=draw(st.sampled_from(["", "fuzz", "x" * 200])))
    kind = draw(st.sampled_from(["text", "token_ids", "chat"] + (["none"] if wild else [])))
    if kind == "text":
        req.text = draw(TEXT if wild else TEXT.filter(bool))
    elif kind == "token_ids":
        req.token_ids.ids.extend(draw(
            st.lists(st.one_of(st.integers(0, 399), EDGE_INTS), max_size=40) if wild
            else st.lists(st.integers(0, 399), min_size=1, max_size=40)))
    elif kind == "chat":
        roles = ["user", "system", "assistant", "tool"] + (["", "robot"] if wild else [])
        for _ in range(draw(st.integers(0 if wild else 1, 3))):
            req.chat.messages.add(role=draw(st.sampled_from(roles)), content=draw(TEXT))
    return req


def test_grpc_generate_survives_any_request(cluster):
    seen: dict[str, int] = {}

    @SETTINGS
    @given(generate_requests())
    def one(req):
        if req.model == "tiny":
            req.model = ""
        code, details = "OK", ""
        try:
            final = None
            for msg in stub(cluster).Generate(req, timeout=60):
                if msg.HasField("final"):
                    final = msg.final
            assert final is not None and final.finish_reason
        except grpc.RpcError as e:
            code, details = e.code().name, e.details() or ""
        seen[code] = seen.get(code, 0) + 1
        assert code in GRPC_OK, (code, details, req)
        if code == "INVALID_ARGUMENT":
            assert FIELD.search(details), f"the rejection names no field: {details!r}"

    one()
    print(f"\ngRPC fuzz outcomes: {seen}")
    assert seen.get("OK", 0) >= 5 and seen.get("INVALID_ARGUMENT", 0) >= 5
    assert_serving_and_nothing_held(cluster)


# ---- OpenAI HTTP -----------------------------------------------------------------------------

JSON_ANY = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                                  st.floats(allow_nan=False, allow_subnormal=False),
                                  st.text(max_size=10)),
                        lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3)),
                        max_leaves=6)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                 "content": st.one_of(TEXT, st.lists(
                                     st.fixed_dictionaries({"type": st.just("text"),
                                                            "text": TEXT}), max_size=2))})
# the request schema: each field's valid values, then edge and out-of-range ones
SCHEMA = {
    "model": (st.just(""), st.sampled_from(["nope", "x" * 300])),
    "max_tokens": (st.integers(1, 40), st.sampled_from([-2, 0, 2**31, 2**63])),
    "max_completion_tokens": (st.integers(1, 40), st.sampled_from([-1, 0, 10**30])),
    "temperature": (st.floats(0, 2, allow_subnormal=False), st.sampled_from([-1.0, 1e308])),
    "top_p": (st.floats(0.01, 1, allow_subnormal=False), st.sampled_from([0.0, -0.5, 1.5])),
    "top_k": (st.integers(0, 50), st.sampled_from([-1, 2**40])),
    "seed": (st.integers(0, 2**40), st.sampled_from([-1, 2**64, 2**70])),
    "stop": (st.one_of(st.text(min_size=1, max_size=5),
                       st.lists(st.text(min_size=1, max_size=5), max_size=3)),
             st.sampled_from(["", [""], [1, 2]])),
    "n": (st.just(1), st.sampled_from([0, 2])),
    "stream": (st.booleans(), st.sampled_from(["yes", 1])),
    "ignore_eos": (st.booleans(), st.sampled_from(["no", 0])),
    "logprobs": (st.one_of(st.booleans(), st.integers(0, 5)), st.sampled_from([-1, 21, 99])),
    "top_logprobs": (st.integers(0, 5), st.sampled_from([-1, 21])),
    "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}),
                       st.sampled_from([[], "x"])),
}
PROMPT = st.one_of(TEXT.filter(bool), st.lists(st.integers(0, 399), min_size=1, max_size=30),
                   st.lists(TEXT.filter(bool), min_size=1, max_size=1))


@st.composite
def http_bodies(draw):
    """Mostly well-formed bodies (each field valid), some with a field out of range, some with
    a field of any JSON type, and a few that are not a JSON object at all."""
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    mode = draw(st.sampled_from(["valid"] * 3 + ["edge", "any"]))
    body = {}
    for name, (valid, _) in SCHEMA.items():
        if draw(st.integers(0, 3)) == 0:
            body[name] = draw(valid)
    if mode != "valid":
        name = draw(st.sampled_from(sorted(SCHEMA) + ["messages", "prompt"]))
        body[name] = draw(SCHEMA[name][1] if mode == "edge" and name in SCHEMA else JSON_ANY)
    if path == "/v1/chat/completions":
        body.setdefault("messages", draw(st.lists(MESSAGE, min_size=1, max_size=3)))
    else:
        body.setdefault("prompt", draw(PROMPT))
    body.update(draw(st.dictionaries(st.sampled_from(["foo", "user", "tools"]), JSON_ANY,
                                     max_size=1)))
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 8  # otherwise up to the context: slow, and not what is tested
    raw = json.dumps(body).encode()
    if draw(st.integers(0, 20)) == 0:  # not JSON, or not an object
        raw = draw(st.sampled_from([b"{", b"[]", b"null", b"\xff\xfe", b'"x"']))
    return path, raw


def post(address: str, path: str, raw: bytes) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://{address}{path}", data=raw, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_openai_http_survives_any_body(cluster):
    seen: dict[int, int] = {}

    @SETTINGS
    @given(http_bodies())
    def one(case):
        path, raw = case
        status, body = post(cluster.router.http_address, path, raw)
        seen[status] = seen.get(status, 0) + 1
        assert status in (200, 400), (status, body[:300], raw[:300])
        if status == 400:
            err = json.loads(body)["error"]
            assert err["param"], f"the rejection names no field: {err} for {raw[:200]!r}"
        elif b"data: " in body:  # a stream: chunks then [DONE], or an error event naming it
            assert body.rstrip().endswith(b"data: [DONE]") or b'"error"' in body, body[-300:]
        else:
            assert json.loads(body)["choices"], body[:300]

    one()
    print(f"\nHTTP fuzz outcomes: {seen}")
    assert seen.get(200, 0) >= 5 and seen.get(400, 0) >= 5
    assert_serving_and_nothing_held(cluster)


def assert_serving_and_nothing_held(cluster: Cluster) -> None:
    msgs = list(stub(cluster).Generate(api_pb2.GenerateRequest(
        text="still there?", params=api_pb2.SamplingParams(max_tokens=4)), timeout=60))
    assert msgs[-1].HasField("final")
    # free == total, no leases, nothing running, integrity ok (stricter than before: running
    # requests too)
    cluster.assert_quiet()
