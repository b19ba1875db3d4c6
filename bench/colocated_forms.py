"""The two forms of a colocated pair on the shifting load's last two phases, run in turn.

- ``A``: two ``--role both`` workers, the router prefilling every prompt where it decodes
  (``--local-prefill-max-tokens`` unbounded): `baton bench compare`'s colocated setup, the
  shifting-load benchmark's ``2 colocated``;
- ``B``: a prefill and a decode worker started as 1P+1D, then the prefill worker switched to
  ``decode`` (``WorkerAdmin.SetRole``, as `baton tune --live --apply` does) before the trace:
  no prefill pool, so the router prefills every prompt where it decodes: the live tuner's
  colocated form.

The question it answers: does the live tuner's colocated cluster serve the decode-heavy phase
worse than the fixed colocated one? Each form gets a fresh Redis and workers, the same trace
(the decode-heavy then the last prefill-heavy phase of `bench/shifting_load.py`, its SLOs and
seed), fresh prompt tokens. JSON in bench/results/colocated-forms-*.json.

    python bench/colocated_forms.py [--order A,B,A,B]    # ~10 min a form
"""

from __future__ import annotations

import argparse
import sys
import time

from baton.bench.common import machine, write_result
from baton.bench.shifting_load import PHASES, parse_args, run_setup, trace


def to_decode(redis_url: str) -> None:
    """Form B before the trace: every worker not decoding switched to ``decode``, as `baton
    tune --live --apply` does, and the registry showing it (what the router reads)."""
    from baton.control.registry import WorkerRegistry
    from baton.control.tune_live import set_role

    registry = WorkerRegistry.from_url(redis_url)
    for w in registry.workers():
        if w.role != "decode":
            set_role(w.address, "decode")
    while any(w.role != "decode" for w in registry.workers()):
        time.sleep(0.1)
    time.sleep(3)  # the router's registry view's refresh


def run_form(a: argparse.Namespace, form: str, shape, phases) -> dict:
    if form == "A":
        return run_setup(a, form, shape, phases, kind="colocated")
    return run_setup(a, form, shape, phases, kind="disaggregated", prepare=to_decode)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--order", default="A,B,A,B", help="forms in the order they run")
    own, rest = ap.parse_known_args(argv)
    order = [f.strip() for f in own.order.split(",") if f.strip()]
    if not order or any(f not in ("A", "B") for f in order):
        print(f"error: --order {own.order}: A and B only", file=sys.stderr)
        return 2
    a = parse_args(rest)  # the shifting load's settings (--minutes, --seed, SLOs)
    phases = PHASES[1:]
    shape = trace(phases, a.minutes, a.seed)
    results = []
    for form in order:
        print(f"== {form}", file=sys.stderr, flush=True)
        results.append(run_form(a, form, shape, phases))
        r = results[-1]
        met = ", ".join(str(p["met_slo"]) for p in r["phases"])
        tpot = ", ".join(f"{p['tpot_s']['p50'] * 1000:.0f} ms" for p in r["phases"])
        print(f"{form}: {r['met_slo']} met ({met} by phase), TPOT p50 by phase {tpot}",
              flush=True)
    path = write_result("colocated-forms", {
        "machine": machine(), "args": vars(a), "order": order, "argv": sys.argv,
        "phases": [vars(p) for p in phases], "results": results})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
