"""Structured output (engine/grammar.py, llguidance): OpenAI's response_format and vLLM's
structured_outputs as grammars, refused naming the keyword where llguidance cannot serve them;
and the engine's outputs under schemas of varied shape (nested objects, arrays with maxItems,
enums, bounded numbers, anyOf) on a tiny random model sampling at temperature 1: every output
that ends with ``stop`` validates against its schema (``jsonschema``), every ``length`` output
is a prefix the grammar accepts, and a request resumed from its first tokens (a migration)
continues within the grammar."""

from __future__ import annotations

import json

import jsonschema
import pytest
from baton.bench.structured import SCHEMAS
from baton.engine import grammar, tool_calls
from baton.engine.params import SamplingParams


def json_schema(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema,
                                                   "strict": True}}


@pytest.mark.parametrize("bad, field, words", [
    (json_schema({"type": "strnig"}), "response_format.json_schema.schema", "strnig"),
    (json_schema({"type": "string", "format": "ipv9"}), "response_format.json_schema.schema",
     "ipv9"),
    (json_schema({"type": "string", "pattern": "(?<=a)b"}),
     "response_format.json_schema.schema", "look-around"),
    ({"type": "xml"}, "response_format", "json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": 5}}, "response_format.json_schema",
     "schema"),
])
def test_a_schema_llguidance_cannot_serve_is_refused_naming_it(bad, field, words):
    with pytest.raises(grammar.GrammarError) as e:
        grammar.from_response_format(bad)
    assert e.value.field == field and words in str(e.value)


def test_structured_outputs_take_vllms_forms_and_refuse_the_rest():
    for so in ({"json": SCHEMAS["any_of"]}, {"json": json.dumps(SCHEMAS["nested"])},
               {"regex": "[a-c]{2,4}"}, {"choice": ["yes", "no"]},
               {"grammar": 'start: "a" | "b"'}, {"json_object": True}):
        assert grammar.from_structured_outputs(so)
    for so, field in (({"xml": "x"}, "structured_outputs.xml"),
                      ({"json": {}, "regex": "a"}, "structured_outputs"),
                      ({"regex": "(a"}, "structured_outputs.regex"),
                      ({"choice": []}, "structured_outputs.choice")):
        with pytest.raises(grammar.GrammarError) as e:
            grammar.from_structured_outputs(so)
        assert e.value.field == field, (so, e.value.field)
    assert grammar.from_response_format({"type": "text"}) == ""


def run(engine, prompt, params: SamplingParams) -> tuple[list[int], str, str]:
    req = engine.add_request(prompt_token_ids=prompt, params=params)
    ids, text, reason = [], "", None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == req.request_id:
                ids += o.new_token_ids
                text += o.new_text
                reason = o.finish_reason or reason
    return ids, text, reason


def accepts_prefix(engine, g: str, tokens: list[int]) -> bool:
    m = engine.grammars().matcher(g)
    return m.validate_tokens(tokens) == len(tokens)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_outputs_validate_or_are_prefixes_and_resume_within_the_grammar(tiny_engine, name):
    engine = tiny_engine(num_kv_blocks=256)
    schema = SCHEMAS[name]
    g = grammar.from_response_format(json_schema(schema))
    prompt = [(7 * i + 3) % 300 + 3 for i in range(12)]
    stopped = 0
    for seed in range(4):
        p = SamplingParams(max_tokens=70, temperature=1.0, seed=seed, grammar=g)
        ids, text, reason = run(engine, prompt, p)
        if reason == "stop":
            jsonschema.validate(json.loads(text), schema)
            stopped += 1
        else:
            assert reason == "length" and accepts_prefix(engine, g, ids), (seed, text)
        if seed == 0 and len(ids) > 4:  # resumed from its first 4 tokens, as after a migration
            rest, _, _ = run(engine, prompt + ids[:4], SamplingParams(
                max_tokens=70 - 4, temperature=1.0, seed=0, grammar=g, output_prefix=4))
            assert rest == ids[4:]  # same seeds per position, same grammar state
    assert stopped, "no output completed its JSON"
    short, _, reason = run(engine, prompt, SamplingParams(max_tokens=3, temperature=1.0,
                                                          seed=9, grammar=g))
    assert reason == "length" and accepts_prefix(engine, g, short)
    assert engine.grammars().compiles == 1  # compiled once per schema, then copied


QWEN3_LIKE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
              "{% if enable_thinking is defined and enable_thinking is false %}"
              "<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_a_reasoning_models_grammar_starts_after_its_thinking_block(tiny_llama):
    """Qwen3 thinking: the schema applies to the answer after </think>; the thinking goes to
    reasoning_content. With enable_thinking false the grammar starts at once."""
    from types import SimpleNamespace

    from baton.engine.loader import load_model
    from baton.services.router.openai_http import _Answer, generate_request
    from baton_client.v1 import api_pb2

    tok = load_model(tiny_llama[0]).tokenizer
    g = grammar.Grammars(tok.tk.to_str(), 400, tok.eos_token_ids)
    body = {"messages": [{"role": "user", "content": "hi"}],
            "response_format": json_schema(SCHEMAS["enums_and_bounds"])}
    thinking = generate_request("chat", body, chat_template=QWEN3_LIKE).params.grammar
    direct = generate_request("chat", {**body, "chat_template_kwargs": {
        "enable_thinking": False}}, chat_template=QWEN3_LIKE).params.grammar
    answer = '{"color":"red","score":3,"ratio":0.5}'
    for text, ok_thinking, ok_direct in (
            (f"<think>red, I think</think>\n\n{answer}", True, False),
            (answer, False, True), ("<think>hmm</think>\nnot json", False, False)):
        ids = tok.encode(text, add_special_tokens=False)
        for grammar_text, ok in ((thinking, ok_thinking), (direct, ok_direct)):
            assert (g.matcher(grammar_text).validate_tokens(ids) == len(ids)) == ok, text
    orch = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=QWEN3_LIKE), model="m")
    req = generate_request("chat", body, chat_template=QWEN3_LIKE)
    a = _Answer("chat", orch, req, body)
    text = f"<think>red, I think</think>\n\n{answer}"
    a.take(api_pb2.GenerateResponse(delta=api_pb2.GenerateDelta(text=text)))
    # the orchestrator's final message splits the answer (progress.Attempt.final)
    reasoning, content, calls = tool_calls.answer_parts(text, None, True)
    assert not calls
    a.take(api_pb2.GenerateResponse(final=api_pb2.GenerateFinal(
        finish_reason="stop", content=content, reasoning_content=reasoning)))
    message = a.body()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": answer,
                       "reasoning_content": "red, I think"}
