"""Tool calling: which format a model writes its tool calls in (read from its chat template),
parsing a finished output into content and calls, and the grammar that forces a call
(``tool_choice`` ``required`` or a named function) so its arguments always parse and validate.

Formats, as each family's chat template teaches its model:

* ``hermes`` (Qwen2, Qwen2.5, Qwen3, Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}
  \\n</tool_call>``, one block per call;
* ``llama3`` (Llama 3.1+ JSON tool calling): ``{"name": ..., "parameters": {...}}``, optionally
  after ``<|python_tag|>``, calls separated by ``;``;
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

Torch-free: the router parses and builds grammars with it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from baton.engine.errors import InvalidRequestError

FORMATS = ("hermes", "llama3", "mistral")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = ""

    def to_openai(self, index: int) -> dict:
        return {"index": index, "id": self.id or f"call_{uuid.uuid4().hex[:24]}",
                "type": "function", "function": {"name": self.name,
                                                 "arguments": self.arguments}}


def format_of(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches (None: it renders no tools)."""
    t = chat_template or ""
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or ("ipython" in t and "tools" in t):
        return "llama3"
    return None


def parse(text: str, fmt: str) -> tuple[str | None, list[ToolCall]]:
    """(content before the calls or None, the calls) of a finished output; an output with no
    well-formed call is all content."""
    calls: list[ToolCall] = []
    if fmt == "hermes":
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        for body in _HERMES.findall(text[start:]):
            call = _call(body, "arguments")
            if call is None:
                return text, []
            calls.append(call)
        return text[:start].strip() or None, calls
    if fmt == "mistral":
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return text, []
        try:
            items = json.loads(text[start + len("[TOOL_CALLS]"):].strip())
        except ValueError:
            return text, []
        items = items if isinstance(items, list) else [items]
        calls = [c for c in (_call(json.dumps(i), "arguments") for i in items) if c]
        return (text[:start].strip() or None, calls) if len(calls) == len(items) else (text, [])
    if fmt == "llama3":
        body = text.replace("<|python_tag|>", "").strip()
        if not body.startswith("{"):
            return text, []
        for part in _split_top_level(body, ";"):
            call = _call(part, "parameters") or _call(part, "arguments")
            if call is None:
                return text, []
            calls.append(call)
        return None, calls
    raise ValueError(f"tool-call format {fmt!r}: one of {FORMATS}")


def _call(body: str, key: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(
            obj.get(key, {}), dict):
        return None
    return ToolCall(obj["name"], json.dumps(obj.get(key, {}), ensure_ascii=False))


def _split_top_level(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside strings and brackets."""
    out, depth, start, quoted, escaped = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if quoted:
            escaped = ch == "\\" and not escaped
            quoted = not (ch == '"' and not escaped)
            continue
        if ch == '"':
            quoted = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == sep and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
    out.append(text[start:].strip())
    return [p for p in out if p]


def check_tools(tools: object, choice: object) -> tuple[list[dict], str | None]:
    """The request's ``tools`` (OpenAI function tools) and which ``tool_choice`` forces: the
    function name, "*" for ``required``, None for ``auto``/``none``. Raises naming the field."""
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError("tools", tools, "must be a non-empty list of function tools")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequestError(f"tools[{i}]", t, 'must be {"type": "function", '
                                      '"function": {"name": ..., "parameters": {...}}}')
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters", params,
                                      "must be a JSON schema object")
        out.append({"name": fn["name"], "parameters": params})
    if choice in (None, "auto", "none"):
        return out, None
    if choice == "required":
        return out, "*"
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str) or name not in {t["name"] for t in out}:
        raise InvalidRequestError("tool_choice", choice, 'must be "auto", "none", "required" '
                                  'or {"type": "function", "function": {"name": <a tool>}}')
    return out, name


def forcing_grammar(fmt: str, tools: list[dict], forced: str, parallel: bool) -> str:
    """A Lark grammar (llguidance's, with ``%json``) of one call, or several with ``parallel``,
    to the forced function (``"*"``: any of ``tools``), in ``fmt``, arguments valid for its
    parameters' schema."""
    key = "parameters" if fmt == "llama3" else "arguments"
    chosen = [t for t in tools if forced in ("*", t["name"])]
    one = {"x-guidance": {"whitespace_flexible": False},  # no endless padding
           "anyOf": [{"type": "object",
                      "properties": {"name": {"const": t["name"]}, key: t["parameters"]},
                      "required": ["name", key], "additionalProperties": False}
                     for t in chosen]}
    if fmt == "hermes":
        call = '"<tool_call>\\n" %json ' + json.dumps(one) + ' "\\n</tool_call>"'
        return "start: call" + (' ("\\n" call)*' if parallel else "") + "\ncall: " + call
    if fmt == "llama3":
        return ("start: call" + (' ("; " call)*' if parallel else "")
                + "\ncall: %json " + json.dumps(one))
    if fmt == "mistral":
        arr = {"type": "array", "items": one, "minItems": 1, **({} if parallel
                                                               else {"maxItems": 1})}
        return 'start: "[TOOL_CALLS]" %json ' + json.dumps(arr)
    raise ValueError(f"tool-call format {fmt!r}: one of {FORMATS}")


def thinking_on(chat_template: str | None, template_kwargs: dict | None) -> bool:
    """Whether a chat's answer comes after a reasoning model's thinking block: a template with
    ``<think>`` (Qwen3) and ``enable_thinking`` not turned off."""
    kwargs = template_kwargs or {}
    return "<think>" in (chat_template or "") and kwargs.get("enable_thinking") is not False


def checked(chat_template: str | None, tools: object, choice: object
            ) -> tuple[list[dict], str | None, str | None]:
    """A chat request's tools, what ``tool_choice`` forces (:func:`check_tools`) and the
    format the answer is parsed in (None for ``none``). Raises naming the field."""
    tools_, forced = check_tools(tools, choice)
    if choice == "none":
        return tools_, None, None
    fmt = format_of(chat_template)
    if fmt is None:
        raise InvalidRequestError("tools", "...", "this model's chat template renders no tools "
                                  "(no tool-call format is known for it): leave tools out")
    return tools_, forced, fmt


def prepare(chat_template: str | None, tools: object, choice: object, parallel: bool,
            think: bool) -> tuple[str | None, str]:
    """A chat request's tools: (the format its answer is parsed in, None for ``none``; the
    grammar forcing a call, "" when none is forced). Raises naming the field."""
    from baton.engine import grammar

    checked_tools, forced, fmt = checked(chat_template, tools, choice)
    if fmt is None or forced is None:
        return fmt, ""
    lark = forcing_grammar(fmt, checked_tools, forced, parallel)
    if think:
        lark = grammar.thinking(lark)
    try:
        return fmt, grammar.from_structured_outputs({"grammar": lark})
    except grammar.GrammarError as e:
        raise InvalidRequestError("tools", "...", f"a tool's parameters cannot be served: "
                                  f"{e}") from None


def answer_parts(text: str, fmt: str | None, think: bool
                 ) -> tuple[str, str | None, list[ToolCall]]:
    """(reasoning, content, tool calls) of a finished answer: a thinking block's text (``think``)
    and the calls parsed out in ``fmt`` (None: no tools); content None when calls fill it."""
    reasoning = ""
    if think:
        head, sep, rest = text.partition("</think>")
        if sep:
            reasoning, text = head.removeprefix("<think>").strip(), rest.lstrip()
    if fmt is None:
        return reasoning, text, []
    content, calls = parse(text, fmt)
    return reasoning, content if calls else text, calls
