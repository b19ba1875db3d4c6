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

    python bench/validation_again.py [--speed] bench/results/tune-validation-*.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from baton.bench.common import machine, write_result


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
    return [(f"{check} check", {"decode_ratio": c["decode_ratio"],
                                "prefill_ratio": c["prefill_ratio"], "prefill_path": "remote"},
             d["predicted"])
            for check, c in (("engine", before), ("serving", before.get("serving") or {}))
            if c.get("decode_ratio") and c.get("prefill_ratio")]


def again(path: Path, fits=calibrated_fits) -> list[dict]:
    """One row per (fit, setup) of the run at ``path``: the profile scaled by the fit, both
    setups' goodput simulated again, against the fit's predictions then and the goodput the run
    measured. ``fits`` picks the fits from the run (:func:`calibrated_fits`,
    :func:`speed_fits`)."""
    from baton.bench.tune_validation import LAYOUTS, configs, slice_args
    from baton.control.calibrate import scaled
    from baton.control.profile import Profile

    d = json.loads(path.read_text())
    chosen = fits(d)
    if not chosen:
        return []
    a = argparse.Namespace(**d["args"])
    profile = Profile(**d["profile"])
    _, ev = configs(a, profile, slice_args(a))
    rows = []
    for label, fit, predicted in chosen:
        cev = ev.with_profile(scaled(profile, fit["decode_ratio"], fit["prefill_ratio"],
                                     fit["prefill_path"]))
        for name, layout in LAYOUTS.items():
            measured = d["measured"][name]["goodput_rps"]
            then = predicted[name]["goodput_rps"]
            now = cev.goodput(layout)[0]
            rows.append({"run": path.name, "calibrated_on": label,
                         "prefill_path": fit["prefill_path"],
                         "decode_ratio": fit["decode_ratio"],
                         "prefill_ratio": fit["prefill_ratio"], "setup": name,
                         "measured_rps": measured, "predicted_then_rps": then,
                         "predicted_now_rps": now, "error_then": then / measured - 1,
                         "error_now": now / measured - 1})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="tune-validation-*.json files")
    ap.add_argument("--speed", action="store_true",
                    help="scale each run's profile by its speed checks before measuring, "
                         "not by its calibrated fits")
    a = ap.parse_args()
    rows = [r for p in a.runs for r in again(p, speed_fits if a.speed else calibrated_fits)]
    # --speed: "then" is the run's own prediction (its profile as measured), "now" the
    # profile scaled by the check
    print(f"{'run':<36} {'scaled by' if a.speed else 'calibrated on':<14} {'setup':<14} "
          f"{'measured':>8} {'then':>13} {'now':>13}")
    for r in rows:
        print(f"{r['run']:<36} {r['calibrated_on'].removeprefix('baton-'):<14} "
              f"{r['setup'].removeprefix('baton-'):<14} "
              f"{r['measured_rps']:>8.3g} {r['predicted_then_rps']:>6.3g} "
              f"({100 * r['error_then']:+3.0f}%) {r['predicted_now_rps']:>6.3g} "
              f"({100 * r['error_now']:+3.0f}%)")
    worst = {k: max((abs(r[k]) for r in rows), default=None) for k in ("error_then", "error_now")}
    within = {k: sum(abs(r[k]) <= 0.1 for r in rows) for k in ("error_then", "error_now")}
    print(f"largest error: then {100 * worst['error_then']:.0f}%, now "
          f"{100 * worst['error_now']:.0f}%; within 10%: then {within['error_then']}, now "
          f"{within['error_now']} of {len(rows)}")
    out = {"machine": machine(), "runs": [str(p) for p in a.runs], "speed": a.speed,
           "rows": rows, "largest_error": worst, "within_10pct": within}
    print(f"wrote {write_result('validation-again', out)}")


if __name__ == "__main__":
    main()
