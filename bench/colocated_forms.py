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
import random
import sys
import time

from baton.bench.common import machine, write_result
from baton.bench.shifting_load import (
    PHASES,
    _cpu_s,
    _processes,
    _progress,
    _roles,
    _score,
    config,
    parse_args,
    trace,
)


def run_form(a: argparse.Namespace, form: str, shape, phases) -> dict:
    from baton.bench import loadgen as lg
    from baton.bench.compare import Setup
    from baton.control.redis_server import EmbeddedRedis
    from baton.control.registry import WorkerRegistry
    from baton.control.tune_live import set_role

    kind = "colocated" if form == "A" else "disaggregated"
    tokens = lg.Tokens(100, 10000, f"forms-{form}-{time.time()}")
    rng = random.Random(f"{a.seed}/{tokens.salt}")
    reqs = [lg.Req(tokens.random(rng, p), o, t) for p, o, t, _ in shape]
    redis = EmbeddedRedis().start()
    try:
        setup = Setup(config(a, kind), kind, redis.url)
        target = lg.GrpcTarget(setup.router.address)
        try:
            lg.warm_up(target)
            if form == "B":
                registry = WorkerRegistry.from_url(redis.url)
                for w in registry.workers():
                    if w.role != "decode":
                        set_role(w.address, "decode")
                while any(w.role != "decode" for w in registry.workers()):
                    time.sleep(0.1)  # the router reads roles from the registry
                time.sleep(3)  # its registry view's refresh
            procs = _processes(setup, None)
            before = {k: _cpu_s(pid) for k, pid in procs.items()}
            records, wall = lg.run(target, reqs, progress=_progress(form, len(reqs)))
            cpu = {k: round(_cpu_s(pid) - before[k], 1) for k, pid in procs.items()}
            roles = _roles(redis.url)
        finally:
            target.close()
            setup.stop()
    finally:
        redis.stop()
    out = _score(a, form, records, wall, shape, phases, None, roles)
    out["cpu_s"] = cpu
    return out


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
