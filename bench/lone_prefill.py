"""Lone prompts on the bare engine against a profile's account of them: the engine pinned as a
profile pins it (one core, a busy neighbour engine on the next), each prompt of the given
lengths prefilled alone, optionally after ``--gap`` seconds idle (as a serving worker between
sparse requests), and its time set against the cost model's (``engine_prompt(n)``, and times
the profile's prefill factor, which is what the simulator charges a lone prompt with nothing
streamed). A request's prefill through a serving worker measured 1.08-1.14x the simulator's
on the validation's Mooncake slice (bench/plateau.py); this says how much of that the bare
engine already shows, back to back or after an idle gap. JSON in
bench/results/lone-prefill-*.json.

    python bench/lone_prefill.py --profile P.json [--gap 3] [--lengths 100,475,687,900,1427]
        [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from baton.bench.common import machine, other_processor, write_result


def lengths_arg(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        out = []
    if not out or any(n < 1 for n in out):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated prompt lengths >= 1")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="the profile whose account is compared")
    ap.add_argument("--gap", type=float, default=0.0,
                    help="seconds idle before each prompt (default 0: back to back)")
    ap.add_argument("--lengths", type=lengths_arg, default=[100, 475, 687, 900, 1427],
                    help="prompt lengths, comma-separated (default: the Mooncake slice's "
                         "typical ones)")
    ap.add_argument("--repeats", type=int, default=2, help="prompts of each length (median)")
    a = ap.parse_args(argv)
    if not a.gap >= 0 or a.repeats < 1:
        ap.error("--gap is seconds >= 0 and --repeats at least 1")

    from baton.bench.profile import (
        DEFAULT_MODEL,
        _engine_config,
        _neighbors,
        _prefill_step,
        _Prompts,
    )
    from baton.control.profile import CostModel, Profile
    from baton.engine.config import EngineConfig
    from baton.engine.engine import LLMEngine
    from baton.engine.params import SamplingParams

    p = Profile.load(a.profile)
    if why := other_processor(p):  # another machine's costs say nothing of this one
        raise SystemExit(f"error: --profile {a.profile} was {why}")
    cost, model = CostModel(p), None if p.model == DEFAULT_MODEL else p.model
    one = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or p.threads != 1:
        raise SystemExit("error: this compares a one-thread profile on one core beside a busy "
                         "neighbour on another: it needs two cores and a --threads 1 profile")
    os.sched_setaffinity(0, {cores[0]})
    engine = LLMEngine.from_path(model, _engine_config(EngineConfig, p.dtype, p.device,
                                                       threads=1))
    prompts = _Prompts(min(engine.model_config.vocab_size, 30000), seed=7)
    times: dict[int, list[float]] = {n: [] for n in a.lengths}
    try:
        with _neighbors(model, p.dtype, [cores[1]], print, p.device, 1):
            _prefill_step(engine, prompts, [max(a.lengths)], one)  # warm-up
            for _ in range(a.repeats):
                for n in a.lengths:
                    time.sleep(a.gap)
                    t = time.perf_counter()
                    _prefill_step(engine, prompts, [n], one)
                    times[n].append(time.perf_counter() - t)
    finally:
        engine.close()
    rows = []
    print(f"{'tokens':>6} {'measured ms':>11} {'model ms':>9} {'x factor ms':>11} "
          f"{'over model':>10} {'over charged':>12}")
    for n in a.lengths:
        med, bare = statistics.median(times[n]), cost.engine_prompt(n)
        charged = bare * p.prefill_factor
        rows.append({"tokens": n, "times_s": times[n], "median_s": med, "model_s": bare,
                     "charged_s": charged, "over_model": med / bare,
                     "over_charged": med / charged})
        print(f"{n:>6} {1000 * med:>11.1f} {1000 * bare:>9.1f} {1000 * charged:>11.1f} "
              f"{med / bare:>10.3f} {med / charged:>12.3f}")
    path = write_result("lone-prefill", {"machine": machine(), "profile": a.profile,
                                         "prefill_factor": p.prefill_factor, "gap_s": a.gap,
                                         "rows": rows})
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
