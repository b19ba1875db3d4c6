"""A stored `bench/tune_validation.py --draws N` run, draw by draw: each measured draw's
attainment (from the run's log, `bench/results/tune-validation-STAMP.log`) beside the
simulator's on the same arrivals (seed + draw, as the run simulated them), the mean and spread
of their difference, and the goodput every subset of the draws gives, measured (where the run's
own search visited every rate the subset's search needs) and simulated. Nothing is measured:
it says whether a miss is draw-to-draw noise, which more draws average out, or a bias the
simulator has on every draw. JSON in bench/results/validation-draws-*.json.

    python bench/validation_draws.py bench/results/tune-validation-STAMP.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import re
import statistics
from pathlib import Path

from baton.bench.common import machine, write_result

DRAW_LINE = re.compile(r"\s+(baton-[\w-]+) ([\d.]+) req/s, draw (\d+)/(\d+): .*"
                       r"attainment (\d+)%")


def measured_draws(log: str, points: dict[str, list[float]]) -> dict[str, dict]:
    """{setup: {rate: {draw: attainment}}} from the run's log lines (``draw`` from 1), each
    rate the run's exact one from ``points`` ({setup: rates searched}; the log rounds them)."""
    out: dict[str, dict] = {}
    for line in log.splitlines():
        if m := DRAW_LINE.match(line):
            name, shown = m.group(1), float(m.group(2))
            rate = min(points[name], key=lambda r: abs(r - shown))
            out.setdefault(name, {}).setdefault(rate, {})[int(m.group(3))] = \
                int(m.group(5)) / 100
    return out


def subset_goodput(table: dict[float, dict[int, float]], draws: tuple[int, ...], search,
                   ) -> float | None:
    """The goodput ``search`` (the run's) would have found over ``draws`` alone, from the
    measured ``table``; None when it needs a rate the run did not measure."""
    try:
        return search.goodput(lambda rate: statistics.fmean(table[rate][k] for k in draws))[0]
    except KeyError:
        return None


def by_draw(path: Path) -> dict:
    """The run at ``path`` (its log beside it), draw by draw (see the module's docstring)."""
    from baton.bench.tune_validation import LAYOUTS, stored_evaluator

    d = json.loads(path.read_text())
    n, log = d["args"].get("draws") or 1, path.with_suffix(".log")  # runs before --draws: 1
    if n < 2 or not log.exists():  # the draws' attainments are in its log only
        raise SystemExit(f"error: {path} has no draws to read one by one: "
                         + (f"it ran --draws {n}" if n < 2 else f"no log beside it ({log})"))
    ev = stored_evaluator(d)
    points = {name: [r for r, _ in m["points"]] for name, m in d["measured"].items()}
    table = measured_draws(log.read_text(), points)
    out: dict = {}
    for name, rates in table.items():
        layout = LAYOUTS[name]
        # draw k (from 1, as the log counts) arrived with seed + k - 1, measured and simulated;
        # each (rate, draw) simulated once, however many subsets' searches visit it
        @functools.cache
        def sim_at(rate: float, k: int, layout=layout) -> float:
            return ev.at(layout, rate, [k - 1])

        diffs = [rates[r][k] - sim_at(r, k) for r in rates for k in rates[r]]
        subsets = [tuple(range(1, n + 1))] + [
            c for size in range(1, n) for c in itertools.combinations(range(1, n + 1), size)]
        rows = []
        for sub in subsets:
            measured = subset_goodput(rates, sub, ev.search)
            # the simulator's own search over these draws, averaged as Evaluator.at averages
            simulated = ev.search.goodput(
                lambda rate, sub=sub: sum(sim_at(rate, k) for k in sub) / len(sub))[0]
            rows.append({"draws": list(sub), "measured_rps": measured,
                         "simulated_rps": simulated,
                         "error": None if not measured else simulated / measured - 1})
        out[name] = {
            "per_rate": [{"rate": r, "measured": [rates[r].get(k) for k in range(1, n + 1)],
                          "simulated": [sim_at(r, k) for k in range(1, n + 1)]}
                         for r in sorted(rates)],
            "difference_mean": statistics.fmean(diffs),
            "difference_sd": statistics.stdev(diffs) if len(diffs) > 1 else 0.0,
            "subsets": rows}
    return {"run": path.name, "draws": n, "setups": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a tune-validation-*.json run with --draws > 1")
    a = ap.parse_args()
    res = by_draw(a.run)
    for name, s in res["setups"].items():
        print(f"== {name}: measured - simulated attainment, draw by draw: mean "
              f"{100 * s['difference_mean']:+.1f} points, sd {100 * s['difference_sd']:.1f}")
        for row in s["per_rate"]:
            pairs = "  ".join(f"{100 * m:3.0f}/{100 * x:3.0f}" for m, x in
                              zip(row["measured"], row["simulated"], strict=True)
                              if m is not None)
            print(f"  {row['rate']:7.4g} req/s  {pairs}")
        for row in s["subsets"]:
            m = "-" if row["measured_rps"] is None else format(row["measured_rps"], ".4g")
            e = "-" if row["error"] is None else f"{100 * row['error']:+.0f}%"
            print(f"  draws {','.join(map(str, row['draws'])):<8} measured {m:>6} "
                  f"simulated {row['simulated_rps']:.4g} {e:>5}")
    print(f"wrote {write_result('validation-draws', {'machine': machine(), **res})}")


if __name__ == "__main__":
    main()
