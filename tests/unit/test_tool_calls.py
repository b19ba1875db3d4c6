"""Tool calling (engine/tool_calls.py and the OpenAI front): a tool-calling history rendered by
Baton exactly as transformers' ``apply_chat_template(..., tools=...)`` renders the same template
(a Hermes-style template, Qwen2.5's constructs, as test data); canned outputs parsed per family
format; the grammar of a forced call accepting exactly well-formed calls to the right function;
the request fields checked by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from baton.engine import grammar, tool_calls
from baton.engine.errors import InvalidRequestError

TEMPLATE = (Path(__file__).parents[1] / "data" / "templates" / "hermes_tools.jinja").read_text()
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
            "additionalProperties": False}}}]
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris, and 2+3?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}},
        {"id": "call_2", "type": "function", "function": {"name": "add",
                                                          "arguments": {"a": 2, "b": 3}}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "21 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "name": "add", "content": "5"},
]


def test_a_tool_calling_history_renders_as_transformers_renders_it(tiny_llama):
    from baton.engine.loader import load_model
    from transformers import PreTrainedTokenizerFast

    tok = load_model(tiny_llama[0]).tokenizer
    tok.chat_template = TEMPLATE
    ours = tok.apply_chat_template(HISTORY, tools=TOOLS)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tiny_llama[0] / "tokenizer.json"))
    theirs = hf.apply_chat_template(HISTORY, tools=TOOLS, tokenize=False,
                                    add_generation_prompt=True, chat_template=TEMPLATE)
    assert ours == theirs
    assert '"name": "get_weather"' in ours and "<tool_response>\n5\n</tool_response>" in ours
    assert tool_calls.format_of(TEMPLATE) == "hermes"


@pytest.mark.parametrize("fmt, text, content, calls", [
    ("hermes", 'Checking.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Oslo", "unit": "c"}}\n</tool_call>',
     "Checking.", [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo", "unit": "c"})]),
    ("hermes", "no call here", "no call here", []),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1,', '<tool_call>\n{"name": '
     '"add", "arguments": {"a": 1,', []),  # cut off: content, never a broken call
    ("llama3", '<|python_tag|>{"name": "add", "parameters": {"a": 4, "b": 5}}; '
               '{"name": "get_weather", "parameters": {"city": "a;b", "unit": "f"}}',
     None, [("add", {"a": 4, "b": 5}), ("get_weather", {"city": "a;b", "unit": "f"})]),
    ("llama3", "The answer is 4.", "The answer is 4.", []),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 1}}]', None,
     [("add", {"a": 1, "b": 1})]),
    ("mistral", "[TOOL_CALLS][{broken", "[TOOL_CALLS][{broken", []),
])
def test_canned_outputs_parse_per_family_format(fmt, text, content, calls):
    got_content, got = tool_calls.parse(text, fmt)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    for i, c in enumerate(got):
        o = c.to_openai(i)
        assert o["type"] == "function" and o["id"].startswith("call_") and o["index"] == i


@pytest.mark.parametrize("fmt", tool_calls.FORMATS)
def test_a_forced_calls_grammar_takes_exactly_valid_calls(tiny_llama, fmt):
    from baton.engine.loader import load_model

    tok = load_model(tiny_llama[0]).tokenizer
    tools, forced = tool_calls.check_tools(TOOLS, {"type": "function",
                                                   "function": {"name": "get_weather"}})
    g = grammar.Grammars(tok.tk.to_str(), 400, tok.eos_token_ids)
    text = grammar.from_structured_outputs(
        {"grammar": tool_calls.forcing_grammar(fmt, tools, forced, parallel=False)})
    good = {"hermes": '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo",'
                      '"unit":"c"}}\n</tool_call>',
            "llama3": '{"name":"get_weather","parameters":{"city":"Oslo","unit":"c"}}',
            "mistral": '[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Oslo",'
                       '"unit":"c"}}]'}[fmt]
    bad = good.replace('"c"', '"k"')  # not in the enum
    other = good.replace("get_weather", "add")  # not the named function
    for s, ok in ((good, True), (bad, False), (other, False)):
        m = g.matcher(text)
        ids = tok.encode(s, add_special_tokens=False)
        assert (m.validate_tokens(ids) == len(ids)) == ok, (fmt, s)


def test_the_request_fields_are_checked_by_name():
    from baton.services.router.errors import RequestError
    from baton.services.router.openai_http import generate_request

    base = {"messages": [{"role": "user", "content": "hi"}]}
    req = generate_request("chat", {**base, "tools": TOOLS, "tool_choice": "required",
                                    "parallel_tool_calls": False}, chat_template=TEMPLATE)
    assert json.loads(req.chat.tools_json) == TOOLS and req.chat.tool_choice_json == '"required"'
    assert req.chat.HasField("parallel_tool_calls") and not req.chat.parallel_tool_calls
    fmt, forced = tool_calls.prepare(TEMPLATE, TOOLS, "required", False, False)
    assert fmt == "hermes" and "get_weather" in forced and "add" in forced
    auto = generate_request("chat", {**base, "tools": TOOLS}, chat_template=TEMPLATE)
    assert auto.chat.tools_json and not auto.params.grammar  # auto: parsed, not forced
    assert tool_calls.prepare(TEMPLATE, TOOLS, "auto", True, False) == ("hermes", "")
    none = generate_request("chat", {**base, "tools": TOOLS, "tool_choice": "none"},
                            chat_template=TEMPLATE)
    assert not none.chat.tools_json
    for body, field in (({"tools": TOOLS, "tool_choice": {"type": "function",
                                                          "function": {"name": "nope"}}},
                         "tool_choice"),
                        ({"tools": [{"type": "function"}]}, "tools[0]"),
                        ({"tools": TOOLS}, "tools")):  # the template renders no tools
        with pytest.raises(RequestError) as e:
            generate_request("chat", {**base, **body},
                             chat_template=None if field == "tools" else TEMPLATE)
        assert e.value.field == field, (body, e.value.field)
    with pytest.raises(InvalidRequestError):
        tool_calls.check_tools([], None)
