"""Sampling's cost beside a decode step: what a temperature > 0 request (the OpenAI API's default,
temperature 1) adds to each step over a greedy one. Results in bench/results/sampler-*.json.

First a check: the draw's frequencies against the probabilities of a softmax row of the
vocabulary's size (the 10 likeliest tokens within 5 standard errors), and no token the row cuts
(top-k) ever drawn. Then, on one core, for batches of sampled rows at two vocabularies
(SmolLM2's 49,152, Qwen3's 151,936): the sampler's time per step for greedy rows, for rows at
temperature 1, and for the same rows drawn by ``torch.multinomial`` (the draw's reference: one
random number per vocabulary entry), and at top-p 0.95 beside the full sort of each row that
top-p cost before; medians of ``--reps``. Then the whole thing on the engine: SmolLM2 decode
steps of ``--streams`` streams, greedy against temperature 1 and top-p 0.95, same prompts,
interleaved rounds; the ratios are what sampled traffic pays per token.

    python bench/sampler_bench.py [--reps 15] [--streams 22] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

from baton.bench.attention_bench import median_time
from baton.bench.common import machine, write_result

VOCABS = {"smollm2": 49152, "qwen3": 151936}
BATCHES = [1, 8, 22, 64]


def check() -> dict:
    """The draw samples the softmax's distribution and never a cut token."""
    import torch
    from baton.engine.params import SamplingParams
    from baton.engine.sampler import draw, make_generator, sample

    row = torch.randn(VOCABS["smollm2"], generator=torch.Generator().manual_seed(0)) * 4
    probs = row.softmax(-1)
    n, gen = 20_000, make_generator(5)
    counts = torch.bincount(torch.tensor([draw(probs, gen) for _ in range(n)]),
                            minlength=len(probs)).double()
    top = torch.topk(probs, 10).indices
    z = ((counts[top] / n - probs[top].double()) /
         (probs[top].double() * (1 - probs[top].double()) / n).sqrt()).abs()
    params = [SamplingParams(temperature=1.0, top_k=20, max_tokens=1)]
    allowed = set(torch.topk(row, 20).indices.tolist())
    cut = sum(sample(row[None], params, [gen])[0][0] not in allowed for _ in range(2000))
    ok = bool(z.max() < 5) and cut == 0
    print(f"check: top-10 frequencies within {float(z.max()):.2f} standard errors of the "
          f"probabilities; {cut} of 2000 top-k draws outside the top 20: "
          f"{'ok' if ok else 'FAILED'}")
    return {"max_z_top10": float(z.max()), "cut_drawn": cut, "ok": ok}


def multinomial(logits, gens) -> list[int]:
    """The rows drawn as the sampler drew them before (temperature 1): the draw's reference."""
    import torch

    return [int(torch.multinomial(r.softmax(-1), 1, generator=g)) for r, g in zip(logits, gens)]


def sorted_top_p(logits, top_p: float) -> None:
    """top-p as the sampler cut it before: a sort of the whole row (the cut's reference)."""
    import torch

    for row in logits:
        values, order = torch.sort(row, descending=True)
        probs = values.softmax(dim=-1)
        drop = (probs.cumsum(dim=-1) - probs) > top_p
        row.scatter(0, order, values.masked_fill(drop, float("-inf")))


def sampler_rows(reps: int) -> list[dict]:
    import torch
    from baton.engine.params import SamplingParams
    from baton.engine.sampler import make_generator, sample

    rows = []
    for name, vocab in VOCABS.items():
        for b in BATCHES:
            # a logit spread of 4: top-p 0.95 keeps ~1,600 of SmolLM2's tokens
            logits = torch.randn(b, vocab, generator=torch.Generator().manual_seed(b)) * 4
            gens = [make_generator(i) for i in range(b)]
            greedy = [SamplingParams(temperature=0.0, max_tokens=1)] * b
            hot = [SamplingParams(temperature=1.0, max_tokens=1)] * b
            g = median_time(partial(sample, logits, greedy, gens), reps)
            s = median_time(partial(sample, logits, hot, gens), reps)
            m = median_time(partial(multinomial, logits, gens), reps)
            nucleus = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=1)] * b
            t = median_time(partial(sample, logits, nucleus, gens), reps)
            cut = median_time(partial(sorted_top_p, logits, 0.95), reps)
            rows.append({"vocab": name, "vocab_size": vocab, "batch": b, "greedy_s": g,
                         "sampled_s": s, "multinomial_s": m, "draw_speedup": m / s,
                         "top_p_s": t, "sorted_top_p_cut_s": cut})
            print(f"  {name:8} batch {b:3}: greedy {g * 1e3:7.2f} ms | temperature 1 "
                  f"{s * 1e3:7.2f} ms | multinomial draw {m * 1e3:8.2f} ms "
                  f"({m / s:.1f}x) | top-p 0.95 {t * 1e3:7.2f} ms | a sorted cut alone "
                  f"{cut * 1e3:8.2f} ms", flush=True)
    return rows


def engine_steps(streams: int, dtype: str, rounds: int) -> dict:
    """SmolLM2 decode steps of ``streams`` streams, greedy and at temperature 1 in turn."""
    import torch
    from baton.engine.config import EngineConfig
    from baton.engine.engine import LLMEngine
    from baton.engine.params import SamplingParams

    engine = LLMEngine.from_path(None, EngineConfig(dtype=dtype, num_threads=1))
    vocab = min(engine.model_config.vocab_size, 30000)
    prompts = [[(i * 131 + 7 * k) % (vocab - 10) + 5 for k in range(128)]
               for i in range(streams)]

    modes = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 1.0},
             "top_p": {"temperature": 1.0, "top_p": 0.95}}

    def steps(mode: dict, n: int = 12) -> float:
        for p in prompts:
            engine.add_request(prompt_token_ids=p, params=SamplingParams(
                max_tokens=n + 4, ignore_eos=True, **mode))
        engine.step()  # the prompts: one chunked prefill
        while any(r.num_output_tokens == 0 for r in engine.requests.values()):
            engine.step()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        while engine.has_unfinished():
            engine.step()
        return statistics.median(times)

    out: dict[str, list[float]] = {name: [] for name in modes}
    steps(modes["greedy"], 3)  # warm-up
    for _ in range(rounds):
        for name, mode in modes.items():
            out[name].append(steps(mode))
    engine.close()
    med = {name: statistics.median(v) for name, v in out.items()}
    g = med["greedy"]
    print(f"  SmolLM2 {dtype} decode step of {streams} streams: greedy {g * 1e3:.1f} ms | "
          f"temperature 1 {med['sampled'] * 1e3:.1f} ms ({med['sampled'] / g:.3f}x) | "
          f"top-p 0.95 {med['top_p'] * 1e3:.1f} ms ({med['top_p'] / g:.3f}x) "
          f"(rounds {rounds}, {torch.get_num_threads()} thread)")
    return {"streams": streams, "dtype": dtype, "greedy_step_s": g,
            "sampled_step_s": med["sampled"], "top_p_step_s": med["top_p"],
            "ratio": med["sampled"] / g, "top_p_ratio": med["top_p"] / g, "rounds": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--streams", type=int, default=22)
    ap.add_argument("--rounds", type=int, default=5, help="engine rounds, each mode in turn")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    result = {"machine": machine(), "threads": 1, "check": check()}
    if not result["check"]["ok"]:
        raise SystemExit("the draw's check failed: no timing")
    print("sampler per step (one core):")
    result["sampler"] = sampler_rows(args.reps)
    print("engine:")
    result["engine"] = engine_steps(args.streams, args.dtype, args.rounds)
    print(f"wrote {write_result('sampler', result)}")


if __name__ == "__main__":
    main()
