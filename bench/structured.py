"""Structured output's cost: time per output token (TPOT) of SmolLM2 with and without a JSON
schema, at batch 1 and 16, in one run on one machine (target: under 10% more), and the grammar
compile time of the schemas the tests use.

    python bench/structured.py [--batches 1,16] [--tokens 48] [--rounds 3]

Each round runs the batch without a grammar, then with one (the same prompts, sampling at
temperature 0.8 with a seed per request, 48 new tokens at most), alternating so that the
machine's drift falls on both. TPOT per request: (time of its last token - time of its first)
/ (tokens - 1); the figure is the median over every request of every round. A request under a
schema may end early (its JSON complete): TPOT is per token, so the comparison holds.
Results: bench/results/structured-*.json with the machine's description, and a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from baton.bench.common import machine, write_result

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 60},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 8},
    "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    "summary": {"type": "string"}},
    "required": ["title", "tags", "rating", "summary"], "additionalProperties": False}
# the tests' schemas (tests/unit/test_structured_output.py): nested objects, arrays with
# maxItems, enums, bounded numbers, anyOf
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "owner": {"type": "object", "properties": {"id": {"type": "integer"},
                                                   "tags": {"type": "array",
                                                            "items": {"type": "string",
                                                                      "maxLength": 5},
                                                            "maxItems": 2}},
                  "required": ["id", "tags"], "additionalProperties": False}},
        "required": ["name", "owner"], "additionalProperties": False},
    "enums_and_bounds": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "score": {"type": "integer", "minimum": -3, "maximum": 40},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["color", "score", "ratio"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                            {"type": "boolean"}, {"type": "null"}]},
        "items": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 3}},
        "required": ["value", "items"], "additionalProperties": False},
}
PROMPT = ("Describe the book 'The Left Hand of Darkness' as JSON with a title, tags, a rating "
          "from 1 to 5 and a summary.")


def tpots(engine, n: int, tokens: int, grammar: str, round_: int) -> list[float]:
    from baton.engine.params import SamplingParams

    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    for i in range(n):
        engine.add_request(params=SamplingParams(max_tokens=tokens, temperature=0.8,
                                                 seed=1000 * round_ + i, grammar=grammar),
                           messages=[{"role": "user", "content": f"{PROMPT} ({i})"}],
                           request_id=f"r{round_}-{i}-{bool(grammar)}")
    while engine.has_unfinished():
        for o in engine.step():
            now = time.perf_counter()
            first.setdefault(o.request_id, now)
            last[o.request_id] = now
            count[o.request_id] = count.get(o.request_id, 0) + len(o.new_token_ids)
    return [(last[r] - first[r]) / (count[r] - 1) for r in first if count[r] > 1]


def compile_times() -> dict:
    """Seconds to compile each test schema (a fresh Grammars each time: nothing cached)."""
    from baton.engine import grammar
    from baton.engine.loader import load_model

    tok = load_model().tokenizer
    out = {}
    schemas = {"bench": SCHEMA, **SCHEMAS}
    t0 = time.perf_counter()
    g = grammar.Grammars(tok.tk.to_str(), tok.vocab_size, tok.eos_token_ids)
    out["tokenizer_s"] = time.perf_counter() - t0
    for name, schema in schemas.items():
        text = grammar.from_response_format({"type": "json_schema",
                                             "json_schema": {"name": name, "schema": schema}})
        t0 = time.perf_counter()
        g.matcher(text)
        out[name] = time.perf_counter() - t0
        t0 = time.perf_counter()
        g.matcher(text)
        out[name + "_cached"] = time.perf_counter() - t0
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    from baton.engine import grammar
    from baton.engine.config import EngineConfig
    from baton.engine.engine import LLMEngine

    engine = LLMEngine.from_path(None, EngineConfig(max_num_seqs=32))
    g = grammar.from_response_format({"type": "json_schema",
                                      "json_schema": {"name": "book", "schema": SCHEMA}})
    tpots(engine, 2, 4, g, -1)  # warm-up: kernels, the grammar compiled
    tpots(engine, 2, 4, "", -1)
    rows = []
    for b in (int(x) for x in a.batches.split(",")):
        plain: list[float] = []
        schema: list[float] = []
        for r in range(a.rounds):
            plain += tpots(engine, b, a.tokens, "", r)
            schema += tpots(engine, b, a.tokens, g, r)
        p, s = statistics.median(plain), statistics.median(schema)
        rows.append({"batch": b, "tpot_plain_s": p, "tpot_schema_s": s,
                     "overhead": s / p - 1, "requests": len(plain)})
        print(f"batch {b}: plain {p * 1e3:.1f} ms, schema {s * 1e3:.1f} ms "
              f"({100 * (s / p - 1):+.1f}%)", file=sys.stderr, flush=True)
    comp = compile_times()
    result = {"bench": "structured", "machine": machine(), "model": "SmolLM2-135M (default)",
              "tokens": a.tokens, "rounds": a.rounds, "rows": rows, "compile_s": comp,
              "target_overhead": 0.10}
    path = write_result("structured", result)
    print(f"{'batch':>5} {'TPOT plain ms':>14} {'TPOT schema ms':>15} {'overhead':>9}")
    for r in rows:
        print(f"{r['batch']:>5} {r['tpot_plain_s'] * 1e3:>14.2f} {r['tpot_schema_s'] * 1e3:>15.2f} "
              f"{100 * r['overhead']:>8.1f}%")
    print("compile: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in comp.items()))
    print(f"wrote {path}")
    print(json.dumps({r["batch"]: round(r["overhead"], 3) for r in rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
