"""A prefill worker's engine steps beside the cost model `baton tune` simulates them with: a lone
prompt's chunks, and the step where a prompt arriving later joins the last chunk of a long
prompt in progress (the scheduler fills the step's token budget with it). In a burst of
prompts that join happens all the time, and a prompt's prefill then runs as long as its
steps: whether the model costs such a step as the engine runs it decides whether the
simulator's bursts keep time. The engine runs on one core with one torch thread, as the
profile measured it (the neighbour the profile ran beside is not started here: the
measured over modelled ratios carry this machine's speed against the profile, compare them
with the lone prompts'). JSON in bench/results/joined-steps-*.json.

    python bench/joined_steps.py --profile bench/results/tune-validation-profile-v11-STAMP.json \\
        [--rounds 7] [--core 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from baton.bench.common import machine, write_result

# name: (prompts, each (step it arrives before, length)), and the steps the scheduler runs
# them in, each step's chunks (tokens, computed before): budget 1024
CASES = {
    "lone 1024": ([(0, 1024)], [[(1024, 0)]]),
    "lone 743": ([(0, 743)], [[(743, 0)]]),
    "512 + 512 in one step": ([(0, 512), (0, 512)], [[(512, 0), (512, 0)]]),
    "lone 1145": ([(0, 1145)], [[(1024, 0)], [(121, 1024)]]),
    "1145, then 743 joins its 2nd step": ([(0, 1145), (1, 743)],
                                           [[(1024, 0)], [(121, 1024), (743, 0)]]),
    "lone 1762": ([(0, 1762)], [[(1024, 0)], [(738, 1024)]]),
    "1762, then 526 joins its 2nd step": ([(0, 1762), (1, 526)],
                                           [[(1024, 0)], [(738, 1024), (286, 0)], [(240, 286)]]),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="the profile whose cost model to compare")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds, median (default 7)")
    ap.add_argument("--core", type=int, default=1, help="the core the engine runs on")
    a = ap.parse_args()
    os.sched_setaffinity(0, {a.core})
    from baton.bench.profile import _engine_config, _Prompts
    from baton.control.profile import CostModel, Profile, _pairs
    from baton.engine.config import EngineConfig
    from baton.engine.engine import LLMEngine
    from baton.engine.params import SamplingParams

    p = Profile.load(a.profile)
    if p.device != "cpu" or p.max_num_batched_tokens != 1024:
        raise SystemExit(f"error: {a.profile}: the cases are for a CPU profile with a "
                         f"1024-token step budget (it has {p.device}, "
                         f"{p.max_num_batched_tokens})")
    cost = CostModel(p)
    engine = LLMEngine.from_path(None if p.model.startswith("default") else p.model,
                                 _engine_config(EngineConfig, p.dtype, "cpu", threads=p.threads))
    prompts = _Prompts(min(engine.model_config.vocab_size, 30000), seed=1)
    one = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)

    def steps(plan) -> list[float]:
        times, pending, i = [], list(plan), 0
        while True:
            while pending and pending[0][0] == i:
                engine.add_request(prompt_token_ids=prompts(pending.pop(0)[1]), params=one)
            if not engine.has_unfinished():
                return times
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
            i += 1

    for plan, _ in CASES.values():  # warm-up, untimed
        steps(plan)
    samples: dict[str, list[list[float]]] = {k: [] for k in CASES}
    for _ in range(a.rounds):  # in turn, so a slow moment lands on every case alike
        for name, (plan, _) in CASES.items():
            samples[name].append(steps(plan))
    rows = []
    print(f"{'case':<36} {'measured s (per step)':<28} {'model s':<28} {'ratio':>6}")
    for name, (_, chunks) in CASES.items():
        measured = [statistics.median(s) for s in zip(*samples[name], strict=True)]
        model = [cost.engine_step(sum(k for k, _ in ch), sum(_pairs(k, d) for k, d in ch), [])
                 for ch in chunks]
        if len(measured) != len(model):
            raise SystemExit(f"error: {name}: the engine ran {len(measured)} steps, the cases "
                             f"say {len(model)} (another scheduler?)")
        rows.append({"case": name, "measured_s": measured, "model_s": model,
                     "ratio": sum(measured) / sum(model)})
        print(f"{name:<36} {' + '.join(f'{x:.3f}' for x in measured):<28} "
              f"{' + '.join(f'{x:.3f}' for x in model):<28} {rows[-1]['ratio']:6.3f}")
    out = {"machine": machine(), "profile": a.profile, "rounds": a.rounds, "core": a.core,
           "rows": rows}
    print(f"wrote {write_result('joined-steps', out)}")


if __name__ == "__main__":
    main()
