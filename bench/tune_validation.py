"""`baton tune`'s predictions against measurements, back to back on one machine: profile the
engine, predict the goodput of 1 prefill + 1 decode and of 2 colocated workers for a trace slice,
then measure both with `baton bench compare` on the same slice (same lengths, same Poisson
arrivals, same goodput search). Before and after measuring, the profile's largest prefill step
and a decode step are timed again (`machine_speed`: the machine's drift from its profile; with
`--serving-check`, the serving factors too, before measuring, and both setups predicted again
with the profile scaled by them, `checked`: what `baton profile --check --serving --out` gives
`baton tune`; beside it the same with every prompt costing x0.95 and x1.05, `prefill_band`,
reported, not judged). Then, as `baton tune --live`
would, the profile calibrated on each setup's measured requests at one rate (the highest it
served at the target attainment; control/calibrate.py) and both setups' goodput predicted
with it (`calibrated`): what the live tuner, watching one layout, predicts for the other. The
trace is an Azure CSV or a Mooncake JSONL (by its extension). Results in
bench/results/tune-validation-*.json.

    python bench/tune_validation.py [--profile FILE] [--requests 40] [--refine 3]
        [--scale 0.25] [--max-output 128] [--ttft-slo 3] [--tpot-slo 0.1] [--dtype float32]
        [--start-rate 1] [--draws 1] [--serving-check]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, replace

from baton.bench.common import (
    RESULTS,
    machine,
    other_processor,
    sigterm_as_ctrl_c,
    write_result,
)
from baton.control.sim import Layout
from baton.control.workload import draws_arg, sampling_arg

# `baton bench compare`'s two targets, as the simulator's layouts
LAYOUTS = {"baton-disaggregated": Layout(1, 1), "baton-colocated": Layout(0, 2, True)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=None, help="use this profile instead of measuring one")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--trace", default=str(RESULTS.parent.parent.parent / "shared" / "data"
                                           / "azure_llm_2023_conv.csv"))
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--trace-start", type=int, default=0)
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--ttft-slo", type=float, default=3.0)
    ap.add_argument("--tpot-slo", type=float, default=0.1)
    ap.add_argument("--sampling", type=sampling_arg, default=(),
                    help="every request samples with these filters, comma-separated "
                         "(temperature, top_k, min_p, top_p), measured and simulated alike "
                         "(default greedy)")
    ap.add_argument("--refine", type=int, default=3)
    ap.add_argument("--start-rate", type=float, default=1.0,
                    help="the goodput search's first rate, req/s (both searches)")
    ap.add_argument("--draws", type=draws_arg, default=1,
                    help="Poisson draws per rate, measured and simulated alike: a rate's "
                         "attainment over all of them (default 1)")
    ap.add_argument("--serving-check", action="store_true",
                    help="before measuring, also the serving factors against the profile's "
                         "(`baton profile --check --serving`, ~5 min)")
    ap.add_argument("--skip-measure", action="store_true", help="predictions only")
    return ap.parse_args(argv)


def load_profile(a: argparse.Namespace):
    """``a.profile``, refused (SystemExit) when its step times are not those of the setups'
    workers: another --dtype than ``a.dtype``, or another torch thread count than the one
    each `baton bench compare` worker runs, or on another processor than this machine's."""
    from baton.control.profile import Profile

    profile = Profile.load(a.profile)
    if profile.dtype != a.dtype:  # predictions for other step times than the measured
        raise SystemExit(f"error: --profile {a.profile} was measured at --dtype "
                         f"{profile.dtype}, the setups' workers run at --dtype {a.dtype}: "
                         f"pass --dtype {profile.dtype}")
    if profile.threads != 1:
        raise SystemExit(f"error: --profile {a.profile} was measured at --threads "
                         f"{profile.threads}, the setups' workers run one torch thread each "
                         "on a core of their own: `baton profile --threads 1`")
    if why := other_processor(profile):  # another machine's costs predict nothing here
        raise SystemExit(f"error: --profile {a.profile} was {why}")
    return profile


def slice_args(a: argparse.Namespace) -> list[str]:
    """The trace slice, SLOs and search, as both commands' flags."""
    return ["--trace", a.trace, "--requests", str(a.requests),
            "--trace-start", str(a.trace_start), "--scale", str(a.scale),
            "--max-input", str(a.max_input), "--max-output", str(a.max_output),
            "--ttft-slo", str(a.ttft_slo), "--tpot-slo", str(a.tpot_slo),
            "--refine", str(a.refine), "--start-rate", str(a.start_rate),
            "--draws", str(a.draws),
            *(["--sampling", ",".join(a.sampling)] if getattr(a, "sampling", ()) else [])]


def main(argv: list[str] | None = None) -> int:
    from baton.bench.compare import run_compare
    from baton.bench.profile import run_profile, serving_probe, speed_probe

    a = parse_args(argv)
    t0 = time.monotonic()

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.0f}s] {msg}", flush=True)

    if a.profile:
        profile = load_profile(a)
    else:
        profile = run_profile(None, a.dtype, [0, 1], 3, True, say)
        say(f"profile saved to {profile.save(RESULTS / 'tune-validation-profile.json')}")
    flags = slice_args(a)
    ca, ev = configs(a, profile, flags)
    predicted = {}
    for name, layout in LAYOUTS.items():
        goodput, points = ev.goodput(layout)
        predicted[name] = {"layout": layout.name, "goodput_rps": goodput, "points": points}
        say(f"predicted {layout.name}: goodput {goodput:.3g} req/s")
        if a.sampling and profile.sampling:  # as a profile without the sampler's costs would
            plain = ev.with_profile(replace(profile, sampling={})).goodput(layout)[0]
            predicted[name]["goodput_rps_greedy_cost"] = plain
            say(f"  ({plain:.3g} req/s with the sampled tokens at greedy's cost)")
    measured, speed, checked = {}, {}, {}
    if not a.skip_measure:
        with sigterm_as_ctrl_c():  # the running step's own cleanup stops its processes
            try:
                # the machine's speed against the profile's, before and after: a drift is the
                # machine's, not the simulator's error
                speed["before"] = speed_probe(profile, [0, 1], say=say)
                if a.serving_check:  # the serving overheads too: they move while the engine's hold
                    speed["before"]["serving"] = serving_probe(profile, [0, 1], say=say)
                    checked = predict_checked(ev, profile, speed["before"]["serving"], say)
                say("measuring both setups with `baton bench compare` ...")
                for res in run_compare(ca) or []:
                    measured[res["target"]] = {"goodput_rps": res["goodput_rps"],
                                               "points": res["points"], "runs": res["runs"]}
                    say(f"measured {res['target']}: goodput {res['goodput_rps']:.3g} req/s")
                speed["after"] = speed_probe(profile, [0, 1], say=say)
            except KeyboardInterrupt:
                say("stopped while measuring: nothing written")
                return 130
    # attainment at every rate the real search ran, measured against simulated: better
    # conditioned than the goodput (one request more or less can move a goodput a lot)
    for name, m in measured.items():
        m["simulated_at_measured_rates"] = [
            (rate, att, ev.at(LAYOUTS[name], rate)) for rate, att in m["points"]]
    calibrated = {name: calibrated_predictions(ev, LAYOUTS, name, m["runs"], say)
                  for name, m in measured.items()}
    for m in measured.values():  # each run's requests, not its summary (bench/plateau.py)
        m["runs"] = [{k: r.get(k) for k in ("rate", "draw", "attainment", "per_request")}
                     for r in m["runs"] if r.get("per_request")]
    result = {**report(a, profile, flags, predicted, measured, checked),
              "machine_speed": speed, "checked": checked, "calibrated": calibrated}
    if calibrated:
        print_calibrated(calibrated, measured)
    print(f"wrote {write_result('tune-validation', result)}")
    return 0


# every prompt's cost times these around the checked profile: five points of prefill speed,
# what a 2-vCPU VM's speed checks moved within one run (docs/routing.md, the sensitivity table)
BAND = (0.95, 1.05)


def predict_checked(ev, profile, serving: dict, say) -> dict:
    """Both setups' goodput with the profile scaled by the serving check taken just before
    measuring (:func:`baton.control.calibrate.checked`): what `baton tune` predicts after
    `baton profile --check PROFILE --serving --out NEW`, from nothing measured on the trace.
    Each also with every prompt costing :data:`BAND` times as much (``prefill_band``: {scale:
    goodput}): how far five points of the machine's prefill speed move it, reported beside the
    checked prediction, not judged."""
    from baton.control.calibrate import checked, scaled

    at = checked(profile, serving, "the serving check before measuring")
    out = predict_each(ev.with_profile(at), LAYOUTS, say,
                       "with the profile scaled by the serving check")
    for s in BAND:
        for name, band in predict_each(ev.with_profile(scaled(at, 1.0, s, "remote")), LAYOUTS,
                                       say, f"with that and every prompt costing x{s:g}").items():
            out[name].setdefault("prefill_band", {})[f"{s:g}"] = band["goodput_rps"]
    return out


def predict_each(ev, layouts: dict, say, how: str) -> dict:
    """Every setup's simulated goodput on ``ev`` ({name: {layout, goodput_rps, points}}),
    each said as predicted ``how``."""
    out = {}
    for name, layout in layouts.items():
        goodput, points = ev.goodput(layout)
        out[name] = {"layout": layout.name, "goodput_rps": goodput, "points": points}
        say(f"  predicted {layout.name} {how}: goodput {goodput:.3g} req/s")
    return out


def calibration_run(runs: list[dict], attainment: float) -> dict | None:
    """The run a live tuner would have watched: the highest rate the setup served at
    ``attainment`` or better (near its goodput, as a busy cluster), else its lowest rate."""
    rated = [r for r in runs if r.get("rate") and r.get("observed")]
    ok = [r for r in rated if (r.get("attainment") or 0) >= attainment]
    if ok:
        return max(ok, key=lambda r: r["rate"])
    return min(rated, key=lambda r: r["rate"], default=None)


def calibrated_predictions(ev, layouts: dict, name: str, runs: list[dict], say) -> dict:
    """`baton tune --live`'s view: the profile calibrated on ``name``'s measured requests at
    one rate (:func:`calibration_run`), then every layout's goodput predicted with it."""
    from baton.control import workload as cw
    from baton.control.calibrate import Observed, calibrate
    from baton.control.tune import shape

    run = calibration_run(runs, ev.search.attainment)
    if run is None:
        return {"error": "no measured run with per-request observations"}
    reqs = cw.poisson(ev.reqs, run["rate"], ev.search.seed + run.get("draw", 0))
    observed = [None if o is None else Observed(o[0], o[1], o[2]) for o in run["observed"]]
    cal = calibrate(ev.p, layouts[name], shape(reqs, ev.keys), observed, ev.knobs)
    say(f"calibrated on {name} at {run['rate']:.3g} req/s: {cal.line()}")
    return {"rate": run["rate"], "attainment": run["attainment"], **cal.summary(),
            "predicted": predict_each(ev.with_profile(cal.profile), layouts, say, "with it")}


def print_calibrated(calibrated: dict, measured: dict) -> None:
    print("\ncalibrated on           setup                  predicted  measured   error")
    for name, c in calibrated.items():
        for other, p in c.get("predicted", {}).items():
            m = measured.get(other, {}).get("goodput_rps")
            p["error"] = (p["goodput_rps"] - m) / m if m else None
            e = "-" if p["error"] is None else f"{100 * p['error']:+.0f}%"
            print(f"{name + ' @' + format(c['rate'], '.3g'):<23} {other:<22} "
                  f"{p['goodput_rps']:>9.3g} {'-' if m is None else format(m, '.3g'):>9} "
                  f"{e:>7}")


def stored_evaluator(d: dict, profile: dict | None = None):
    """The evaluator `baton tune` builds for a stored run's (``d``, its JSON) slice and search,
    on its own profile or on ``profile`` (a profile's JSON) in its place."""
    from baton.control.profile import Profile

    a = argparse.Namespace(**d["args"])
    return configs(a, Profile(**(profile or d["profile"])), slice_args(a))[1]


def configs(a, profile, slice_args: list[str]):
    """The same slice and search through both commands' own parsers (same defaults elsewhere):
    `baton bench compare`'s config (the goodput searches only, not the extra run at colocated's
    goodput) and `baton tune`'s evaluator."""
    from baton.bench.cli import CompareConfig, add_bench_args
    from baton.control.tune import Evaluator, TuneConfig, add_tune_args, load_trace

    kind = "mooncake" if a.trace.endswith((".jsonl", ".json")) else "azure"
    ap_bench = argparse.ArgumentParser()
    add_bench_args(ap_bench)
    ca = replace(CompareConfig.from_args(ap_bench.parse_args(
        ["compare", "--dtype", a.dtype, "--quiet", "--no-plots", "--workload", kind,
         "--goodput", *slice_args])), rerun=False)
    ap_tune = argparse.ArgumentParser()
    add_tune_args(ap_tune)
    tc = TuneConfig.from_args(ap_tune.parse_args(["--format", kind, *slice_args]))
    return ca, Evaluator(profile, load_trace(tc.slice), tc.search, tc.knobs)


def report(a, profile, slice_args, predicted: dict, measured: dict,
           checked: dict | None = None) -> dict:
    """Predicted against measured goodput per setup, and the winners; printed, and returned.
    ``checked``: the predictions with the profile scaled by the serving check
    (:func:`predict_checked`; a column of their own)."""
    from baton.control.profile import CostModel

    checked = checked or {}
    rows = []
    for name, pred in predicted.items():
        m = measured.get(name, {}).get("goodput_rps")
        err = (pred["goodput_rps"] - m) / m if m else None
        rows.append({"setup": name, "layout": pred["layout"], "predicted_rps": pred["goodput_rps"],
                     "measured_rps": m, "error": err,
                     "within_20pct": None if err is None else abs(err) <= 0.2})
        if name in checked:
            c = checked[name]["goodput_rps"]
            rows[-1].update(checked_rps=c, checked_error=(c - m) / m if m else None)
            if band := checked[name].get("prefill_band"):
                lo, hi = min(band.values()), max(band.values())
                rows[-1].update(checked_band_rps=[lo, hi],
                                measured_in_band=None if m is None else lo <= m <= hi)
    winner = {k: max(rows, key=lambda r: r[k] or 0)["setup"] if all(r[k] is not None
                                                                      for r in rows) else None
              for k in ("predicted_rps", "measured_rps")}
    print(f"\n{'setup':<22} {'predicted':>10} {'measured':>10} {'error':>7}"
          + (f" {'checked':>8} {'error':>7}" if checked else ""))
    for r in rows:
        m = "-" if r["measured_rps"] is None else f"{r['measured_rps']:.3g}"
        e = "-" if r["error"] is None else f"{100 * r['error']:+.0f}%"
        c = ""
        if "checked_rps" in r:
            ce = r["checked_error"]
            c = f" {r['checked_rps']:>8.3g} {'-' if ce is None else f'{100 * ce:+.0f}%':>7}"
        print(f"{r['setup']:<22} {r['predicted_rps']:>10.3g} {m:>10} {e:>7}{c}")
    if checked:
        print("checked: predicted with the profile scaled by the serving check before "
              "measuring (`baton profile --check PROFILE --serving --out NEW`)")
    for r in rows:
        if "checked_band_rps" in r:
            lo, hi = r["checked_band_rps"]
            where = {None: "", True: ", measured inside",
                     False: ", measured outside"}[r["measured_in_band"]]
            print(f"  {r['setup']}: {lo:.3g}-{hi:.3g} req/s with every prompt costing "
                  f"x{BAND[1]:g} / x{BAND[0]:g} of the checked (reported, not judged){where}")
    print(f"winner: predicted {winner['predicted_rps']}, measured {winner['measured_rps']}")
    for name, m in measured.items():
        pairs = m["simulated_at_measured_rates"]
        print(f"{name}: attainment measured/simulated at " + ", ".join(
            f"{r:.3g}/s {100 * x:.0f}/{100 * y:.0f}%" for r, x, y in sorted(pairs)))
    return {"machine": machine(), "args": vars(a), "slice": slice_args,
            "cost_model": CostModel(profile).summary(), "profile": asdict(profile), "rows": rows,
            "predicted": predicted, "measured": measured,
            "predicted_winner": winner["predicted_rps"],
            "measured_winner": winner["measured_rps"],
            "winner_agrees": (winner["predicted_rps"] == winner["measured_rps"]
                              if winner["measured_rps"] else None)}


if __name__ == "__main__":
    sys.exit(main())
