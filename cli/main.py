"""The `baton` command line."""

from __future__ import annotations

import argparse
import json
import sys


def _generate(a: argparse.Namespace) -> int:
    from baton.engine.config import EngineConfig
    from baton.engine.engine import LLMEngine
    from baton.engine.errors import BatonError
    from baton.engine.params import SamplingParams

    try:
        engine = LLMEngine.from_path(a.model, EngineConfig(dtype=a.dtype))
        params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature,
                                top_p=a.top_p, top_k=a.top_k, seed=a.seed)
        if a.chat:
            req = engine.add_request(params=params,
                                     messages=[{"role": "user", "content": a.prompt}])
        else:
            req = engine.add_request(a.prompt, params)
    except BatonError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompt_ids = list(req.prompt_token_ids)
    text, ids, reason = [], [], None
    while engine.has_unfinished():
        for out in engine.step():
            ids += out.new_token_ids
            text.append(out.new_text)
            if not a.json:
                print(out.new_text, end="", flush=True)
            if out.finished:
                reason = out.finish_reason
    if a.json:
        print(json.dumps({"text": "".join(text), "token_ids": ids,
                          "prompt_token_ids": prompt_ids, "finish_reason": reason}))
    else:
        print()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="baton", description="Baton: disaggregated LLM serving.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt with the local engine")
    g.add_argument("prompt")
    g.add_argument("--model", help="GGUF file or Hugging Face directory (default: SmolLM2-135M)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--json", action="store_true",
                   help="print one JSON object with text, token_ids, prompt_token_ids")
    a = ap.parse_args(argv)
    return _generate(a)


if __name__ == "__main__":
    sys.exit(main())
