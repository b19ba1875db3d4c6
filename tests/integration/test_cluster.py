"""The cluster through the router's public API, with real processes on loopback: a real
redis-server, one prefill worker, three decode workers, routers in disaggregated and colocated
mode. Equality with the engine, concurrency, cancellation and deadlines, bad input, and workers
that are killed or drained under load."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from baton.control.registry import WorkerRegistry
from baton.engine.engine import LLMEngine
from baton.engine.params import SamplingParams
from baton_client.v1 import api_pb2, api_pb2_grpc

from tests.support.cluster import Cluster
from tests.support.pair import eventually
from tests.support.processes import (
    alive,
    baton_request,
    descendants,
    free_port,
    start_baton_up,
)
from tests.support.reference import REFERENCE_POOL

pytestmark = pytest.mark.slow

PROMPTS = [
    ("chat", "What is the capital of France?"),
    ("chat", "Write a haiku about the sea."),
    ("chat", "日本の首都はどこですか？"),
    ("chat", "List three prime numbers greater than 100."),
    ("text", "The capital of France is"),
    ("text", "def fibonacci(n):\n    "),
    ("text", "Once upon a time, in a village by the river,"),
    ("text", "1, 1, 2, 3, 5, 8,"),
    ("text", "Ünïcödé: ça marche très bien, naïve café —"),
    ("text", " ".join(f"Item {i}: the {w} report." for i, w in
                      enumerate(["first", "second", "third", "fourth"] * 25))),
]


@pytest.fixture(scope="module")
def cluster(start_cluster):
    # routers[0] always uses the prefill worker; routers[1] (colocated) never does
    return start_cluster(
        prefill=1, decode=3, worker_args=["--num-blocks", "160", "--registry-ttl", "3"],
        decode_args=lambda c, i: ["--peers", c.prefill[0].address],
        routers=[["--http-port", "0", "--local-prefill-max-tokens", "0"],
                 ["--local-prefill-max-tokens", "100000"]])


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_path(None, REFERENCE_POOL)


def request(kind, text, max_tokens=16, **params):
    req = api_pb2.GenerateRequest(params=api_pb2.SamplingParams(max_tokens=max_tokens,
                                                                   **params))
    if kind == "chat":
        req.chat.messages.add(role="user", content=text)
    else:
        req.text = text
    return req


def generate(router, req, timeout=120.0):
    """(token ids, text, final message) of one streamed Generate."""
    ids, text, final = [], "", None
    for msg in api_pb2_grpc.BatonStub(router.channel).Generate(req, timeout=timeout):
        if msg.HasField("delta"):
            ids += msg.delta.token_ids
            text += msg.delta.text
        else:
            final = msg.final
            ids += final.last_delta.token_ids  # with last_delta_in_final
            text += final.last_delta.text
    return ids, text, final


def expected(engine, kind, text, max_tokens=16):
    ids = (engine.tokenizer.encode_chat([{"role": "user", "content": text}]) if kind == "chat"
           else engine.tokenizer.encode(text))
    return engine.generate([ids], SamplingParams(max_tokens=max_tokens))[0]


def test_disaggregated_and_colocated_equal_the_engine(cluster, engine):
    for kind, text in PROMPTS:
        want = expected(engine, kind, text)
        for router, path in ((cluster.router, "remote"), (cluster.routers[1], "local")):
            ids, out, final = generate(router, request(kind, text))
            assert ids == want.token_ids and out == want.text, (kind, text, path)
            assert final.path == path and final.finish_reason == want.finish_reason
            assert final.usage.completion_tokens == len(ids)
            assert list(final.prompt_token_ids) == want.prompt_token_ids
            if path == "remote":
                assert final.transports and final.prefill_worker == cluster.prefill[0].worker_id
    models = api_pb2_grpc.BatonStub(cluster.router.channel).ListModels(
        api_pb2.ListModelsRequest())
    assert [m.id for m in models.models] == ["SmolLM2-135M-Instruct"]
    assert models.models[0].max_model_len == 8192
    cluster.assert_quiet()


def test_logprobs_on_both_paths(cluster, engine):
    kind, text = PROMPTS[0]
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": text}])
    want = engine.generate([ids], SamplingParams(max_tokens=8, logprobs=3))[0]
    assert len(want.logprobs) == 8
    for router, path in ((cluster.router, "remote"), (cluster.routers[1], "local")):
        got_ids, got_lps = [], []
        for msg in api_pb2_grpc.BatonStub(router.channel).Generate(
                request(kind, text, 8, logprobs=3), timeout=60):
            if msg.HasField("delta"):
                assert len(msg.delta.logprobs) == len(msg.delta.token_ids)
                got_ids += msg.delta.token_ids
                got_lps += msg.delta.logprobs
            else:
                assert msg.final.path == path
        assert got_ids == want.token_ids
        for g, w in zip(got_lps, want.logprobs, strict=True):
            assert g.token_id == w.token_id and abs(g.logprob - w.logprob) < 1e-4, path
            assert [t.token_id for t in g.top] == [t for t, _ in w.top]
            assert all(abs(t.logprob - v) < 1e-4 for t, (_, v) in zip(g.top, w.top))
    with pytest.raises(grpc.RpcError) as e:
        generate(cluster.router, request(kind, text, 4, logprobs=50))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logprobs" in e.value.details()


def test_the_last_delta_can_come_inside_the_final_message(cluster, engine):
    """``last_delta_in_final`` (the SDK sets it): one message less, the same tokens, text and
    logprobs, on both paths, and also when the first token ends the request (the remote path
    without a decode call)."""
    for kind, text in PROMPTS[:3]:
        for max_tokens in (1, 5):
            want = expected(engine, kind, text, max_tokens)
            for router, path in ((cluster.router, "remote"), (cluster.routers[1], "local")):
                stub = api_pb2_grpc.BatonStub(router.channel)
                req = request(kind, text, max_tokens, logprobs=2)
                plain = list(stub.Generate(req, timeout=120))
                req.last_delta_in_final = True
                merged = list(stub.Generate(req, timeout=120))
                kinds = [m.WhichOneof("kind") for m in merged]
                assert kinds == ["delta"] * (len(plain) - 2) + ["final"], (path, kinds)
                assert not plain[-1].final.HasField("last_delta")
                last = merged[-1].final.last_delta
                assert last == plain[-2].delta and last.token_ids, (path, last)
                assert [m.delta for m in merged[:-1]] == [m.delta for m in plain[:-2]]
                ids, out, final = generate(router, req)
                assert ids == want.token_ids and out == want.text, (path, max_tokens)
                assert final.path == path and final.usage.completion_tokens == max_tokens
    cluster.assert_quiet()


def test_32_concurrent_streams(cluster, engine):
    jobs = [(PROMPTS[i % len(PROMPTS)], 8 + i % 9) for i in range(32)]
    want = {}
    for (kind, text), n in jobs:
        want[(kind, text, n)] = expected(engine, kind, text, n).token_ids
    got, errors = {}, []

    def run(i, kind, text, n):
        try:
            got[i] = (generate(cluster.router, request(kind, text, n))[0], (kind, text, n))
        except grpc.RpcError as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, k, t, n))
               for i, ((k, t), n) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert len(got) == 32
    for ids, key in got.values():
        assert ids == want[key], key
    cluster.assert_quiet()


def test_cancel_and_deadline_leave_no_blocks(cluster):
    stub = api_pb2_grpc.BatonStub(cluster.router.channel)
    call = stub.Generate(request("text", "Tell me a long story.", 300, ignore_eos=True),
                         timeout=120)
    for n, _ in enumerate(call):
        if n == 3:
            call.cancel()
            break
    with pytest.raises(grpc.RpcError) as e:
        generate(cluster.router, request("text", "Count to a thousand.", 400, ignore_eos=True),
                 timeout=1.5)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    cluster.assert_quiet()


@pytest.mark.parametrize("req, field", [
    (api_pb2.GenerateRequest(text=""), "text"),
    (request("text", "hi", temperature=-1), "temperature"),
    (request("text", "hi", top_p=1.5), "top_p"),
    (api_pb2.GenerateRequest(text="hi", model="gpt-17"), "model"),
    (api_pb2.GenerateRequest(text="hi", params=api_pb2.SamplingParams(max_tokens=0)),
     "max_tokens"),
    (api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=[5] * 9000)), "prompt"),
    (api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=[1, 999999])), "prompt_token_ids"),
    (api_pb2.GenerateRequest(chat=api_pb2.ChatMessages(
        messages=[api_pb2.ChatMessage(role="wizard", content="hi")])), "role"),
    (api_pb2.GenerateRequest(), "input"),
])
def test_bad_input_is_invalid_argument(cluster, req, field):
    with pytest.raises(grpc.RpcError) as e:
        generate(cluster.router, req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert field in e.value.details()


def test_openai_http_api_with_the_official_client(cluster, engine):
    import json
    import urllib.request

    import openai

    client = openai.OpenAI(base_url=f"http://{cluster.router.http_address}/v1", api_key="none")
    model = client.models.list().data[0].id
    assert model == "SmolLM2-135M-Instruct"
    for kind, text in PROMPTS[:3] + PROMPTS[4:7]:
        want = expected(engine, kind, text).text
        if kind == "chat":
            msgs = [{"role": "user", "content": text}]
            r = client.chat.completions.create(model=model, messages=msgs, max_tokens=16,
                                               temperature=0)
            assert r.choices[0].message.content == want
            exp = expected(engine, kind, text)
            assert r.usage.completion_tokens == len(exp.token_ids)
            assert r.choices[0].finish_reason == exp.finish_reason
            parts = client.chat.completions.create(model=model, messages=msgs, max_tokens=16,
                                                   temperature=0, stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == want
        else:
            r = client.completions.create(model=model, prompt=text, max_tokens=16,
                                          temperature=0)
            assert r.choices[0].text == want and r.choices[0].finish_reason in ("stop", "length")
            parts = client.completions.create(model=model, prompt=text, max_tokens=16,
                                              temperature=0, stream=True)
            assert "".join(c.choices[0].text for c in parts) == want
    # logprobs: chat (logprobs + top_logprobs) and legacy completions (logprobs: n)
    kind, text = PROMPTS[0]
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": text}])
    want = engine.generate([ids], SamplingParams(max_tokens=6, logprobs=2))[0]
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                       max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [round(c.logprob, 4) for c in content] == [round(w.logprob, 4) for w in want.logprobs]
    assert all(len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content) == want.text
    r = client.completions.create(model=model, prompt=PROMPTS[4][1], max_tokens=6,
                                  temperature=0, logprobs=2)
    assert len(r.choices[0].logprobs.token_logprobs) == 6
    assert "".join(r.choices[0].logprobs.tokens) == r.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="hi", temperature=-1)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user",
                                                                   "content": "hi"}])
    # what Baton does not implement is refused, naming the field, never silently ignored;
    # tools too for SmolLM2, whose chat template renders none
    hi = [{"role": "user", "content": "hi"}]
    for field, value in (("tools", [{"type": "function", "function": {"name": "f"}}]),
                         ("functions", [{"name": "f"}]), ("modalities", ["text", "audio"]),
                         ("reasoning_effort", "high"), ("presence_penalty", 2.5)):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=hi, max_tokens=2,
                                           **{field: value})
        assert e.value.status_code == 400 and e.value.param == field
    r = client.chat.completions.create(model=model, messages=hi, max_tokens=24,
                                       response_format={"type": "json_object"},
                                       presence_penalty=0.5, logit_bias={"1": -5},
                                       temperature=0)
    if r.choices[0].finish_reason == "stop":  # the served forms: a JSON object answer
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.chat.completions.create(model=model, messages=hi, max_tokens=2,
                                       presence_penalty=0, frequency_penalty=0)
    assert r.choices[0].finish_reason  # the defaults are no use of them: served
    assert r.id.startswith("chatcmpl-")  # OpenAI's ids: chatcmpl-... for chat
    # no max_tokens: a chat runs to EOS (or the context, or the worker's pool), not 16 tokens
    kind, text = PROMPTS[0]
    want = expected(engine, kind, text, max_tokens=4096)
    r = client.chat.completions.create(model=model, messages=[{"role": "user",
                                                                "content": text}],
                                       temperature=0)
    assert r.choices[0].message.content == want.text and r.choices[0].finish_reason == "stop"
    # an image part would be answered without the image: refused naming the part
    seen = [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=seen, max_tokens=2)
    assert e.value.status_code == 400 and e.value.param == "messages[0].content[1].type"
    assert "image_url" in e.value.message
    # a field no OpenAI request has is refused as OpenAI refuses it; the caller's own fields and
    # the chat template's variables are taken
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=hi, max_tokens=2,
                                       extra_body={"beam_width": 4})
    assert e.value.param == "beam_width" and "Unrecognized request argument" in e.value.message
    # vLLM's removed guided_* fields point to what replaced them
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=hi, max_tokens=2,
                                       extra_body={"guided_json": {"type": "object"}})
    assert e.value.param == "guided_json" and "structured_outputs" in e.value.message
    r = client.chat.completions.create(
        model=model, messages=hi, max_tokens=2, store=False, prompt_cache_key="k",
        safety_identifier="s", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].finish_reason
    base = f"http://{cluster.router.http_address}"
    with urllib.request.urlopen(base + "/health", timeout=10) as h:
        assert json.loads(h.read())["status"] == "ok"
    with urllib.request.urlopen(base + "/metrics", timeout=10) as m:
        metrics = m.read().decode()
    assert 'baton_requests_total{api="chat",path="remote",status="OK"}' in metrics
    assert 'status="INVALID_ARGUMENT"' in metrics and "baton_generated_tokens_total" in metrics
    cluster.assert_quiet()


def test_two_clients_choosing_the_same_request_id_do_not_collide(cluster, engine):
    """A client's request_id is a label, echoed: the router gives each request its own id on
    the workers and in the index, so two requests in flight at once with the same label (on
    both paths) each get their own tokens."""
    cases = [PROMPTS[0], PROMPTS[9], PROMPTS[4], PROMPTS[9]]
    out: dict[int, tuple] = {}
    start = threading.Barrier(len(cases))

    def one(i: int) -> None:
        kind, text = cases[i]
        req = request(kind, text)
        req.request_id = "same-id"
        start.wait()
        out[i] = generate(cluster.router if i % 2 else cluster.routers[1], req)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (kind, text) in enumerate(cases):
        ids, _, final = out[i]
        assert ids == expected(engine, kind, text).token_ids, i
        assert final.request_id == "same-id"
    assert len({out[i][2].router_request_id for i in out}) == len(cases)
    cluster.assert_quiet()


def test_a_stop_string_the_first_token_completes_is_cut_on_both_paths(cluster, engine):
    """On the remote path the prefill worker samples the first token; when that token completes
    a stop string the request ends there, and the client gets the text before the stop string,
    as on the local path and from the engine (it used to get the whole token)."""
    kind, text = PROMPTS[4]
    first = expected(engine, kind, text, 1).text.strip()
    assert len(first) >= 2, first
    stop = first[:2]
    ids = engine.tokenizer.encode(text)
    want = engine.generate([ids], SamplingParams(max_tokens=8, stop=[stop]))[0]
    assert want.finish_reason == "stop" and stop not in want.text
    for router, path in ((cluster.router, "remote"), (cluster.routers[1], "local")):
        got_ids, got, final = generate(router, request(kind, text, 8, stop=[stop]))
        assert (got, final.finish_reason, final.path) == (want.text, "stop", path)
        assert got_ids == want.token_ids


def test_curl_streams_and_is_told_which_field_is_not_implemented(cluster, engine):
    """curl, a client with no OpenAI library behind it: a streamed chat completion arrives as
    server-sent events ending in [DONE] with the engine's text; a body using a field Baton does
    not implement gets 400 naming it."""
    import shutil
    import subprocess

    if shutil.which("curl") is None:
        pytest.skip("no curl on this machine")
    url = f"http://{cluster.router.http_address}/v1/chat/completions"
    kind, text = PROMPTS[0]

    def curl(body: dict) -> tuple[int, str]:
        out = subprocess.run(["curl", "-sS", "-N", "-w", "\n%{http_code}", "-H",
                              "Content-Type: application/json", "-d", json.dumps(body), url],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        payload, _, code = out.stdout.rpartition("\n")
        return int(code), payload

    msgs = [{"role": "user", "content": text}]
    code, sse = curl({"messages": msgs, "max_tokens": 10, "temperature": 0, "stream": True})
    assert code == 200 and sse.rstrip().endswith("data: [DONE]"), sse[-300:]
    chunks = [json.loads(line[len("data: "):]) for line in sse.splitlines()
              if line.startswith("data: {")]
    got = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert got == expected(engine, kind, text, 10).text
    code, err = curl({"messages": msgs, "max_tokens": 4,
                      "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert code == 400 and json.loads(err)["error"]["param"] == "tools", err


def test_health_and_reflection_on_every_server(cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    for proc, service in ((cluster.router, "baton.v1.Baton"),
                          (cluster.prefill[0], "baton.v1.KVSource"),
                          (cluster.decode[1], "baton.v1.DecodeWorker")):
        hc = health_pb2_grpc.HealthStub(proc.channel)
        for name in ("", service):
            r = hc.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        answers = reflection_pb2_grpc.ServerReflectionStub(proc.channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = {s.name for a in answers for s in a.list_services_response.service}
        assert service in names and "grpc.health.v1.Health" in names


def test_sigterm_under_load_fails_nothing(cluster, engine):
    draining = cluster.decode[2]
    results, errors = [], []
    want = [expected(engine, *PROMPTS[i % len(PROMPTS)], 24).token_ids for i in range(9)]

    def run(i):
        kind, text = PROMPTS[i % len(PROMPTS)]
        try:
            results.append((generate(cluster.router, request(kind, text, 24))[0], want[i]))
        except grpc.RpcError as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(9)]
    for t in threads[:6]:
        t.start()
    time.sleep(1.0)
    draining.proc.send_signal(signal.SIGTERM)
    for t in threads[6:]:  # arrive while it drains
        t.start()
    for t in threads:
        t.join()
    assert not errors, [e.details() for e in errors]
    assert len(results) == 9 and all(a == b for a, b in results)
    assert draining.proc.wait(40) == 0
    cluster.assert_quiet()


def test_a_draining_router_finishes_its_streams_on_both_apis(cluster, engine):
    """SIGTERM to a router with a gRPC stream and a longer OpenAI stream (the official client)
    open: both run to their last token, equal to the engine's, and the router exits 0 once the
    HTTP stream is done, not when the gRPC server has drained."""
    import openai

    router = cluster.start_router("--http-port", "0")
    text = "Once upon a time, in a village by the river,"
    ids = engine.tokenizer.encode(text)
    short, long = (engine.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True))[0]
                   for n in (40, 200))
    call = api_pb2_grpc.BatonStub(router.channel).Generate(
        request("text", text, 40, ignore_eos=True), timeout=120)
    client = openai.OpenAI(base_url=f"http://{router.http_address}/v1", api_key="none",
                           max_retries=0)
    chunks = iter(client.completions.create(model="SmolLM2-135M-Instruct", prompt=text,
                                            max_tokens=200, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    got_ids, http_text, finish = [], "", None
    while not http_text:  # both are decoding
        c = next(chunks)
        http_text += c.choices[0].text if c.choices else ""
    first = next(call)
    assert first.HasField("delta")
    got_ids += first.delta.token_ids
    router.proc.send_signal(signal.SIGTERM)
    for msg in call:
        got_ids += (msg.delta.token_ids if msg.HasField("delta")
                    else msg.final.last_delta.token_ids)
        if msg.HasField("final"):
            assert msg.final.finish_reason == "length"
    for c in chunks:
        if c.choices:
            http_text += c.choices[0].text
            finish = c.choices[0].finish_reason or finish
    assert got_ids == short.token_ids
    assert http_text == long.text and finish == "length"
    assert router.proc.wait(40) == 0
    router.stop()


def test_sigkill_decode_before_first_token_is_retried(cluster, engine):
    victim = cluster.decode[0]
    kind, text = PROMPTS[4]
    want = expected(engine, kind, text).token_ids
    victim.kill()
    finals, errors = [], []

    def run():
        try:
            ids, _, final = generate(cluster.router, request(kind, text))
            assert ids == want
            finals.append(final)
        except grpc.RpcError as e:
            errors.append(e)

    # at once, while the registry still lists the dead worker: least-loaded spreads these three
    # over every registered decode worker, so one lands on the dead one and is retried
    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(finals) == 3
    assert any(f.retries >= 1 for f in finals)
    assert all(f.decode_worker != victim.worker_id for f in finals)
    cluster.assert_quiet()  # the router gave the failed attempt's lease back


def test_baton_up_serves_and_stops_cleanly(engine, tmp_path):
    import json
    import subprocess

    port = free_port()
    logs = tmp_path / "logs" / "up"  # made by baton up: neither folder exists yet
    up, lines = start_baton_up("--num-blocks", "96", "--grpc-port", str(port), "--http-port", "0",
                               "--log-dir", str(logs))
    try:
        assert f"127.0.0.1:{port}" in lines[-1], "".join(lines)
        assert f"logs in {logs}" in "".join(lines)
        assert {p.name.split("-")[0] for p in logs.glob("*.log")} >= {"prefill", "decode"}
        # one prefill and one decode worker share the cores out
        from baton.cli.up import threads_each

        assert f"{threads_each(2)} torch thread(s) per worker" in "".join(lines)
        r = baton_request(f"127.0.0.1:{port}", "The capital of France is", timeout=120)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["token_ids"] == expected(engine, "text", "The capital of France is",
                                            10).token_ids
        # a short prompt: the decode worker prefills it itself (conditional disaggregation)
        assert out["final"]["path"] == "local"
        assert out["final"]["route_reason"] == "few-new-tokens"
        # `baton role` from another shell: the cluster secret `baton up` made is taken from
        # its state file (found by the Redis URL), and one named in the environment wins
        (url,) = [x.split("redis-server on ")[1].strip() for x in lines
                  if "redis-server on" in x]
        env = {k: v for k, v in os.environ.items()
               if k not in ("BATON_CLUSTER_SECRET", "BATON_CLUSTER_SECRET_FILE")}

        def baton(*args, **more):
            return subprocess.run([sys.executable, "-m", "baton.cli.main", *args, "--redis-url",
                                   url], capture_output=True, text=True, timeout=60,
                                  env=env | more)

        st = baton("status", "--json")
        (prefill,) = [w["id"] for w in json.loads(st.stdout)["workers"] if w["role"] == "prefill"]
        wrong = baton("role", prefill, "both", BATON_CLUSTER_SECRET="not-this-clusters")
        assert wrong.returncode == 1 and "UNAUTHENTICATED" in wrong.stderr, wrong.stderr
        switched = baton("role", prefill, "both")
        assert switched.returncode == 0, switched.stderr
        assert f"{prefill}: prefill -> both" in switched.stdout, switched.stdout
        roles = {w["id"]: w["role"]
                 for w in json.loads(baton("status", "--json").stdout)["workers"]}
        assert roles[prefill] == "both", roles
    finally:
        up.send_signal(signal.SIGINT)
        rest = up.communicate(timeout=90)[0]
    assert up.returncode == 0, rest
    assert "stopped" in rest
    from baton.control.cluster_state import up_secret

    assert up_secret(url) is None  # its state file went with it
    ps = subprocess.run(["pgrep", "-f", "--", f"--port {port}"], capture_output=True, text=True)
    assert ps.stdout.strip() == "", "a process outlived baton up"


def test_a_killed_baton_up_takes_its_processes_with_it(tmp_path):
    """`baton up` SIGKILLed (the OOM killer, ``kill -9``) cannot stop what it started: its
    workers and router get SIGTERM from Linux when it dies (a drain) and redis-server too, and
    the decode worker its autoscaler added (on a passing thread) goes once it sees its parent
    gone, so nothing is left running on the machine (all of them were before)."""
    up, lines = start_baton_up("--num-blocks", "96", "--grpc-port", str(free_port()),
                               "--http-port", "-1", "--log-dir", str(tmp_path),
                               "--autoscale", "--min-decode", "2", "--max-decode", "2",
                               "--scale-interval", "1")
    try:
        assert "ready:" in lines[-1], "".join(lines)

        def running() -> dict[int, bytes]:
            out = {}
            for pid in descendants(up.pid):
                with contextlib.suppress(OSError):  # one that ended since the listing
                    out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            return out

        # the first decision raises the decode pool to its minimum of 2 (a thread's start);
        # killed before that worker serves, it would die anyway, of SIGPIPE at its ready line
        redis_url = re.search(r"redis-server on (\S+)", "".join(lines)).group(1)
        registry = WorkerRegistry.from_url(redis_url)
        eventually(lambda: registry.workers("decode"), lambda ws: len(ws) == 2)
        started = running()
        assert sum(b"baton.services.decode" in c for c in started.values()) == 2, started
        kinds = b" ".join(started.values())
        assert all(k in kinds for k in (b"redis-server", b"baton.services.prefill",
                                        b"baton.services.decode", b"baton.services.router"))
        up.kill()
        up.wait(30)
        end = time.monotonic() + 120  # a failure's limit: each drains in a second or two
        while any(alive(pid) for pid in started) and time.monotonic() < end:
            time.sleep(0.1)
        left = {pid: cmd for pid, cmd in started.items() if alive(pid)}
    finally:
        up.kill()
        up.stdout.close()
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after baton up was killed: {left}"


def test_baton_up_starts_a_killed_worker_again_and_keeps_serving(engine, tmp_path):
    """SIGKILL a decode worker of `baton up` under load: every request still succeeds (those
    it was streaming move to the other decode worker), `baton up` starts it again after its
    backoff and says so, `baton status` counts the restart, and Ctrl-C still stops it all."""
    import subprocess

    port = free_port()
    up, lines = start_baton_up("--decode", "2", "--num-blocks", "96", "--grpc-port", str(port),
                               "--http-port", "-1", "--log-dir", str(tmp_path))
    more: list[str] = []
    back = threading.Event()

    def read() -> None:
        for line in up.stdout:
            more.append(line)
            if " back: " in line:
                back.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert f"127.0.0.1:{port}" in lines[-1], "".join(lines)
        decodes = subprocess.run(["pgrep", "-P", str(up.pid), "-f", "baton.services.decode"],
                                 capture_output=True, text=True).stdout.split()
        assert len(decodes) == 2, decodes
        kind, text = PROMPTS[3]
        want = expected(engine, kind, text, 24).token_ids
        results: list = []
        stop = threading.Event()

        def client() -> None:
            while not stop.is_set():
                try:
                    results.append(generate_at(f"127.0.0.1:{port}", request(kind, text, 24)))
                except grpc.RpcError as e:
                    results.append(e.code().name)

        clients = [threading.Thread(target=client) for _ in range(3)]
        for t in clients:
            t.start()
        while len(results) < 2:
            time.sleep(0.05)
        os.kill(int(decodes[0]), signal.SIGKILL)
        assert back.wait(120), "".join(more)
        n = len(results)
        while len(results) < n + 3:  # served after the restart too
            time.sleep(0.05)
        stop.set()
        for t in clients:
            t.join(120)
        assert all(r == want for r in results), [r for r in results if r != want][:3]
        text_out = "".join(more)
        assert "exited (-9); starting it again in 1s (restart 1)" in text_out, text_out
        st = subprocess.run([sys.executable, "-m", "baton.cli.main", "status", "--json"],
                            capture_output=True, text=True, timeout=60)
        restarts = json.loads(st.stdout)["restarts"]
        assert [r["restarts"] for r in restarts if r["what"] == "decode worker"] in ([1, 0],
                                                                                      [0, 1])
        assert up.poll() is None  # still serving
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(90)
        reader.join(30)  # it reads to the end (not communicate(): that closed its pipe under it)
    assert up.returncode == 0, "".join(more)


def generate_at(address: str, req) -> list[int]:
    """The token ids of one Generate through a plain stub on its own channel."""
    with grpc.insecure_channel(address) as ch:
        return [t for m in api_pb2_grpc.BatonStub(ch).Generate(req, timeout=120)
                if m.HasField("delta") for t in m.delta.token_ids]


def test_colocated_workers_prefill_for_each_other(engine):
    """Two `--role both` workers: remote prefill crosses between them (never to itself); when
    one is left, its requests take the local path."""
    with Cluster(prefill=0, decode=2, worker_args=["--num-blocks", "96", "--role", "both"],
                 routers=[["--routing", "round-robin", "--local-prefill-max-tokens", "0",
                           "--http-port", "0"]]) as c:
        (a, b), router = c.decode, c.router
        kind, text = PROMPTS[1]
        want = expected(engine, kind, text).token_ids
        finals = []
        for _ in range(4):
            ids, _, final = generate(router, request(kind, text))
            assert ids == want
            finals.append(final)
        assert {f.path for f in finals} == {"remote"}
        assert all(f.prefill_worker != f.decode_worker for f in finals)
        assert {f.prefill_worker for f in finals} == {a.worker_id, b.worker_id}
        b.stop()  # drains and deregisters
        c.wait_router_sees(router, both=1)
        ids, _, final = generate(router, request(kind, text))
        assert ids == want and final.path == "local" and final.decode_worker == a.worker_id
        info = a.info(check_integrity=True)
        assert info.role == "both" and info.num_free_blocks == info.num_blocks


def test_a_short_prompt_is_routed_past_a_worker_prefilling_a_long_one(engine):
    """Two colocated workers; another router's two requests in flight on ``b`` (claimed in
    Redis as that router would), so the long prompt goes to ``a``. While ``a`` prefills it
    (steps of at least 1 s: its ~2,400 tokens take three of the engine's 1,024-token chunks),
    ``a`` has one request in flight against ``b``'s two, and a short prompt still goes to
    ``b``: ``a`` publishes the prompt tokens it has left (``baton:prefill:<id>``) and the
    router's ``prefill`` scorer reads them. Both answers equal the engine's."""
    import redis as redis_lib
    from baton.control.prefix_index import PrefixIndex, prefill_key

    with Cluster(prefill=0, decode=2, worker_args=["--num-blocks", "400", "--role", "both",
                                                   "--faults", "step_delay=1"],
                 routers=[["--local-prefill-max-tokens", "100000"]]) as c:
        (a, b), router = c.decode, c.router
        client = redis_lib.Redis.from_url(c.redis.url)
        other = PrefixIndex(client, "another-router")
        other.claim("x1", [b.worker_id])
        other.claim("x2", [b.worker_id])
        other.flush()
        long_text = " ".join(f"Item {i}: the report." for i in range(400))
        assert len(engine.tokenizer.encode(long_text)) > 2048
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(
            long=generate(router, request("text", long_text, max_tokens=2))))
        t.start()
        end = time.monotonic() + 120  # a hang detector, not a timing assertion
        while int((client.get(prefill_key(a.worker_id)) or b"- 0").split()[1]) <= 0:
            assert time.monotonic() < end, "a never published the long prompt's tokens"
            assert t.is_alive(), f"the long prompt ended first: {out}"
            time.sleep(0.01)
        ids, _, final = generate(router, request("text", "The capital of France is"))
        assert final.decode_worker == b.worker_id and final.path == "local"
        assert ids == expected(engine, "text", "The capital of France is").token_ids
        t.join(120)
        ids, _, final = out["long"]
        assert final.decode_worker == a.worker_id
        assert ids == expected(engine, "text", long_text, 2).token_ids
        other.close()
        client.close()


def _processes_with_env(key: str, value: str) -> list[int]:
    """Pids of this machine's processes whose environment holds ``key=value``."""
    want, found = f"{key}={value}".encode(), []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if want in (d / "environ").read_bytes().split(b"\0"):
                    found.append(int(d.name))
            except OSError:  # gone meanwhile, or not ours to read
                continue
    return found


def test_baton_up_on_ray_serves_the_same_output(engine, tmp_path):
    """`baton up --ray local`: the workers run under Ray actors (a real local Ray instance);
    a short prompt (local path) and a long one (remote path: a KV hand-off between the two
    actors' workers) give the engine's own tokens, as `baton up` does."""
    pytest.importorskip("ray")
    import json

    port = free_port()
    up, lines = start_baton_up("--ray", "local", "--num-blocks", "96", "--grpc-port", str(port),
                               "--http-port", "-1", "--log-dir", str(tmp_path))
    try:
        assert "ready:" in lines[-1], "".join(lines)
        assert sum("Ray actor for a" in x for x in lines) == 2, "".join(lines)
        (url,) = [x.split("redis-server on ")[1].strip() for x in lines
                  if "redis-server on" in x]
        ours = _processes_with_env("BATON_REDIS_URL", url)
        assert len(ours) >= 2, ours  # the prefill and the decode worker at least
        long_prompt = PROMPTS[-1][1]
        for text, path in (("The capital of France is", "local"), (long_prompt, "remote")):
            r = baton_request(f"127.0.0.1:{port}", text)
            assert r.returncode == 0, r.stderr
            out = json.loads(r.stdout)
            assert out["token_ids"] == expected(engine, "text", text, 10).token_ids
            assert out["final"]["path"] == path
    finally:
        up.send_signal(signal.SIGINT)
        rest = up.communicate(timeout=120)[0]
    assert up.returncode == 0, rest
    # the workers were the processes given this cluster's Redis in their environment
    assert ours and not [pid for pid in ours if alive(pid)], "a worker outlived baton up --ray"


def test_baton_up_on_ray_names_ray_tmpdir_when_the_temporary_folder_is_too_long(tmp_path):
    """A local Ray instance keeps its sockets under $TMPDIR/ray on Linux; under a TMPDIR long
    enough to pass the 107 bytes a socket's path may have, `baton up --ray local` ends with an
    error that names RAY_TMPDIR as the way out, not only Ray's own."""
    pytest.importorskip("ray")
    import subprocess

    deep = tmp_path / ("t" * 90)
    deep.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "RAY_TMPDIR"} | {"TMPDIR": str(deep)}
    out = subprocess.run([sys.executable, "-m", "baton.cli.main", "up", "--ray", "local",
                          "--num-blocks", "96", "--grpc-port", str(free_port()),
                          "--http-port", "-1", "--log-dir", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode != 0, out.stdout
    assert "AF_UNIX" in out.stderr and "RAY_TMPDIR=/tmp" in out.stderr, out.stderr
    assert str(deep) in out.stderr, out.stderr


def test_baton_request_into_a_closed_pipe_ends_quietly(cluster):
    """`baton request ... | head -c 1`: the reader leaves after the first byte; the command ends
    with a shell's SIGPIPE code and no traceback, as other Unix tools do."""
    import subprocess

    out = subprocess.run(
        ["bash", "-c", 'set -o pipefail; "$0" -m baton.cli.main request --router "$1" '
         '--max-tokens 48 "Once upon a time, in a village by the mountains," | head -c 1',
         sys.executable, cluster.router.address],
        capture_output=True, text=True, timeout=120)
    assert len(out.stdout) == 1, out
    assert out.returncode == 141 and "Traceback" not in out.stderr, out.stderr


def test_a_plain_stub_without_a_deadline_is_served(cluster, engine):
    """What grpcurl, grpc-js or Go clients do by default: no timeout at all."""
    channel = grpc.insecure_channel(cluster.router.address)
    try:
        ids = []
        for msg in api_pb2_grpc.BatonStub(channel).Generate(request("text", PROMPTS[4][1])):
            if msg.HasField("delta"):
                ids += msg.delta.token_ids
            else:
                assert msg.final.path == "remote"
        assert ids == expected(engine, "text", PROMPTS[4][1]).token_ids
    finally:
        channel.close()


def _router_metric(cluster, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"http://{cluster.router.http_address}/metrics",
                                timeout=10) as m:
        for line in m.read().decode().splitlines():
            if line.startswith(name + " "):  # name with its labels, as Prometheus writes them
                return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("stream", [True, False])
def test_an_http_client_that_goes_away_cancels_its_request(cluster, stream):
    """A raw HTTP/1.1 client closes its connection in the middle of a long request: the
    router cancels the request on the workers (its blocks free long before the 2,000 tokens it
    asked for could be generated) and counts it CANCELLED."""
    import socket

    cancelled = 'baton_router_requests_total{path="none",status="CANCELLED"}'
    before = _router_metric(cluster, cancelled)
    body = json.dumps({"prompt": "Tell me everything.", "max_tokens": 2000, "ignore_eos": True,
                       "stream": stream}).encode()
    host, port = cluster.router.http_address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    if stream:
        got = b""
        while b"data: " not in got:  # the first tokens arrived: it is decoding
            chunk = sock.recv(4096)
            assert chunk, got
            got += chunk
    else:
        decode = [w for w in cluster.workers() if w.role == "decode"]
        _wait_until(lambda: any(w.info().running_requests for w in decode))
    sock.close()
    _wait_until(lambda: _router_metric(cluster, cancelled) > before)
    cluster.assert_quiet()


def _wait_until(condition, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "the condition never held"
        time.sleep(0.05)
