"""The agent-facing request fields through a real cluster (redis-server, prefill and decode
workers, a router; KV over NIXL), with the official ``openai`` client where it speaks them:
greedy tokens with repetition, frequency and presence penalties and a logit bias equal a greedy
loop over transformers' logits with the same processing, on the remote path (the decode worker
rebuilds the penalties' state from the prompt and the handed first token) and the migrated path
(another worker resumes from the prompt plus the tokens sent, which count as output there); n
choices computing the prompt once; JSON schemas on the remote, local and migrated paths; forced
and named tool calls whose arguments parse and validate, streamed as delta.tool_calls, and a
history with tool results."""

from __future__ import annotations

import time

import pytest
from baton.engine.params import SamplingParams
from baton_client.v1 import api_pb2, api_pb2_grpc

from tests.support.sampling import reference_greedy

from ..conftest import make_hf_model

pytestmark = pytest.mark.slow

PARAMS = dict(repetition_penalty=1.4, frequency_penalty=0.7, presence_penalty=0.3)
BIAS = {17: 1.5}
ARGS = ["--block-size", "4", "--num-blocks", "256"]


def generate(router, ids, n):
    p = api_pb2.SamplingParams(max_tokens=n, ignore_eos=True, **PARAMS)
    for tok, b in BIAS.items():
        p.logit_bias[tok] = b
    req = api_pb2.GenerateRequest(params=p)
    req.token_ids.ids.extend(ids)
    out, final = [], None
    for msg in api_pb2_grpc.BatonStub(router.channel).Generate(req, timeout=120):
        if msg.HasField("delta"):
            out += msg.delta.token_ids
        else:
            final = msg.final
    return out, final


def test_penalties_and_bias_on_the_remote_and_migrated_paths(start_cluster, tmp_path):
    import openai

    hf = make_hf_model(tmp_path, tie_word_embeddings=False)
    crash = ["--faults", "crash_engine_after=6"]
    c = start_cluster(prefill=1, decode=2, worker_args=["--model", str(tmp_path), *ARGS],
                      decode_args=lambda c, i: crash if i == 0 else [],
                      routers=[["--local-prefill-max-tokens", "0", "--http-port", "0"]])
    ref = SamplingParams(logit_bias=BIAS, **PARAMS)
    paths = set()
    for k in range(12):
        prompt = [(5 * i + 7 + 13 * k) % 300 + 3 for i in range(40)] + [11, 11, 12, 11]
        out, final = generate(c.router, prompt, 16)
        assert out == reference_greedy(hf, prompt, 16, ref, 0), (k, final.path)
        paths.add(final.path)
        if {"remote", "migrated"} <= paths:  # the first request may be the migrated one
            break
    assert {"remote", "migrated"} <= paths, paths
    # the official client: the same fields, the same tokens (their text)
    from baton.engine.loader import load_model

    tok = load_model(str(tmp_path)).tokenizer
    client = openai.OpenAI(base_url=f"http://{c.router.http_address}/v1", api_key="none")
    prompt = [(7 * i + 5) % 300 + 3 for i in range(40)]
    r = client.completions.create(model=client.models.list().data[0].id, prompt=prompt,
                                  max_tokens=10, temperature=0,
                                  logit_bias={str(t): b for t, b in BIAS.items()},
                                  presence_penalty=PARAMS["presence_penalty"],
                                  frequency_penalty=PARAMS["frequency_penalty"],
                                  extra_body={"repetition_penalty": PARAMS["repetition_penalty"],
                                              "ignore_eos": True})
    want = reference_greedy(hf, prompt, 10, ref, 0)
    assert r.usage.completion_tokens == 10
    assert r.choices[0].text == tok.decode(prompt[-5:] + want)[len(tok.decode(prompt[-5:])):]
    c.stop()


def test_n_choices_share_one_prompt_computation_and_differ(start_cluster, tmp_path):
    import openai

    make_hf_model(tmp_path, tie_word_embeddings=False)
    c = start_cluster(prefill=1, decode=1, worker_args=["--model", str(tmp_path), *ARGS],
                      routers=[["--local-prefill-max-tokens", "0", "--http-port", "0"]])
    client = openai.OpenAI(base_url=f"http://{c.router.http_address}/v1", api_key="none")
    model = client.models.list().data[0].id
    prompt = [(9 * i + 4) % 300 + 3 for i in range(61)]

    def ask():
        return client.completions.create(model=model, prompt=prompt, n=3, max_tokens=12,
                                         temperature=1.0, seed=5,
                                         extra_body={"ignore_eos": True}).model_dump()

    r = ask()
    texts = [ch["text"] for ch in r["choices"]]
    assert [ch["index"] for ch in r["choices"]] == [0, 1, 2]
    assert len(set(texts)) == 3, texts  # seeds 5, 6, 7
    assert r["usage"]["completion_tokens"] == 36 and r["usage"]["prompt_tokens"] == 61
    computed = sum(61 - ch["cached_tokens"] for ch in r["baton"]["choices"])
    assert computed <= 61 + 3 * 4, r["baton"]["choices"]  # the prompt once, a block per choice
    assert [ch["text"] for ch in ask()["choices"]] == texts  # seed + i: reproducible
    single = client.completions.create(model=model, prompt=prompt, max_tokens=12,
                                       temperature=1.0, seed=6, extra_body={"ignore_eos": True})
    assert single.choices[0].text == texts[1]  # choice 1 is the request with seed + 1
    c.assert_quiet()
    c.stop()


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "size": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 50}, {"type": "null"}]},
    "meta": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}},
    "required": ["name", "tags", "size", "meta"], "additionalProperties": False}


def test_json_schemas_on_the_remote_local_and_migrated_paths(start_cluster, tmp_path):
    import json
    import threading

    import jsonschema
    import openai
    from baton.engine import grammar

    make_hf_model(tmp_path, tie_word_embeddings=False)
    slow = ["--faults", "step_delay=0.03"]  # a request streams long enough to be cut
    c = start_cluster(prefill=1, decode=2, worker_args=["--model", str(tmp_path), *ARGS],
                      decode_args=lambda c, i: slow,
                      routers=[["--local-prefill-max-tokens", "40", "--http-port", "0"]])
    client = openai.OpenAI(base_url=f"http://{c.router.http_address}/v1", api_key="none")
    model = client.models.list().data[0].id
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA,
                                                  "strict": True}}
    g = grammar.from_response_format(fmt)
    from baton.engine.loader import load_model

    engine_tok = load_model(str(tmp_path)).tokenizer
    matcher = grammar.Grammars(engine_tok.tk.to_str(), 400, engine_tok.eos_token_ids)

    def ask(k: int, long: bool) -> tuple[str, dict]:
        words = " ".join(["alpha", "beta", "gamma"][i % 3] for i in range(3 + 25 * long))
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"{k} {words}"}],
            response_format=fmt, max_tokens=60, temperature=1.0, seed=k).model_dump()
        choice = r["choices"][0]
        text = choice["message"]["content"]
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(text), SCHEMA)
        else:  # cut at max_tokens: what there is follows the grammar
            ids = engine_tok.encode(text, add_special_tokens=False)
            assert matcher.matcher(g).validate_tokens(ids) == len(ids), (r, text)
        return r["baton"]["path"], r

    assert ask(0, long=False)[0] == "local"
    assert ask(1, long=True)[0] == "remote"
    # migrated: the decode worker streaming a request is killed; another resumes it from the
    # tokens sent, its grammar state rebuilt from them
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(r=ask(2, long=True)))
    t.start()
    end = time.monotonic() + 60
    victim = None
    while victim is None and time.monotonic() < end and t.is_alive():
        victim = next((w for w in c.decode if w.info().running_requests), None)
    assert victim is not None, "the request never ran on a decode worker"
    time.sleep(0.2)  # a few tokens streamed first
    victim.kill()
    t.join(120)
    assert got["r"][0] == "migrated", got
    # a schema Baton cannot serve is a 400 naming it, before any worker is asked
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {
                "name": "bad", "schema": {"type": "string", "pattern": "(?<=a)b"}}})
    assert e.value.param == "response_format.json_schema.schema"
    assert "look-around" in e.value.message
    c.assert_quiet()
    c.stop()


def test_forced_and_named_tool_calls_parse_and_validate(start_cluster, tmp_path):
    import json
    from pathlib import Path

    import jsonschema
    import openai

    # the tools' system prompt is ~800 of the tiny tokenizer's tokens
    make_hf_model(tmp_path, tie_word_embeddings=False, max_position_embeddings=2048)
    template = (Path(__file__).parents[1] / "data" / "templates" / "hermes_tools.jinja")
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template.read_text()  # a Hermes-style (Qwen2.5) tool template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    c = start_cluster(prefill=1, decode=1, worker_args=["--model", str(tmp_path),
                                                        "--block-size", "4", "--num-blocks",
                                                        "1024"],
                      routers=[["--local-prefill-max-tokens", "30", "--http-port", "0"]])
    client = openai.OpenAI(base_url=f"http://{c.router.http_address}/v1", api_key="none")
    model = client.models.list().data[0].id
    params = {"get_weather": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False},
        "add": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99,
                                                       "maximum": 99},
                                                 "b": {"type": "integer", "minimum": -9,
                                                       "maximum": 9}},
                "required": ["a", "b"], "additionalProperties": False}}
    tools = [{"type": "function", "function": {"name": n, "parameters": p}}
             for n, p in params.items()]
    msgs = [{"role": "user", "content": "What is the weather in Oslo?"}]
    for k, choice in enumerate(["required", {"type": "function",
                                             "function": {"name": "add"}}] * 2):
        r = client.chat.completions.create(model=model, messages=msgs, tools=tools,
                                           tool_choice=choice, max_tokens=200, temperature=1.0,
                                           seed=k, parallel_tool_calls=False)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", (k, ch)
        assert len(ch.message.tool_calls) == 1
        call = ch.message.tool_calls[0].function
        jsonschema.validate(json.loads(call.arguments), params[call.name])
        if isinstance(choice, dict):
            assert call.name == "add"
    # streamed: the calls arrive as delta.tool_calls
    parts = client.chat.completions.create(model=model, messages=msgs, tools=tools,
                                           tool_choice="required", max_tokens=200, seed=7,
                                           stream=True)
    calls, reasons = [], []
    for part in parts:
        for chc in part.choices:
            calls += chc.delta.tool_calls or []
            reasons.append(chc.finish_reason)
    assert len(calls) >= 1 and "tool_calls" in reasons
    jsonschema.validate(json.loads(calls[0].function.arguments), params[calls[0].function.name])
    # a history with the calls and their results: rendered and answered
    history = msgs + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3 C, snow"}]
    r = client.chat.completions.create(model=model, messages=history, tools=tools,
                                       max_tokens=12, temperature=0)
    assert r.choices[0].message.content is not None or r.choices[0].message.tool_calls
    # the Python SDK over the gRPC API: typed tool calls, a response format, the penalties
    from baton.client import Client

    with Client(c.router.address) as sdk:
        res = sdk.chat(history, tools=tools, tool_choice={"type": "function", "function": {
            "name": "add"}}, max_tokens=200, temperature=1.0, seed=3, parallel_tool_calls=False)
        assert [t.name for t in res.tool_calls] == ["add"] and res.content == ""
        jsonschema.validate(res.tool_calls[0].parsed_arguments(), params["add"])
        fmt = {"type": "json_schema", "json_schema": {"name": "w",
                                                      "schema": params["get_weather"]}}
        res = sdk.chat(msgs, response_format=fmt, max_tokens=120, temperature=1.0, seed=4,
                       presence_penalty=0.5, frequency_penalty=0.2, repetition_penalty=1.1,
                       logit_bias={5: -1.0}, min_p=0.01)
        if res.finish_reason == "stop":
            jsonschema.validate(json.loads(res.text), params["get_weather"])
        else:
            assert res.text.startswith("{")
    c.assert_quiet()
    c.stop()
