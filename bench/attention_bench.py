"""Prefill attention on CPU: the native flash kernel against PyTorch's attention, same inputs,
same run, one machine. Results in bench/results/attention-*.json.

For each shape (SmolLM2's heads: 9 query heads on 3 KV heads of 64; a Llama-3-8B layer's: 32 on
8 of 128) and each prompt (new tokens over cached ones), it checks the kernel against a float64
attention first, then times both (median of ``--reps`` after a warm-up) and reports GFLOP/s
(4 x heads x head_dim x visible query-key pairs) and the ratio. Then a whole SmolLM2 prefill of
``--prompt`` tokens with the kernel on and off (``LlamaModel.prefill_native``).

    python bench/attention_bench.py [--threads 1] [--reps 7] [--prompt 1000]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from functools import partial

from baton.bench.common import machine, write_result

SHAPES = {"smollm2": (3, 3, 64), "llama3-8b": (8, 4, 128)}  # kv heads, group, head_dim
_SALTS = itertools.count()
PROMPTS = [(128, 0), (1000, 0), (2000, 0), (500, 1000)]  # (new tokens, cached tokens)


def median_time(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def kernels(reps: int) -> list[dict]:
    import torch
    from baton.kernels import cpu_attention
    from baton.kernels.paged_attention import prefill_attention

    rows = []
    for name, (hkv, group, d) in SHAPES.items():
        for dtype in (torch.bfloat16, torch.float32):
            if not cpu_attention.prefill_supported(dtype, d):
                print(f"  {name} {dtype}: this CPU cannot run the kernel, skipped")
                continue
            for n, past in PROMPTS:
                g = torch.Generator().manual_seed(n + past)
                q = torch.randn(n, hkv * group, d, generator=g).to(dtype)
                k, v = (torch.randn(past + n, hkv, d, generator=g).to(dtype) for _ in range(2))
                scale = d ** -0.5
                got = cpu_attention.prefill_attention(q, k, v, past, scale)
                if n <= 1000:  # correctness first (the float64 reference is slow past that)
                    exact = prefill_attention(q.double(), k.double(), v.double(), past, scale)
                    err = float((got.double() - exact).abs().max())
                    limit = 1e-4 if dtype == torch.float32 else 3e-2
                    assert err < limit, f"{name} {dtype} n={n} past={past}: error {err}"
                inputs = (q, k, v, past, scale)
                native = median_time(partial(cpu_attention.prefill_attention, *inputs), reps)
                ref = median_time(partial(prefill_attention, *inputs), reps)
                flops = 4 * hkv * group * d * (n * past + n * (n + 1) / 2)
                rows.append({"shape": name, "dtype": str(dtype).removeprefix("torch."),
                             "new_tokens": n, "cached_tokens": past,
                             "native_ms": native * 1e3, "torch_ms": ref * 1e3,
                             "native_gflops": flops / native / 1e9,
                             "torch_gflops": flops / ref / 1e9, "speedup": ref / native})
                r = rows[-1]
                print(f"  {name:9} {r['dtype']:8} {n:5} new {past:5} cached: native "
                      f"{r['native_ms']:7.2f} ms {r['native_gflops']:5.0f} GF/s | torch "
                      f"{r['torch_ms']:7.2f} ms {r['torch_gflops']:5.0f} GF/s | "
                      f"{r['speedup']:.2f}x", flush=True)
    return rows


def fresh_prefill(engine, ids: list[int], tag: str) -> None:
    """One prefill of ``ids`` (and one token), a new cache salt each time: no prefix-cache hit."""
    from baton.engine.params import SamplingParams

    engine.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True,
                                          cache_salt=f"{tag}-{next(_SALTS)}"))


def whole_prefill(prompt: int, reps: int) -> list[dict]:
    from baton.engine.config import EngineConfig
    from baton.engine.engine import LLMEngine
    from baton.engine.loader import default_model_path, load_model

    rows = []
    ids = [100 + i * 7919 % 40000 for i in range(prompt)]
    for dtype in ("bfloat16", "float32"):
        engine = LLMEngine(load_model(default_model_path()),
                           EngineConfig(dtype=dtype, max_num_batched_tokens=max(2048, prompt)))
        if not engine.model.prefill_native:
            print(f"  SmolLM2 {dtype}: the kernel is off on this CPU, skipped")
            continue
        times = {}
        for native in (True, False):
            engine.model.prefill_native = native
            times[native] = median_time(partial(fresh_prefill, engine, ids, f"{native}"), reps)
        rows.append({"dtype": dtype, "prompt_tokens": prompt, "native_s": times[True],
                     "torch_s": times[False], "speedup": times[False] / times[True]})
        print(f"  SmolLM2 {dtype:8} {prompt}-token prefill: native attention "
              f"{times[True]:.3f} s | torch attention {times[False]:.3f} s | "
              f"{times[False] / times[True]:.2f}x", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: a worker's)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--prompt", type=int, default=1000, help="whole-prefill prompt tokens")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    print(f"prefill attention, {args.threads} thread(s):")
    result = {"machine": machine(), "threads": args.threads, "kernels": kernels(args.reps)}
    print("whole prefill:")
    result["prefill"] = whole_prefill(args.prompt, max(3, args.reps // 2))
    print(f"wrote {write_result('attention', result)}")


if __name__ == "__main__":
    main()
