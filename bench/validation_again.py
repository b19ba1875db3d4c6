"""Stored `bench/tune_validation.py` runs predicted again by the current simulator and
calibration rules: each run's profile, slice and calibrated fits (decode and prefill ratios,
and the path the prefill ratio was fitted on) as stored, both setups' goodput simulated again
and set against the goodput the run measured. Nothing is measured: this is how a change to the
simulator or to what a fit scales is checked against every run already made. JSON in
bench/results/validation-again-*.json.

With ``--speed``, the fits are the run's speed checks taken before it measured instead (its
``machine_speed.before``: the bare engine's prefill and decode step ratios, and with
``--serving-check`` the serving factors' too), each scaling the profile as a fit on the
remote path does: would a profile scaled to the machine's speed at the start of the
measurement have predicted better than the profile as measured?

With ``--as-measured``, the one fit is the profile as the run measured it (nothing scaled): with
``--stream-slope`` it is how a change to the cost model alone would have predicted. With
``--stream-slope S[,S...]`` each decode step's factor rises by S for every stream the step
decodes past ``--above`` (default 14, the cost model's), times the share of the time the other
workers ran steps meanwhile (beside an idle worker it does not rise), one set of rows per S:
the served factor `bench/served_beside.py` read rising with the streams beside a busy or
decoding worker (on the 2-vCPU Xeon VM 1.06-1.09 at 12-16 streams, 1.28 at 64), in place of
the rise the profile measured (a version-9 profile's ``serving_stream_slope``; none before).
With ``--local-prefill S[,S...]`` the local path's prompts (a colocated worker's, a decode
worker's) cost S times the remote path's (the cost model's ``local_prefill_scale``, 1 in a
profile as measured; a calibration on a colocated window sets it). With ``--step-noise S[,S...]``
each simulated step's time is drawn about the cost model's (lognormal, mean 1, S the sd of its
log; :meth:`baton.control.sim.Sim.noise`): how much of the simulator's optimism near a pool's
capacity a spread of step times the model leaves out would take away. With ``--prefill-scale
S[,S...]`` every prompt costs S times what the fit left (the prefill factors of both paths, as
a remote fit scales them): a request's prefill through a serving worker measured 1.08-1.14x
the simulator's, lone or queued, where the profile's prefill factor is a saturated worker's
throughput (bench/plateau.py, 2026-12-06); would the record have been predicted within 10%
with prompts that much dearer? With ``--as-measured
--profile P.json`` each run is predicted with another profile in place of its own: how far a
second profile of the same machine moves the predictions.

    python bench/validation_again.py [--speed | --as-measured [--profile P.json]]
        [--stream-slope 0,0.004] [--local-prefill 1,1.1] [--step-noise 0,0.2]
        [--prefill-scale 1,1.1]
        bench/results/tune-validation-*.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from baton.bench.common import machine, write_result
from baton.control.profile import STREAM_SLOPE_ABOVE, CostModel


def sloped(p, slope: float, above: int) -> CostModel:
    """The cost model of ``p`` with each decode step's factor ``slope`` higher for every stream
    the step decodes past ``above``, times the share of the time the other workers were busy
    (the rise is the neighbours' contention: none beside an idle worker), whatever rise the
    profile measured."""
    cost = CostModel(p)
    cost.stream_slope, cost.stream_above = slope, above
    cost.decode_factors_differ = True
    return cost


def calibrated_fits(d: dict) -> list[tuple[str, dict, dict]]:
    """The run's calibrated fits that applied something, as (label, fit, its predictions then);
    one that applied nothing is left out (its predictions are the uncalibrated ones)."""
    return [(watched, fit, fit["predicted"]) for watched, fit in d.get("calibrated", {}).items()
            if fit.get("applied")]


def speed_fits(d: dict) -> list[tuple[str, dict, dict]]:
    """The run's speed checks taken before it measured (``engine``: the bare engine's steps;
    ``serving``: the serving factors, when the run measured them) as fits on the remote path,
    with the run's own predictions (the profile as measured) as then; none without a check."""
    before = (d.get("machine_speed") or {}).get("before") or {}
    serving = before.get("serving") or {}
    out = [(f"{check} check", {"decode_ratio": c["decode_ratio"],
                               "prefill_ratio": c["prefill_ratio"], "prefill_path": "remote",
                               "prefill_stream_ratio": c.get("prefill_stream_ratio"),
                               "decode_ratio_decoding": c.get("decode_ratio_decoding")},
            d["predicted"])
           for check, c in (("engine", before), ("serving", serving))
           if c.get("decode_ratio") and c.get("prefill_ratio")]
    if ((serving.get("prefill_ratio_idle") or serving.get("decode_ratio_decoding"))
            and serving.get("decode_ratio") and serving.get("prefill_ratio")):
        # the same check as one ratio each (the decode grid with the prefill worker busy, the
        # lone prompts with nothing streamed: as before it timed the rise and the decoding
        # worker), beside the one that scales those on their own
        out.append(("serving check, one ratio each",
                    {"decode_ratio": serving["decode_ratio"],
                     "prefill_ratio": serving.get("prefill_ratio_idle") or serving["prefill_ratio"],
                     "prefill_path": "remote"}, d["predicted"]))
    return out


def as_measured(d: dict) -> list[tuple[str, dict, dict]]:
    """The profile as the run measured it (nothing scaled), with the run's own predictions;
    none for a run that measured nothing (``--skip-measure``)."""
    if not d.get("measured") or not d.get("predicted"):
        return []
    return [("as measured", {"decode_ratio": 1.0, "prefill_ratio": 1.0,
                             "prefill_path": "remote"}, d["predicted"])]


def again(path: Path, fits=calibrated_fits, stream_slope: float | None = None,
          above: int = STREAM_SLOPE_ABOVE, local_prefill: float | None = None,
          profile: dict | None = None, step_noise: float = 0.0,
          prefill_scale: float = 1.0) -> list[dict]:
    """One row per (fit, setup) of the run at ``path``: the profile scaled by the fit, both
    setups' goodput simulated again, against the fit's predictions then and the goodput the run
    measured. ``fits`` picks the fits from the run (:func:`calibrated_fits`,
    :func:`speed_fits`, :func:`as_measured`); ``stream_slope`` and ``above``: the cost model
    :func:`sloped` (None: the cost model as it is, the profile's own rise, none before
    version 9); ``local_prefill``: the local path's prompts cost this many times the remote
    path's, after the fit (None: as the fit left it); ``profile``: another profile's JSON in
    place of the run's own (with :func:`as_measured`: what that profile would have predicted
    for the run); ``prefill_scale``: the fit's prefill ratio times this (both paths' prompts,
    as a remote fit scales them)."""
    from baton.bench.tune_validation import LAYOUTS, stored_evaluator
    from baton.control.calibrate import scaled

    d = json.loads(path.read_text())
    chosen = fits(d)
    if not chosen:
        return []
    ev = stored_evaluator(d, profile)
    rows = []
    for label, fit, predicted in chosen:
        cev = ev.with_profile(scaled(ev.p, fit["decode_ratio"], fit["prefill_ratio"],
                                     fit["prefill_path"], fit.get("prefill_stream_ratio"),
                                     fit.get("decode_ratio_decoding")))
        if prefill_scale != 1.0:  # after the fit, on both paths
            cev = cev.with_profile(scaled(cev.p, 1.0, prefill_scale, "remote"))
        if stream_slope is not None:
            cev.cost = sloped(cev.p, stream_slope, above)
        if local_prefill is not None:
            cev.cost.local_prefill_scale = local_prefill
        cev.cost.step_noise = step_noise
        for name, layout in LAYOUTS.items():
            measured = d["measured"][name]["goodput_rps"]
            then = predicted[name]["goodput_rps"]
            now = cev.goodput(layout)[0]
            rows.append({"run": path.name, "calibrated_on": label,
                         "prefill_path": fit["prefill_path"],
                         "decode_ratio": fit["decode_ratio"],
                         "prefill_ratio": fit["prefill_ratio"],
                         "prefill_stream_ratio": fit.get("prefill_stream_ratio"),
                         "decode_ratio_decoding": fit.get("decode_ratio_decoding"), "setup": name,
                         "stream_slope": cev.cost.stream_slope,
                         "local_prefill_scale": cev.cost.local_prefill_scale,
                         "step_noise": step_noise, "prefill_scale": prefill_scale,
                         "above": cev.cost.stream_above,
                         "measured_rps": measured, "predicted_then_rps": then,
                         "predicted_now_rps": now, "error_then": then / measured - 1,
                         "error_now": now / measured - 1})
    return rows


def numbers(ap: argparse.ArgumentParser, flag: str, text: str | None, default: float,
            ok, what: str) -> list[float]:
    """``text`` (comma-separated numbers; None: ``[default]``) as floats, each passing ``ok``
    (NaN passes no comparison); else the parser's error naming ``flag`` and ``what``."""
    if text is None:
        return [default]
    try:
        out = [float(x) for x in text.split(",")]
    except ValueError:
        out = [float("nan")]
    if not all(ok(x) for x in out):
        ap.error(f"{flag} {text}: {what}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="tune-validation-*.json files")
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--speed", action="store_true",
                     help="scale each run's profile by its speed checks before measuring, "
                          "not by its calibrated fits")
    how.add_argument("--as-measured", action="store_true",
                     help="each run's profile as measured, nothing scaled")
    ap.add_argument("--stream-slope", metavar="S[,S...]",
                    help="a decode step's factor rises by S a stream past --above, beside "
                         "busy workers (one set of rows per S), in place of the rise the "
                         "profile measured (default: the cost model as it is, the profile's "
                         "own rise, none before version 9)")
    ap.add_argument("--above", type=int, default=STREAM_SLOPE_ABOVE, metavar="STREAMS",
                    help="streams a decode step runs before --stream-slope applies (default "
                         "%(default)s, the cost model's)")
    ap.add_argument("--local-prefill", metavar="S[,S...]",
                    help="the local path's prompts (a colocated worker's, a decode worker's) "
                         "cost S times the remote path's, after the fit (one set of rows per "
                         "S; default: as the fit left it, 1 for a profile as measured)")
    ap.add_argument("--step-noise", metavar="S[,S...]",
                    help="each simulated step's time drawn about the cost model's, lognormal "
                         "with mean 1 and S the sd of its log (one set of rows per S; default "
                         "0: every step as the cost model says)")
    ap.add_argument("--prefill-scale", metavar="S[,S...]",
                    help="every prompt costs S times what the fit left, both paths (one set "
                         "of rows per S; default 1)")
    ap.add_argument("--profile", type=Path, metavar="P.json",
                    help="with --as-measured: predict each run with this profile in place of "
                         "its own (how far another profile of the same machine moves the "
                         "predictions)")
    a = ap.parse_args()
    if a.profile and not a.as_measured:
        ap.error("--profile needs --as-measured (a run's calibrated fits and speed checks are "
                 "ratios to its own profile)")
    other = json.loads(a.profile.read_text()) if a.profile else None
    fits = speed_fits if a.speed else as_measured if a.as_measured else calibrated_fits
    slopes = [float(x) for x in a.stream_slope.split(",")] if a.stream_slope else [None]
    locals_ = [float(x) for x in a.local_prefill.split(",")] if a.local_prefill else [None]
    noises = numbers(ap, "--step-noise", a.step_noise, 0.0, lambda n: n >= 0,
                     "each spread is a number >= 0")
    scales = numbers(ap, "--prefill-scale", a.prefill_scale, 1.0,
                     lambda k: 0 < k < float("inf"), "each scale is a finite number > 0")
    asked = [(s, lp, n, k) for s in slopes for lp in locals_ for n in noises for k in scales]
    rows = [((s, lp, n, k), r) for s, lp, n, k in asked for p in a.runs
            for r in again(p, fits, s, a.above, lp, other, n, k)]
    # --speed: "then" is the run's own prediction (its profile as measured), "now" the
    # profile scaled by the check
    print(f"{'run':<36} {'scaled by' if a.speed else 'calibrated on':<14} {'slope':>6} "
          f"{'local':>6} {'setup':<14} {'measured':>8} {'then':>13} {'now':>13}")
    for _, r in rows:
        print(f"{r['run']:<36} {r['calibrated_on'].removeprefix('baton-'):<14} "
              f"{r['stream_slope']:>6.4g} {r['local_prefill_scale']:>6.4g} "
              f"{r['setup'].removeprefix('baton-'):<14} "
              f"{r['measured_rps']:>8.3g} {r['predicted_then_rps']:>6.3g} "
              f"({100 * r['error_then']:+3.0f}%) {r['predicted_now_rps']:>6.3g} "
              f"({100 * r['error_now']:+3.0f}%)")
    by_slope = {}
    for s, lp, n, ps in asked:
        rs = [r for key, r in rows if key == (s, lp, n, ps)]
        worst = {k: max((abs(r[k]) for r in rs), default=None)
                 for k in ("error_then", "error_now")}
        within = {k: sum(abs(r[k]) <= 0.1 for r in rs) for k in ("error_then", "error_now")}
        mean_abs = sum(abs(r["error_now"]) for r in rs) / len(rs) if rs else None
        name = "profile" if s is None else f"{s:g}"
        if lp is not None:
            name += f" local {lp:g}"
        if n:
            name += f" noise {n:g}"
        if ps != 1.0:
            name += f" prefill x{ps:g}"
        by_slope[name] = {"largest_error": worst, "within_10pct": within,
                          "mean_abs_error_now": mean_abs, "rows": len(rs)}
        if rs:
            print(f"slope {'of the profile' if s is None else f'{s:g}'}"
                  f"{'' if lp is None else f', local prefill x{lp:g}'}"
                  f"{f', step noise {n:g}' if n else ''}"
                  f"{f', prompts x{ps:g}' if ps != 1.0 else ''}: largest error then "
                  f"{100 * worst['error_then']:.0f}%, now "
                  f"{100 * worst['error_now']:.0f}%; within 10%: then "
                  f"{within['error_then']}, now {within['error_now']} of {len(rs)}; mean "
                  f"|error| now {100 * mean_abs:.1f}%")
    out = {"machine": machine(), "runs": [str(p) for p in a.runs], "speed": a.speed,
           "as_measured": a.as_measured, "above": a.above,
           "local_prefill": locals_, "step_noise": noises, "prefill_scale": scales,
           "profile": str(a.profile) if a.profile else None,
           "rows": [r for _, r in rows],
           "by_slope": by_slope}
    print(f"wrote {write_result('validation-again', out)}")


if __name__ == "__main__":
    main()
