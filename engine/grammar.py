"""Structured output: a request's grammar (a JSON schema, any JSON object, a regex, a choice, a
Lark grammar) as llguidance's grammar, checked where the request arrives, and the per-request
matcher that masks the sampler's logits.

Why llguidance (Microsoft's Rust engine, a vLLM and SGLang backend) and not xgrammar: it has no
Python dependencies, so the router (which imports no torch) checks a schema with the very library
the workers compile it with, and a bad or unsupported schema is a 400 naming what is wrong before
any KV is held; xgrammar's wheel requires torch, transformers and triton. Masks come from Rust,
computed off the GIL.

This module imports no torch: the router uses :func:`from_request_fields` and :func:`check`;
the engine builds a :class:`Grammars` (one tokenizer, a cache of compiled grammars) and gets one
matcher per request from it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance
from baton.engine.errors import InvalidRequestError

# vLLM's structured_outputs keys, each a way to say the grammar
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's removed guided_* fields: a 400 pointing to structured_outputs
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar", "guided_decoding_backend": None,
          "guided_whitespace_pattern": None, "guided_json_object": "json_object"}
# compiled grammars an engine keeps, by their text
CACHE_SIZE = 256


class GrammarError(InvalidRequestError):
    """A grammar Baton cannot serve exactly: the field and llguidance's reason."""


# a reasoning model's thinking block before the structured answer: <think>, any text up to the
# first </think> (a lazy lexeme: the shortest match), then the answer (the original start rule,
# renamed)
THINK = ('start: think /[ \\n]{0,4}/ answer\n'
         'think[lazy]: /<think>(.|\\n)*<\\/think>/\n')


def thinking(lark: str) -> str:
    """A Lark grammar whose ``start`` comes after a thinking block (Qwen3 with thinking on): the
    grammar applies to the answer, not to the reasoning."""
    return THINK + lark.replace("start:", "answer:", 1)


def json_lark(schema: dict) -> str:
    """A Lark grammar of one JSON value of ``schema`` (no whitespace between tokens)."""
    return "start: %json " + json.dumps({**schema, "x-guidance": {"whitespace_flexible":
                                                                   False}})


def from_response_format(rf: object, think: bool = False) -> str:
    """OpenAI's ``response_format`` as a grammar ("" for ``{"type": "text"}``); ``think``: it
    applies after a reasoning model's thinking block."""
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise GrammarError("response_format", rf, 'type must be "text", "json_object" or '
                                                  '"json_schema"')
    if rf["type"] == "text":
        return ""
    if rf["type"] == "json_object":
        return _json_grammar({"type": "object"}, "response_format", think)
    spec = rf.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise GrammarError("response_format.json_schema", spec,
                           'must be {"name": ..., "schema": {...}, "strict": ...}')
    return _json_grammar(spec.get("schema", {}), "response_format.json_schema.schema", think)


def from_structured_outputs(so: object, think: bool = False) -> str:
    """vLLM's ``structured_outputs`` ({"json": schema} | {"regex": r} | {"choice": [...]} |
    {"grammar": lark} | {"json_object": true}) as a grammar; ``think``: after a reasoning
    model's thinking block (JSON forms only)."""
    field = "structured_outputs"
    if not isinstance(so, dict):
        raise GrammarError(field, so, "must be an object")
    given = [k for k in STRUCTURED_KEYS if so.get(k) not in (None, False)]
    unknown = [k for k in so if k not in STRUCTURED_KEYS]
    if unknown:
        raise GrammarError(f"{field}.{unknown[0]}", so[unknown[0]],
                           f"not one of {', '.join(STRUCTURED_KEYS)}")
    if len(given) != 1:
        raise GrammarError(field, so, f"give exactly one of {', '.join(STRUCTURED_KEYS)}")
    key, value = given[0], so[given[0]]
    if key == "json":
        schema = json.loads(value) if isinstance(value, str) else value
        return _json_grammar(schema, f"{field}.json", think)
    if key == "json_object":
        return _json_grammar({"type": "object"}, f"{field}.json_object", think)
    if think:
        raise GrammarError(f"{field}.{key}", value, "with a reasoning model thinking, only the "
                           "JSON forms apply after its thinking block: send "
                           'chat_template_kwargs {"enable_thinking": false}')
    if key == "regex" and isinstance(value, str):
        return _checked(llguidance.LLMatcher.grammar_from_regex(value), f"{field}.regex")
    if key == "choice" and isinstance(value, list) and value and all(
            isinstance(c, str) for c in value):
        lark = "start: " + " | ".join(json.dumps(c) for c in value)
        return _checked(llguidance.LLMatcher.grammar_from_lark(lark), f"{field}.choice")
    if key == "grammar" and isinstance(value, str):
        return _checked(llguidance.LLMatcher.grammar_from_lark(value), f"{field}.grammar")
    raise GrammarError(f"{field}.{key}", value, "has the wrong type")


def _json_grammar(schema: object, field: str, think: bool = False) -> str:
    if not isinstance(schema, dict):
        raise GrammarError(field, schema, "a JSON schema must be an object")
    if think:
        return _checked(llguidance.LLMatcher.grammar_from_lark(thinking(json_lark(schema))),
                        field)
    try:
        # whitespace as a model writes it, but bounded: no endless run of spaces
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
    except ValueError as e:
        raise GrammarError(field, schema, str(e)) from None
    return _checked(grammar, field)


def _checked(grammar: str, field: str) -> str:
    check(grammar, field)
    return grammar


def check(grammar: str, field: str = "grammar") -> None:
    """Raise :class:`GrammarError` naming what llguidance cannot compile (an unsupported
    keyword, a bad regex), before any worker holds KV for the request."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(field, "<grammar>", messages[0] if messages else "invalid grammar")


class Grammars:
    """An engine's structured output: its tokenizer for llguidance (built once), and compiled
    grammars by their text (a request's matcher is a copy of the cached one: compiled once per
    schema, not per request)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids) -> None:
        # ``vocab_size``: the larger of the model's (maybe padded past the tokenizer's) and the
        # tokenizer's own; the runner cuts each mask to the logits' width
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=list(eos_token_ids) or None)
        self.vocab_size = vocab_size
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0

    def matcher(self, grammar: str, field: str = "grammar") -> llguidance.LLMatcher:
        """A fresh matcher for ``grammar`` (compiled on first use)."""
        with self._lock:
            base = self._compiled.get(grammar)
            if base is not None:
                self._compiled.move_to_end(grammar)
        if base is None:
            base = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if base.is_error():
                raise GrammarError(field, "<grammar>", base.get_error())
            with self._lock:
                self.compiles += 1
                self._compiled[grammar] = base
                while len(self._compiled) > CACHE_SIZE:
                    self._compiled.popitem(last=False)
        return base.deep_copy()

    @staticmethod
    def follow(m: llguidance.LLMatcher, tokens, field: str = "grammar") -> None:
        """Advance ``m`` over tokens generated before (a hand-off's first token, a migrated
        request's tokens sent): the matcher is rebuilt from the tokens alone."""
        if tokens and not m.consume_tokens(list(tokens)):
            raise GrammarError(field, list(tokens)[:8], "the tokens generated so far do not "
                               f"match the grammar: {m.get_error()}")
