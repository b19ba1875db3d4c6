"""One layout of `python bench/tune_validation.py`'s, measured at chosen rates on one cluster
(started once, the rates in the order given) beside the simulator on the same requests and
arrival times, request by request: attainment, which SLO failed, TTFT and TPOT percentiles,
the router's TTFT phases (remote path), the path each request took and the prompt tokens its
worker reused from its prefix cache, measured and simulated.
Where the validation's goodputs disagree, this says at which rate, in which phase, and whether a
fresh cluster agrees (run the rates alone, then after a higher one). ``--alone`` first sends
prompts of the given lengths one at a time (three rounds, no queue and no batching): the
prefill phase against the profile's prompt time, with nothing else running. Results in
bench/results/sim-check-*.json.

    python bench/sim_check.py --profile bench/results/tune-validation-profile.json \\
        --layout disaggregated --rates 4.5,8,4.5 [--alone 150,600,2000] [--draws 2]
        [--scorers prefix=3,inflight=1,queue=1,kv=0.5,prefill=0] [the slice flags]

``--scorers`` runs the router and the simulator with other scorer weights than the router's
defaults (e.g. without the ``prefill`` scorer: the routing before 2026-12-06), so two runs of
this script compare the routings on the same machine.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

from baton.bench.common import machine, pct, write_result


def compare(rows: list[dict], ttft_slo: float, tpot_slo: float) -> dict:
    """Measured against simulated over ``rows`` ({ttft, tpot, path, stages, cached, sim_ttft,
    sim_tpot, sim_path, sim_cached} per request)."""
    def fails(t, p) -> tuple[bool, bool]:
        return t is None or t > ttft_slo, p is not None and p > tpot_slo

    out: dict = {}
    for side, (t, p, path, c) in {
            "measured": ("ttft", "tpot", "path", "cached"),
            "simulated": ("sim_ttft", "sim_tpot", "sim_path", "sim_cached")}.items():
        f = [fails(r[t], r[p]) for r in rows]
        out[side] = {
            "attainment": sum(not (a or b) for a, b in f) / len(rows),
            "ttft_failed": sum(a for a, _ in f), "tpot_failed": sum(b for _, b in f),
            "ttft_p50_p90": [pct([r[t] for r in rows if r[t] is not None], q) for q in (.5, .9)],
            "tpot_p50_p90": [pct([r[p] for r in rows if r[p] is not None], q) for q in (.5, .9)],
            "paths": {k: sum(r[path] == k for r in rows) for k in ("local", "remote")},
            # prompt tokens reused from a prefix cache, of all prompt tokens; requests with a hit
            "cached_share": sum(r[c] or 0 for r in rows) / max(sum(r["prompt"] for r in rows), 1),
            "requests_with_hits": sum(bool(r[c]) for r in rows)}
    remote = [r["stages"] for r in rows if r["path"] == "remote" and r["stages"]]
    if remote:
        out["measured"]["remote_ttft_phases_mean_s"] = {
            k: statistics.fmean(s.get(k, 0.0) for s in remote) for k in sorted(remote[0])}
    return out


def one_at_a_time(target, lengths: list[int], cost, vocab: tuple[int, int],
                  rounds: int = 3) -> list[dict]:
    """Prompts of ``lengths`` tokens (2 output tokens), one at a time, ``rounds`` times: the
    router's prefill phase (remote: the Prefill call less the worker's queue; local: the first
    token less the queue) beside the profile's time for the prompt alone
    (CostModel.engine_prompt x prefill_factor)."""
    import random

    from baton.control.workload import Req, Tokens

    tokens, rng, rows = Tokens(*vocab, "sim-check/alone"), random.Random(len(lengths)), []
    for _ in range(rounds):
        for n in lengths:
            rec = target(Req(tokens.random(rng, n), 2))
            s = rec.stages or {}
            rows.append({"prompt": n, "path": rec.path, "error": rec.error,
                         "prefill": s.get("prefill"), "queue": s.get("queue"),
                         "model": cost.engine_prompt(n) * cost.prefill_factor})
    for n in lengths:
        got = [r for r in rows if r["prompt"] == n and r["prefill"] is not None]
        if got:
            m = statistics.median(r["prefill"] for r in got)
            print(f"alone, {n} prompt tokens ({got[0]['path']}): prefill {m:.3f} s, profile "
                  f"{got[0]['model']:.3f} s ({m / got[0]['model']:.2f}x)", flush=True)
    return rows


def main() -> None:
    import argparse

    from baton.bench import loadgen as lg
    from baton.bench import tune_validation as tv
    from baton.bench.cli import workload
    from baton.bench.compare import _open_target
    from baton.control import workload as cw
    from baton.control.sim import Layout, simulate
    from baton.control.tune import shape

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", default="disaggregated", choices=["disaggregated", "colocated"])
    ap.add_argument("--rates", default="4.5,8,4.5", help="comma-separated req/s, in order")
    ap.add_argument("--alone", default="", help="comma-separated prompt lengths to send one "
                    "at a time before the rates (three rounds)")
    ap.add_argument("--scorers", default=None, help="the router's and the simulator's scorer "
                    "weights, as `baton router --scorers` (default: the router's own)")
    extra, rest = ap.parse_known_args()
    a = tv.parse_args(rest)
    if not a.profile:
        ap.error("--profile is required (a `baton profile` file)")
    profile = tv.load_profile(a)
    ca, ev = tv.configs(a, profile, tv.slice_args(a))
    if extra.scorers:
        from baton.services.router.routing import parse_weights

        try:
            weights = parse_weights(extra.scorers)
        except ValueError as e:
            ap.error(f"--scorers: {e}")
        ca = replace(ca, router_args=f"{ca.router_args} --scorers {extra.scorers}".strip())
        ev.knobs = replace(ev.knobs, weights=tuple(weights.items()))
    layout = Layout(1, 1) if extra.layout == "disaggregated" else Layout(0, 2, True)
    runs: list[dict] = []
    target, close = _open_target(ca, ("baton", extra.layout))
    try:
        lg.warm_up(target, ca.workload.vocab)
        alone = one_at_a_time(target, [int(n) for n in extra.alone.split(",") if n], ev.cost,
                              ca.workload.vocab)
        # every rate at each of the validation's Poisson draws (``--draws``: seed + k)
        for rate, k in ((float(x), k) for x in extra.rates.split(",") for k in range(a.draws)):
            salt = f"sim-check/{len(runs)}/{time.time_ns()}"
            recs, _ = lg.run(target, lg.poisson(workload(ca.workload, salt), rate,
                                                ca.workload.seed + k), 0)
            arrivals = shape(cw.poisson(ev.reqs, rate, ev.search.seed + k), ev.keys)
            sim = simulate(layout, ev.p, arrivals, ev.knobs, ev.cost, ev.profiles)
            # sampled requests: also as a profile without the sampler's costs would have them
            greedy = (simulate(layout, replace(ev.p, sampling={}), arrivals, ev.knobs, None,
                               ev.profiles) if a.sampling and ev.p.sampling else sim)
            rows = [{"prompt": r.prompt_tokens, "ttft": r.ttft, "tpot": r.tpot, "path": r.path,
                     "stages": r.stages, "error": r.error, "cached": r.cached_tokens,
                     "sim_ttft": s.ttft, "sim_tpot": s.tpot, "sim_path": s.path,
                     "sim_cached": s.cached_tokens, "sim_prefill": s.prefill_s,
                     "sim_queue": s.queue_s, "sim_tpot_greedy_cost": g.tpot}
                    for r, s, g in zip(recs, sim, greedy)]
            runs.append({"rate": rate, "draw": k, **compare(rows, a.ttft_slo, a.tpot_slo),
                         "requests": rows})
            m, s = runs[-1]["measured"], runs[-1]["simulated"]
            if greedy is not sim:
                runs[-1]["simulated_greedy_cost"] = compare(
                    [{**r, "sim_tpot": r["sim_tpot_greedy_cost"]} for r in rows],
                    a.ttft_slo, a.tpot_slo)["simulated"]
                print(f"{rate:g} req/s, sampled with {','.join(a.sampling)}: TPOT p50 measured "
                      f"{m['tpot_p50_p90'][0] * 1000:.1f} ms, simulated "
                      f"{s['tpot_p50_p90'][0] * 1000:.1f} ms, at greedy's cost "
                      f"{runs[-1]['simulated_greedy_cost']['tpot_p50_p90'][0] * 1000:.1f} ms",
                      flush=True)
            print(f"{rate:g} req/s, draw {k + 1}: attainment measured "
                  f"{100 * m['attainment']:.0f}% simulated {100 * s['attainment']:.0f}%; "
                  f"TTFT failed {m['ttft_failed']}/"
                  f"{s['ttft_failed']}, TPOT failed {m['tpot_failed']}/{s['tpot_failed']}, "
                  f"prompt tokens cached {100 * m['cached_share']:.0f}%/"
                  f"{100 * s['cached_share']:.0f}%",
                  flush=True)
    finally:
        close()
    result = {"machine": machine(), "layout": extra.layout, "args": vars(a), "runs": runs,
              "alone": alone, "scorers": extra.scorers or "the router's defaults"}
    print(f"wrote {write_result('sim-check', result)}")


if __name__ == "__main__":
    main()
