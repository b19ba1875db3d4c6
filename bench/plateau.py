"""Which requests decide a validation's goodput: every measured run of a stored
`bench/tune_validation.py` result (one that kept each request's account: from commit 4caeed7) set
beside the simulator's account of the same requests (the same lengths, the same Poisson
arrivals, the run's profile), request by request. Near a setup's goodput the attainment curves
are flat just under the target, so a goodput is decided by a few requests; this says which.

Per run: how many requests met the SLOs in both accounts, in the measurement only, in the
simulation only, in neither; each request that missed in the measurement alone, with why (its
TTFT or TPOT past the SLO, or an error), its prompt and both accounts' times. Over all runs (or
the runs at ``--near`` times the setup's measured goodput and closer): measured over simulated
TTFT and TPOT (medians) by prompt length, and the medians of the first token's stages (the
router's wait, the worker's queue, the prefill, the rest) in each account, and the prefill
time measured over simulated for requests that started at once in both accounts and for those
the simulator queued (a burst). With ``--checked`` the simulator runs the profile scaled by
the run's serving check (`checked` in the result).
JSON in bench/results/plateau-*.json.

    python bench/plateau.py [--checked] [--near 1.3] bench/results/tune-validation-STAMP.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from baton.bench.common import machine, write_result

# prompt length bands (tokens): the lower edges
BANDS = (0, 256, 512, 1024, 2048)


def band(prompt: int) -> str:
    lo = max(b for b in BANDS if b <= prompt)
    hi = next((b for b in BANDS if b > lo), None)
    return f"{lo}-{hi - 1}" if hi else f"{lo}+"


def why_missed(row: dict, ttft_slo: float, tpot_slo: float) -> str | None:
    """None where the request met both SLOs; else what it missed first: ``error``, ``ttft``,
    ``tpot`` (both: ``ttft+tpot``)."""
    if row["error"] is not None or row["ttft"] is None:
        return "error"
    late = row["ttft"] > ttft_slo
    slow = row["tpot"] is not None and row["tpot"] > tpot_slo
    return "ttft+tpot" if late and slow else "ttft" if late else "tpot" if slow else None


def simulated_rows(ev, layout, rate: float, draw: int) -> list[dict]:
    """The simulator's account of the run at ``rate``, Poisson draw ``draw`` (the measured
    run's arrivals), one row per request in arrival order, with its worker's queue and its
    prefill as the stages it models."""
    from baton.control import workload as cw

    rows = []
    for s in ev.simulated(layout, cw.poisson(ev.reqs, rate, ev.search.seed + draw)):
        row = cw.request_row(s)
        row["stages"] = {"queue": s.queue_s, "prefill": s.prefill_s}
        rows.append(row)
    return rows


def evaluator(d: dict, checked: bool):
    """The run's evaluator (its profile, slice and search); with ``checked`` the profile scaled
    by the run's serving check before it measured."""
    from baton.bench.tune_validation import stored_evaluator
    from baton.control.calibrate import checked as scaled_by_check

    ev = stored_evaluator(d)
    if checked:
        serving = ((d.get("machine_speed") or {}).get("before") or {}).get("serving")
        if not serving:
            raise SystemExit("error: --checked: the run has no serving check (it ran without "
                             "--serving-check)")
        ev = ev.with_profile(scaled_by_check(ev.p, serving, "the run's serving check"))
    return ev


def compare(path: Path, checked: bool = False, near: float | None = None) -> dict:
    """Every kept run of the result at ``path`` beside its simulation: {setup: {runs:
    [...], bands: {...}, stages: {...}}} (see the module's doc); runs past ``near`` times the
    setup's measured goodput are listed but left out of the bands and stages."""
    from baton.bench.tune_validation import LAYOUTS

    d = json.loads(path.read_text())
    ttft_slo, tpot_slo = d["args"]["ttft_slo"], d["args"]["tpot_slo"]
    ev = evaluator(d, checked)
    out = {}
    for name, m in d.get("measured", {}).items():
        runs = [r for r in m.get("runs") or [] if r.get("per_request")]
        if not runs:
            continue
        per_run, pooled = [], []
        for run in runs:
            sim = simulated_rows(ev, LAYOUTS[name], run["rate"], run.get("draw") or 0)
            real = run["per_request"]
            if [r["prompt"] for r in real] != [r["prompt"] for r in sim]:
                raise SystemExit(f"error: {path.name} {name} at {run['rate']:.3g} req/s: the "
                                 "measured requests are not the slice's (another trace or seed)")
            counts = {"both": 0, "measured_only_missed": 0, "simulated_only_missed": 0,
                      "neither": 0}
            missed = []
            for i, (r, s) in enumerate(zip(real, sim)):
                wr, ws = why_missed(r, ttft_slo, tpot_slo), why_missed(s, ttft_slo, tpot_slo)
                key = ("both" if wr is None and ws is None else "neither" if wr and ws
                       else "measured_only_missed" if wr else "simulated_only_missed")
                counts[key] += 1
                if wr and not ws:
                    missed.append({"i": i, "why": wr, "prompt": r["prompt"],
                                   "output": r["output"], "path": r["path"],
                                   "ttft": r["ttft"], "sim_ttft": s["ttft"], "tpot": r["tpot"],
                                   "sim_tpot": s["tpot"], "stages": r["stages"],
                                   "sim_stages": s["stages"]})
            per_run.append({"rate": run["rate"], "draw": run.get("draw") or 0,
                            "attainment": run["attainment"],
                            "simulated_attainment": (counts["both"]
                                                     + counts["measured_only_missed"])
                            / len(real), **counts, "measured_only": missed})
            if near is None or run["rate"] <= near * m["goodput_rps"]:
                pooled.extend(zip(real, sim))
        out[name] = {"goodput_rps": m["goodput_rps"], "runs": per_run,
                     "bands": bands(pooled, ttft_slo, tpot_slo), "stages": stages(pooled)}
    return {"run": path.name, "checked": checked, "near": near, "setups": out}


def ratio(xs: list[tuple[float | None, float | None]]) -> float | None:
    """The median of measured / simulated over the pairs with both."""
    rs = [a / b for a, b in xs if a is not None and b]
    return statistics.median(rs) if rs else None


def bands(pooled: list[tuple[dict, dict]], ttft_slo: float, tpot_slo: float) -> dict:
    """Per prompt length band: requests, the share each account missed, and measured over
    simulated TTFT and TPOT (medians of the per-request ratios)."""
    by: dict[str, list[tuple[dict, dict]]] = {}
    for r, s in pooled:
        by.setdefault(band(r["prompt"]), []).append((r, s))
    return {b: {"requests": len(xs),
                "measured_missed": sum(why_missed(r, ttft_slo, tpot_slo) is not None
                                       for r, _ in xs) / len(xs),
                "simulated_missed": sum(why_missed(s, ttft_slo, tpot_slo) is not None
                                        for _, s in xs) / len(xs),
                "ttft_ratio": ratio([(r["ttft"], s["ttft"]) for r, s in xs]),
                "tpot_ratio": ratio([(r["tpot"], s["tpot"]) for r, s in xs])}
            for b, xs in sorted(by.items(), key=lambda kv: int(kv[0].split("-")[0].rstrip("+")))}


# a request's worker queue (s) under which it started at once, and over which the simulator
# had it wait behind other prompts (a burst), in ``prefill_ratio``
ALONE_S, QUEUED_S = 0.01, 0.3


def prefill_ratio(xs: list[tuple[dict, dict]]) -> tuple[dict, list[dict]]:
    """Measured over simulated prefill time, request by request, apart for the requests that
    started at once in both accounts ("alone": the prompt's own cost, as the machine ran it
    that day) and those the simulator queued ("queued": prompts arriving in a burst, where a
    later arrival can join the steps of the one in progress): per group the requests, the
    median of the ratios and the ratio of the sums (which the longest outliers move); and the
    five prompts furthest off, either way (prompt, queue and prefill in both accounts)."""
    groups: dict[str, list[tuple[float, float]]] = {"alone": [], "queued": []}
    off = []
    for r, s in xs:
        mq, mp = r["stages"].get("queue"), r["stages"].get("prefill")
        sq, sp = s["stages"]["queue"], s["stages"]["prefill"]
        if None in (mq, mp, sq) or not sp:
            continue
        if mq < ALONE_S and sq < ALONE_S:
            groups["alone"].append((mp, sp))
        elif sq > QUEUED_S:
            groups["queued"].append((mp, sp))
        off.append({"prompt": r["prompt"], "queue": [mq, sq], "prefill": [mp, sp],
                    "ttft": [r["ttft"], s["ttft"]]})
    return ({k: {"requests": len(v), "median": ratio(v),
                 "sum": sum(a for a, _ in v) / sum(b for _, b in v) if v else None}
             for k, v in groups.items()},
            sorted(off, key=lambda x: -abs(x["prefill"][0] - x["prefill"][1]))[:5])


def stages(pooled: list[tuple[dict, dict]]) -> dict:
    """Per path, the medians of each account's first-token stages: measured (the router's
    wait, the worker's queue, the prefill, and the rest: routing, transfer, the first decode
    step) and simulated (the worker's queue, the prefill, the rest), seconds; and the prefill
    time measured over simulated, alone and queued, and the prompts furthest off
    (:func:`prefill_ratio`)."""
    by: dict[str, list[tuple[dict, dict]]] = {}
    for r, s in pooled:
        if r["stages"] and r["ttft"] is not None and s["ttft"] is not None:
            by.setdefault(r["path"] or "", []).append((r, s))

    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    out = {}
    for path, xs in sorted(by.items()):
        groups, furthest = prefill_ratio(xs)
        rest = [r["ttft"] - sum(r["stages"].get(k) or 0 for k in ("wait", "queue", "prefill"))
                for r, _ in xs]
        sim_rest = [s["ttft"] - (s["stages"]["queue"] or 0) - (s["stages"]["prefill"] or 0)
                    for _, s in xs]
        out[path] = {"requests": len(xs),
                     "measured": {"wait": med([r["stages"].get("wait") for r, _ in xs]),
                                  "queue": med([r["stages"].get("queue") for r, _ in xs]),
                                  "prefill": med([r["stages"].get("prefill") for r, _ in xs]),
                                  "rest": med(rest), "ttft": med([r["ttft"] for r, _ in xs])},
                     "simulated": {"queue": med([s["stages"]["queue"] for _, s in xs]),
                                   "prefill": med([s["stages"]["prefill"] for _, s in xs]),
                                   "rest": med(sim_rest), "ttft": med([s["ttft"] for _, s in xs])},
                     "prefill_ratio": groups, "prefill_furthest": furthest}
    return out


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def show(res: dict) -> None:
    for name, s in res["setups"].items():
        print(f"== {name} (measured goodput {s['goodput_rps']:.3g} req/s)")
        print(f"{'rate':>7} {'draw':>4} {'meas':>5} {'sim':>5} {'both':>5} {'m-miss':>6} "
              f"{'s-miss':>6} {'neither':>7}  measured-only misses (why, prompt)")
        for r in s["runs"]:
            said = ", ".join(f"{x['why']} {x['prompt']}" for x in r["measured_only"])
            print(f"{r['rate']:>7.3g} {r['draw']:>4} {100 * r['attainment']:>4.0f}% "
                  f"{100 * r['simulated_attainment']:>4.0f}% {r['both']:>5} "
                  f"{r['measured_only_missed']:>6} {r['simulated_only_missed']:>6} "
                  f"{r['neither']:>7}  {said}")
        print(f"{'prompt':>10} {'reqs':>5} {'m-missed':>8} {'s-missed':>8} {'TTFT m/s':>8} "
              f"{'TPOT m/s':>8}")
        for b, x in s["bands"].items():
            print(f"{b:>10} {x['requests']:>5} {100 * x['measured_missed']:>7.0f}% "
                  f"{100 * x['simulated_missed']:>7.0f}% {fmt(x['ttft_ratio']):>8} "
                  f"{fmt(x['tpot_ratio']):>8}")
        for path, x in s["stages"].items():
            m, sm = x["measured"], x["simulated"]
            print(f"  {path} ({x['requests']} requests), median s: measured wait "
                  f"{fmt(m['wait'], '.3f')} queue {fmt(m['queue'], '.3f')} prefill "
                  f"{fmt(m['prefill'], '.3f')} rest {fmt(m['rest'], '.3f')} TTFT "
                  f"{fmt(m['ttft'], '.3f')}; simulated queue {fmt(sm['queue'], '.3f')} "
                  f"prefill {fmt(sm['prefill'], '.3f')} rest {fmt(sm['rest'], '.3f')} TTFT "
                  f"{fmt(sm['ttft'], '.3f')}")
            said = [f"{k} {v['requests']}: median {fmt(v['median'], '.3f')}, sum "
                    f"{fmt(v['sum'], '.3f')}" for k, v in x["prefill_ratio"].items()
                    if v["requests"]]
            if said:
                print(f"    prefill measured / simulated, request by request: {'; '.join(said)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checked", action="store_true",
                    help="simulate with the profile scaled by the run's serving check")
    ap.add_argument("--near", type=float, default=None,
                    help="pool only the runs at up to this many times the setup's measured "
                         "goodput into the bands and stages (default every run)")
    ap.add_argument("run", type=Path, help="a tune-validation-*.json with each request kept")
    a = ap.parse_args(argv)
    if a.near is not None and not a.near > 0:
        ap.error(f"--near {a.near}: a number > 0")
    res = compare(a.run, a.checked, a.near)
    if not res["setups"]:
        raise SystemExit(f"error: {a.run} kept no request's account (a run made before "
                         "commit 4caeed7 kept them, or one with --skip-measure)")
    show(res)
    print(f"wrote {write_result('plateau', {'machine': machine(), **res})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
