"""Stored `bench/tune_validation.py` runs predicted again by the current simulator and
calibration rules: each run's profile, slice and calibrated fits (decode and prefill ratios,
and the path the prefill ratio was fitted on) as stored, both setups' goodput simulated again
and set against the goodput the run measured. Nothing is measured: this is how a change to the
simulator or to what a fit scales is checked against every run already made. JSON in
bench/results/validation-again-*.json.

    python bench/validation_again.py bench/results/tune-validation-*.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from baton.bench.common import machine, write_result


def again(path: Path) -> list[dict]:
    """One row per (fit, setup) of the run at ``path``; a fit that applied nothing is left out
    (its predictions are the uncalibrated ones)."""
    from baton.bench.tune_validation import LAYOUTS, configs, slice_args
    from baton.control.calibrate import scaled
    from baton.control.profile import Profile

    d = json.loads(path.read_text())
    a = argparse.Namespace(**d["args"])
    profile = Profile(**d["profile"])
    _, ev = configs(a, profile, slice_args(a))
    rows = []
    for watched, fit in d.get("calibrated", {}).items():
        if not fit.get("applied"):
            continue
        cev = ev.with_profile(scaled(profile, fit["decode_ratio"], fit["prefill_ratio"],
                                     fit["prefill_path"]))
        for name, layout in LAYOUTS.items():
            measured = d["measured"][name]["goodput_rps"]
            then = fit["predicted"][name]["goodput_rps"]
            now = cev.goodput(layout)[0]
            rows.append({"run": path.name, "calibrated_on": watched,
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
    a = ap.parse_args()
    rows = [r for p in a.runs for r in again(p)]
    print(f"{'run':<36} {'calibrated on':<14} {'setup':<14} {'measured':>8} "
          f"{'then':>13} {'now':>13}")
    for r in rows:
        print(f"{r['run']:<36} {r['calibrated_on'][6:]:<14} {r['setup'][6:]:<14} "
              f"{r['measured_rps']:>8.3g} {r['predicted_then_rps']:>6.3g} "
              f"({100 * r['error_then']:+3.0f}%) {r['predicted_now_rps']:>6.3g} "
              f"({100 * r['error_now']:+3.0f}%)")
    worst = {k: max((abs(r[k]) for r in rows), default=None) for k in ("error_then", "error_now")}
    print(f"largest error: then {100 * worst['error_then']:.0f}%, now "
          f"{100 * worst['error_now']:.0f}%")
    out = {"machine": machine(), "runs": [str(p) for p in a.runs], "rows": rows,
           "largest_error": worst}
    print(f"wrote {write_result('validation-again', out)}")


if __name__ == "__main__":
    main()
