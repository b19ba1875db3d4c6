#!/usr/bin/env python3
"""What ``BATON_HUGE_PAGES`` trades: an engine's start (its weights copied out of the cache and its
CPU KV pool zero-filled, on transparent huge pages or on plain ones) against its decode speed.

Each round starts two fresh processes, one with ``BATON_HUGE_PAGES=1`` (the default) and one with
``0``, in turn (the order alternates); each loads the model (default SmolLM2-135M, float32, one
torch thread) with the default 1 GiB CPU pool, then decodes 64 tokens for each of 16 streams of
64-token prompts. Reported per process: the engine's start (wall and system CPU) and decode
tokens a second; then the medians and their ratios. Results in bench/results/huge-pages-*.json.

    python bench/huge_pages.py [--rounds 3] [--model PATH] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from baton.bench.common import machine, write_result

STREAMS, PROMPT, OUTPUT = 16, 64, 64


def one(model: str | None, dtype: str, seed: int) -> dict:
    """In this process (started by :func:`main`): the engine's start, then its decode speed."""
    import random
    import time

    import torch
    from baton.engine.config import EngineConfig
    from baton.engine.engine import LLMEngine
    from baton.engine.params import SamplingParams

    torch.set_num_threads(1)
    t0, c0 = time.perf_counter(), os.times()
    engine = LLMEngine.from_path(model, EngineConfig(dtype=dtype, num_threads=1, device="cpu"))
    start_s, c1 = time.perf_counter() - t0, os.times()
    rnd = random.Random(seed)
    vocab = min(engine.model_config.vocab_size, 30000)
    prompts = [[rnd.randrange(100, vocab) for _ in range(PROMPT)] for _ in range(STREAMS)]
    engine.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False))
    params = SamplingParams(max_tokens=OUTPUT + 1, ignore_eos=True, detokenize=False)
    reqs = [engine.add_request(prompt_token_ids=p, params=params) for p in prompts]
    while any(not r.output_token_ids for r in reqs):  # every stream prefilled: time decode only
        engine.step()
    first = sum(len(r.output_token_ids) for r in reqs)
    t = time.perf_counter()
    while not all(r.is_finished for r in reqs):
        engine.step()
    decoded = sum(len(r.output_token_ids) for r in reqs) - first
    return {"start_s": round(start_s, 3), "start_system_s": round(c1.system - c0.system, 3),
            "num_blocks": engine.num_blocks,
            "decode_tokens_per_s": round(decoded / (time.perf_counter() - t), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="pairs of processes (default 3)")
    ap.add_argument("--model", help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    runs = []
    for r in range(a.rounds):
        for huge in ("1", "0") if r % 2 == 0 else ("0", "1"):
            out = subprocess.run(
                [sys.executable, "-c", "import json, sys; from baton.bench.huge_pages import one; "
                 "print(json.dumps(one(sys.argv[1] or None, sys.argv[2], int(sys.argv[3]))))",
                 a.model or "", a.dtype, str(r)],
                env={**os.environ, "BATON_HUGE_PAGES": huge}, capture_output=True, text=True,
                check=True)
            runs.append({"round": r, "huge_pages": huge == "1",
                         **json.loads(out.stdout.strip().splitlines()[-1])})
            print(json.dumps(runs[-1]), flush=True)
    summary = {}
    for huge in (True, False):
        mine = [x for x in runs if x["huge_pages"] == huge]
        summary["huge" if huge else "plain"] = {
            k: statistics.median(x[k] for x in mine)
            for k in ("start_s", "start_system_s", "decode_tokens_per_s")}
    h, p = summary["huge"], summary["plain"]
    summary["start_huge_over_plain"] = round(h["start_s"] / p["start_s"], 2)
    summary["decode_huge_over_plain"] = round(h["decode_tokens_per_s"] / p["decode_tokens_per_s"],
                                              3)
    path = write_result("huge-pages", {"machine": machine(), "args": vars(a), "streams": STREAMS,
                                       "prompt": PROMPT, "output": OUTPUT, "runs": runs,
                                       "summary": summary})
    print(f"\n{'pages':<7}{'start s':>9}{'system s':>10}{'decode tok/s':>14}  (medians of "
          f"{a.rounds})")
    for name in ("huge", "plain"):
        s = summary[name]
        print(f"{name:<7}{s['start_s']:>9.2f}{s['start_system_s']:>10.2f}"
              f"{s['decode_tokens_per_s']:>14.1f}")
    print(f"huge / plain: start {summary['start_huge_over_plain']}x, decode "
          f"{summary['decode_huge_over_plain']}x\nwrote {path}")


if __name__ == "__main__":
    main()
