#!/usr/bin/env python3
"""Baton's engine against Hugging Face transformers (and optionally vLLM) on SmolLM2-135M-Instruct,
in one run on one machine.

Workload (the same as the vLLM peer's ``peer_bench.py bench``):
  single      one request, a 500-token prompt, 128 output tokens (EOS ignored):
              TTFT and decode tokens/s after the first token.
  concurrent  32 requests at once, prompt lengths randint(50, 1000) with seed 7, 128 output
              tokens each: aggregate output tokens/s = all output tokens / wall time.
              HF transformers has no batching server: its figure is the same 32 requests
              generated one after another (``--hf-sample K`` times K of them, spread over the
              lengths, and fits time = a + b * prompt_length to estimate the other 32 - K).

Prompts are random vocabulary words (exact token counts), salted per run so no prefix cache can
serve them. Baton runs in this process (``LLMEngine.step``); vLLM, if ``--vllm-url`` is given, is
an already started server (``../shared/peers/vllm_pd.sh start-colocated PORT``) that gets the
same token ids over its OpenAI API, alternating with Baton ``--repeats`` times because this
machine's timings drift by 15-20% between runs.

Writes bench/results/engine-<UTC time>.json (with the machine description) and prints a table.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import threading
import time
from statistics import median
from urllib.parse import urlparse

import torch
from baton.bench.common import machine, random_word_prompts, settle, write_result
from baton.engine.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.engine.loader import load_model
from baton.engine.params import SamplingParams

OUT_TOKENS = 128
SINGLE_PROMPT = 500


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
# Baton
# ------------------------------------------------------------------------------------------------


def baton_run(engine: LLMEngine, prompts: list[list[int]]) -> dict:
    """Submit all prompts at once, step to completion; per-request first/last token times."""
    params = SamplingParams(max_tokens=OUT_TOKENS, ignore_eos=True, detokenize=True)
    t0 = time.perf_counter()
    reqs = [engine.add_request(params=params, prompt_token_ids=p) for p in prompts]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
                count[o.request_id] = count.get(o.request_id, 0) + len(o.new_token_ids)
    wall = time.perf_counter() - t0
    ids = [r.request_id for r in reqs]
    return {"wall_s": wall, "ttft_s": [first[i] - t0 for i in ids],
            "decode_s": [last[i] - first[i] for i in ids], "tokens": [count[i] for i in ids]}


def baton_single(engine, prompt) -> dict:
    r = baton_run(engine, [prompt])
    n = r["tokens"][0]
    return {"ttft_s": r["ttft_s"][0], "decode_tok_s": (n - 1) / r["decode_s"][0],
            "e2e_s": r["wall_s"], "completion_tokens": n}


def baton_concurrent(engine, prompts) -> dict:
    r = baton_run(engine, prompts)
    out = sum(r["tokens"])
    return {"wall_s": r["wall_s"], "output_tokens": out, "agg_out_tok_s": out / r["wall_s"],
            "ttft_p50_s": median(r["ttft_s"]), "ttft_max_s": max(r["ttft_s"])}


# ------------------------------------------------------------------------------------------------
# Hugging Face transformers (the reference): same weights, generate() one request at a time
# ------------------------------------------------------------------------------------------------


def hf_generate_s(hf, prompt, new_tokens) -> float:
    ids = torch.tensor([prompt])
    t = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=0)
    assert out.shape[1] == len(prompt) + new_tokens
    return time.perf_counter() - t


def hf_single(hf, prompt) -> dict:
    t1 = hf_generate_s(hf, prompt, 1)
    tn = hf_generate_s(hf, prompt, OUT_TOKENS)
    return {"ttft_s": t1, "decode_tok_s": (OUT_TOKENS - 1) / (tn - t1), "e2e_s": tn}


def hf_sequential(hf, prompts, sample: int) -> dict:
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    k = min(sample, len(prompts))
    picked = sorted({order[round(j * (len(order) - 1) / max(1, k - 1))] for j in range(k)})
    times = {}
    for n, i in enumerate(picked):
        times[i] = hf_generate_s(hf, prompts[i], OUT_TOKENS)
        log(f"  hf request {n + 1}/{len(picked)}: {len(prompts[i])}-token prompt "
            f"{times[i]:.1f}s")
    if len(picked) == len(prompts):
        total, how = sum(times.values()), "measured"
    else:  # least squares time = a + b * prompt_len over the measured ones
        xs = [len(prompts[i]) for i in picked]
        ys = [times[i] for i in picked]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        a = my - b * mx
        total = sum(times.get(i, a + b * len(p)) for i, p in enumerate(prompts))
        how = f"{len(picked)} measured, the rest fitted as {a:.2f}s + {b * 1000:.2f}ms/prompt token"
    out = OUT_TOKENS * len(prompts)
    return {"wall_s": total, "output_tokens": out, "agg_out_tok_s": out / total, "how": how}


# ------------------------------------------------------------------------------------------------
# vLLM peer over its OpenAI API (stdlib only: streaming /v1/completions with token-id prompts)
# ------------------------------------------------------------------------------------------------


def vllm_request(url: str, model: str, prompt: list[int], t0: float) -> dict:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=3600)
    body = {"model": model, "prompt": prompt, "max_tokens": OUT_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    conn.request("POST", u.path.rstrip("/") + "/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"vLLM answered {resp.status}: {resp.read()[:300]!r}")
    first = last = None
    usage = None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        ev = json.loads(line[5:])
        if ev.get("choices") and ev["choices"][0].get("text"):
            now = time.perf_counter()
            first = first or now
            last = now
        if ev.get("usage"):
            usage = ev["usage"]
    conn.close()
    return {"ttft_s": first - t0, "decode_s": last - first,
            "tokens": usage["completion_tokens"], "prompt_tokens": usage["prompt_tokens"]}


def vllm_model(url: str) -> str:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("GET", u.path.rstrip("/") + "/models")
    return json.loads(conn.getresponse().read())["data"][0]["id"]


def vllm_run(url, model, prompts) -> dict:
    results: list[dict | Exception] = [None] * len(prompts)  # type: ignore[list-item]
    t0 = time.perf_counter()

    def go(i):
        try:
            results[i] = vllm_request(url, model, prompts[i], t0)
        except Exception as e:  # noqa: BLE001  (reported below)
            results[i] = e

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    errs = [r for r in results if isinstance(r, Exception)]
    if errs:
        raise errs[0]
    return {"wall_s": wall, "results": results}


def vllm_single(url, model, prompt) -> dict:
    r = vllm_run(url, model, [prompt])
    x = r["results"][0]
    return {"ttft_s": x["ttft_s"], "decode_tok_s": (x["tokens"] - 1) / x["decode_s"],
            "e2e_s": r["wall_s"], "completion_tokens": x["tokens"]}


def vllm_concurrent(url, model, prompts) -> dict:
    r = vllm_run(url, model, prompts)
    out = sum(x["tokens"] for x in r["results"])
    ttfts = [x["ttft_s"] for x in r["results"]]
    return {"wall_s": r["wall_s"], "output_tokens": out, "agg_out_tok_s": out / r["wall_s"],
            "ttft_p50_s": median(ttfts), "ttft_max_s": max(ttfts)}


# ------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=2, help="Baton (and vLLM) runs per figure")
    ap.add_argument("--hf-sample", type=int, default=8,
                    help="HF sequential: requests actually run out of 32 (32 = all)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--vllm-url", help="e.g. http://127.0.0.1:8100/v1 (bf16 server, started "
                                       "with ../shared/peers/vllm_pd.sh start-colocated 8100)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    ap.add_argument("--no-save", action="store_true")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    model = load_model(a.model)
    salt = str(time.time())
    rng = random.Random(7)
    lengths = [rng.randint(50, 1000) for _ in range(a.concurrency)]
    tok = model.tokenizer

    def workload(tag):
        [single] = random_word_prompts(tok, [SINGLE_PROMPT], f"single-{tag}-{salt}")
        conc = random_word_prompts(tok, lengths, f"conc-{tag}-{salt}")
        return single, conc

    warm = random_word_prompts(tok, [64, 300], f"warm-{salt}")
    res = {"machine": machine(), "model": model.name, "out_tokens": OUT_TOKENS,
           "single_prompt_tokens": SINGLE_PROMPT, "concurrent_prompt_lengths": lengths,
           "baton": {}, "hf": {}, "vllm": None}
    vmodel = vllm_model(a.vllm_url) if a.vllm_url else None
    if vmodel:
        res["vllm"] = {"url": a.vllm_url, "model": vmodel, "dtype": "bfloat16 (server's)",
                       "single": [], "concurrent": []}
    for dtype in a.dtypes.split(","):
        run_baton(a, model, dtype, res, workload, warm, vmodel)
        if not a.skip_hf:
            run_hf(a, model, dtype, res, workload, warm)
    rows = summarize(res)
    print_summary(rows)
    if not a.no_save:
        log(f"wrote {write_result('engine', res)}")
    return 0


def run_baton(a, model, dtype: str, res: dict, workload, warm, vmodel) -> None:
    """Baton's engine in ``dtype``: single and concurrent, ``--repeats`` times (alternating with
    the bf16 peer when there is one)."""
    engine = LLMEngine(model, EngineConfig(dtype=dtype))
    log(f"baton {dtype}: compute {engine.cfg.compute_dtype}, GEMMs "
        f"{engine.cfg.gemm_dtype}, attention "
        f"{engine.attention_backend}, {engine.num_blocks} KV blocks, "
        f"{torch.get_num_threads()} threads")
    engine.generate(warm, SamplingParams(max_tokens=8, ignore_eos=True))
    b = res["baton"][dtype] = {"compute_dtype": str(engine.cfg.compute_dtype),
                               "gemm_dtype": str(engine.cfg.gemm_dtype),
                               "attention": engine.attention_backend,
                               "single": [], "concurrent": []}
    for rep in range(a.repeats):
        single, conc = workload(f"{dtype}-{rep}")
        settle()
        b["single"].append(baton_single(engine, single))
        log(f"baton {dtype} single #{rep}: {b['single'][-1]['decode_tok_s']:.1f} tok/s, "
            f"TTFT {b['single'][-1]['ttft_s'] * 1000:.0f} ms")
        settle()
        b["concurrent"].append(baton_concurrent(engine, conc))
        log(f"baton {dtype} concurrent #{rep}: "
            f"{b['concurrent'][-1]['agg_out_tok_s']:.1f} out tok/s")
        engine.check_integrity()
        if vmodel and dtype == "bfloat16":  # alternate with the bf16 peer
            run_vllm(a, res["vllm"], vmodel, single, conc, rep)


def run_vllm(a, v: dict, vmodel: str, single, conc, rep: int) -> None:
    settle()
    v["single"].append(vllm_single(a.vllm_url, vmodel, single))
    log(f"vllm single #{rep}: {v['single'][-1]['decode_tok_s']:.1f} tok/s, "
        f"TTFT {v['single'][-1]['ttft_s'] * 1000:.0f} ms")
    settle()
    v["concurrent"].append(vllm_concurrent(a.vllm_url, vmodel, conc))
    log(f"vllm concurrent #{rep}: {v['concurrent'][-1]['agg_out_tok_s']:.1f} out tok/s")


def run_hf(a, model, dtype: str, res: dict, workload, warm) -> None:
    """HF transformers in ``dtype``: single, and the concurrent workload run sequentially."""
    from baton.engine.hf_reference import to_hf

    hf = to_hf(model, getattr(torch, dtype))
    single, conc = workload(f"hf-{dtype}")
    hf_generate_s(hf, warm[0], 8)
    settle()
    h = res["hf"][dtype] = {"single": hf_single(hf, single)}
    log(f"hf {dtype} single: {h['single']['decode_tok_s']:.1f} tok/s, "
        f"TTFT {h['single']['ttft_s'] * 1000:.0f} ms")
    h["sequential"] = hf_sequential(hf, conc, a.hf_sample)
    log(f"hf {dtype} sequential: {h['sequential']['agg_out_tok_s']:.1f} out tok/s "
        f"({h['sequential']['how']})")


def summarize(res: dict) -> list[tuple[str, dict]]:
    """Medians over the repeats and the ratios, per dtype (also into ``res["summary"]``)."""
    rows = []
    for dtype, b in res["baton"].items():
        s = {"baton_decode_tok_s": median([x["decode_tok_s"] for x in b["single"]]),
             "baton_ttft_s": median([x["ttft_s"] for x in b["single"]]),
             "baton_concurrent_tok_s": median([x["agg_out_tok_s"] for x in b["concurrent"]])}
        if dtype in res["hf"]:
            h = res["hf"][dtype]
            s["hf_decode_tok_s"] = h["single"]["decode_tok_s"]
            s["hf_sequential_tok_s"] = h["sequential"]["agg_out_tok_s"]
            s["decode_ratio_vs_hf"] = s["baton_decode_tok_s"] / s["hf_decode_tok_s"]
            s["concurrent_ratio_vs_hf"] = s["baton_concurrent_tok_s"] / s["hf_sequential_tok_s"]
        if res["vllm"] and dtype == "bfloat16":
            v = res["vllm"]
            s["vllm_decode_tok_s"] = median([x["decode_tok_s"] for x in v["single"]])
            s["vllm_ttft_s"] = median([x["ttft_s"] for x in v["single"]])
            s["vllm_concurrent_tok_s"] = median([x["agg_out_tok_s"] for x in v["concurrent"]])
            s["decode_ratio_vs_vllm"] = s["baton_decode_tok_s"] / s["vllm_decode_tok_s"]
            s["concurrent_ratio_vs_vllm"] = (s["baton_concurrent_tok_s"]
                                             / s["vllm_concurrent_tok_s"])
        rows.append((dtype, s))
    res["summary"] = dict(rows)
    return rows


def _f(x, fmt="{:.1f}"):
    return "-" if x is None else fmt.format(x)


def print_summary(rows) -> None:
    f = _f
    print(f"\n{'dtype':9} {'figure':34} {'baton':>8} {'hf':>8} {'ratio':>6} {'vllm':>8} "
          f"{'ratio':>6}")
    for dtype, s in rows:
        print(f"{dtype:9} {'single decode tok/s':34} {f(s['baton_decode_tok_s']):>8} "
              f"{f(s.get('hf_decode_tok_s')):>8} {f(s.get('decode_ratio_vs_hf'), '{:.2f}'):>6} "
              f"{f(s.get('vllm_decode_tok_s')):>8} "
              f"{f(s.get('decode_ratio_vs_vllm'), '{:.2f}'):>6}")
        print(f"{'':9} {'32 concurrent out tok/s':34} {f(s['baton_concurrent_tok_s']):>8} "
              f"{f(s.get('hf_sequential_tok_s')):>8} "
              f"{f(s.get('concurrent_ratio_vs_hf'), '{:.2f}'):>6} "
              f"{f(s.get('vllm_concurrent_tok_s')):>8} "
              f"{f(s.get('concurrent_ratio_vs_vllm'), '{:.2f}'):>6}")
        print(f"{'':9} {'TTFT 500-token prompt ms':34} {f(s['baton_ttft_s'] * 1000, '{:.0f}'):>8}"
              f" {'':>8} {'':>6} "
              f"{f(s.get('vllm_ttft_s') and s['vllm_ttft_s'] * 1000, '{:.0f}'):>8}")


if __name__ == "__main__":
    sys.exit(main())
