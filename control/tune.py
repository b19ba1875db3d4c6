"""``baton tune``: which prefill:decode split of N workers (or colocated serving) serves a trace
best under TTFT/TPOT SLOs, by simulation (:mod:`baton.control.sim`) on a measured profile
(`baton profile`).

For every layout (1P+(N-1)D ... (N-1)P+1D, and N colocated) the trace's requests are simulated
at Poisson rates and the goodput searched the way `baton bench --goodput` searches it on a real
cluster (same arrivals for the same seed, same doubling and bisection), so a prediction and a
measurement of the same trace slice are comparable point for point.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from baton.control.profile import CostModel, Profile, ProfileError, default_path
from baton.control.sim import Knobs, Layout, attainment, block_keys, simulate
from baton.control.workload import draws_arg, sampling_arg


def layouts(n: int, prefill_tp: int = 1, decode_tp: int = 1) -> list[Layout]:
    """Every split of ``n`` workers, and all colocated (at the decode pool's TP size)."""
    return ([Layout(p, n - p, False, prefill_tp, decode_tp) for p in range(1, n)]
            + [Layout(0, n, True, decode_tp, decode_tp)])


@dataclass(frozen=True)
class TraceSlice:
    """Which requests of a trace, as `baton bench` reads them."""

    trace: str
    format: str  # auto | azure | mooncake | baton (a router's live workload)
    requests: int
    trace_start: int
    scale: float
    max_input: int
    max_output: int
    # every request's sampler filters (--sampling); () keeps the trace's own (a router's
    # window records them; the other traces are greedy)
    sampling: tuple[str, ...] = ()


@dataclass(frozen=True)
class Search:
    """The SLOs and the goodput search, as `baton bench --goodput` runs it."""

    ttft_slo: float
    tpot_slo: float
    attainment: float
    start_rate: float
    max_rate: float
    min_rate: float | None
    refine: int
    seed: int
    draws: int = 1  # Poisson draws per rate (seeds seed, seed+1, ...), attainment over all

    def goodput(self, attainment_at) -> tuple[float, list[tuple[float, float]]]:
        """This search over ``attainment_at(rate)``: (goodput, [(rate, attainment), ...])."""
        from baton.control import workload as lg

        return lg.find_goodput(attainment_at, self.start_rate, self.attainment,
                               max_rate=self.max_rate, refine=self.refine,
                               min_rate=self.min_rate)


@dataclass(frozen=True)
class TuneConfig:
    """`baton tune`'s settings, built once from its command line (:func:`add_tune_args`)."""

    slice: TraceSlice
    search: Search
    knobs: Knobs
    workers: int
    profile: str | None
    out: str | None
    plot: bool
    tp_profiles: tuple[str, ...] = ()  # more profiles, at other tensor-parallel sizes
    prefill_tp: int | None = None  # None: the profile's size
    decode_tp: int | None = None

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> TuneConfig:
        return cls(TraceSlice(a.trace, a.format, a.requests, a.trace_start, a.scale,
                              a.max_input, a.max_output, a.sampling),
                   Search(a.ttft_slo, a.tpot_slo, a.attainment, a.start_rate, a.max_rate,
                          a.min_rate, a.refine, a.seed, a.draws),
                   Knobs(a.local_prefill_max_tokens, a.prefill_saturation,
                         saturated_local_max_tokens=a.saturated_local_max_tokens,
                         host_tier_blocks=a.host_tier_blocks,
                         disk_tier_blocks=a.disk_tier_blocks),
                   a.workers, a.profile, a.out, not a.no_plot, tuple(a.tp_profile),
                   a.prefill_tp, a.decode_tp)


def load_trace(a: TraceSlice) -> list:
    """The trace's requests as loadgen ``Req`` (lengths and arrival offsets)."""
    from baton.control import workload as lg

    fmt = a.format
    if fmt == "auto":
        fmt = _sniff(a.trace)
    toks = lg.Tokens(100, 10000, "tune")
    try:
        if fmt == "azure":
            reqs = lg.azure(a.trace, a.requests, toks, a.scale, a.max_input, a.max_output,
                            a.trace_start)
        elif fmt == "baton":
            reqs = lg.baton_trace(a.trace, a.requests, toks, a.max_input, a.max_output,
                                  a.trace_start)
        else:
            reqs = lg.mooncake(a.trace, a.requests, toks, max_input=a.max_input,
                               max_output=a.max_output)
    except (OSError, KeyError, ValueError) as e:
        raise SystemExit(f"error: cannot read {fmt} trace {a.trace}: {type(e).__name__}: "
                         f"{e}") from None
    if not reqs:
        raise SystemExit(f"error: no requests in {a.trace} from row {a.trace_start}")
    return lg.with_sampling(reqs, a.sampling) if a.sampling else reqs


def shape(reqs, keys: list[tuple] | None = None) -> list[tuple]:
    """(prompt tokens, output tokens, arrival[, block keys, sampler filters]) per request, for
    the simulator."""
    if keys is None:
        return [(len(r.prompt), r.max_tokens, r.at) for r in reqs]
    return [(len(r.prompt), r.max_tokens, r.at, k, r.sampling) for r, k in zip(reqs, keys)]


class Evaluator:
    """Attainment of one layout at a Poisson rate (or the trace's own times), and its goodput.
    ``profiles``: more profiles, one per tensor-parallel size a layout's pools may use."""

    def __init__(self, profile: Profile, reqs, search: Search, knobs: Knobs,
                 profiles: dict[int, Profile] | None = None) -> None:
        self.p, self.cost, self.reqs = profile, CostModel(profile), reqs
        self.search = search
        self.knobs = knobs
        self.profiles = profiles
        # the prompts' shared prefixes, as the engines' block hashes see them
        self.keys = [block_keys(r.prompt, profile.block_size) for r in reqs]

    def with_profile(self, profile: Profile) -> Evaluator:
        """The same requests, search and knobs on ``profile`` (same block size: the prompts'
        keys are kept)."""
        ev = copy.copy(self)
        ev.p, ev.cost = profile, CostModel(profile)
        return ev

    def at(self, layout: Layout, rate: float | None, draws=None) -> float:
        """The simulated attainment at ``rate`` (None: the requests' own arrival times), the
        mean over ``draws`` (Poisson draw k arrives with seed + k; default all the search's)."""
        from baton.control import workload as lg

        if rate is None:
            return self._attainment(layout, self.reqs)
        seqs = [lg.poisson(self.reqs, rate, self.search.seed + k)
                for k in (range(self.search.draws) if draws is None else draws)]
        return sum(self._attainment(layout, reqs) for reqs in seqs) / len(seqs)

    def _attainment(self, layout: Layout, reqs) -> float:
        return attainment(self.simulated(layout, reqs), self.search.ttft_slo,
                          self.search.tpot_slo)

    def simulated(self, layout: Layout, reqs) -> list:
        """The simulator's account of ``reqs`` (these requests, or a Poisson draw of them) on
        ``layout``, one record per request in their order."""
        return simulate(layout, self.p, shape(reqs, self.keys), self.knobs, self.cost,
                        self.profiles)

    def goodput(self, layout: Layout, draws=None) -> tuple[float, list[tuple[float, float]]]:
        """The search's goodput of ``layout``, each rate's attainment over ``draws`` (as
        :meth:`at`)."""
        return self.search.goodput(lambda r: self.at(layout, r, draws))


def arrival_rate(ats: list[float]) -> float | None:
    """Requests per second between the first arrival and the last (None: fewer than two
    arrivals, or all at one instant)."""
    if len(ats) < 2 or max(ats) <= min(ats):
        return None
    return (len(ats) - 1) / (max(ats) - min(ats))


def overloaded(rows: list[dict], rate: float | None, key: str) -> bool:
    """Whether requests arriving at ``rate`` are past every layout's goodput. There every
    layout falls behind, and the goodputs (each the highest Poisson rate a layout serves at the
    attainment target, all under the rate offered) no longer say which serves those requests
    better; ``key``, each row's simulated share of them within the SLOs at their own arrival
    times, does. Shifting-load run 24 (2026-12-03) tied 1P+1D and colocated at 0.44-0.63 req/s
    under 0.7-0.9 req/s of long prompts, while at the window's own times colocated served
    32-48% of it within the SLOs and 1P+1D 9-11%."""
    return (rate is not None and bool(rows)
            and all(r.get(key) is not None and r["goodput_rps"] < rate for r in rows))


def most_goodput(rows: list[dict]) -> dict:
    """The layout with the highest goodput; ties: colocated."""
    return max(rows, key=lambda r: (r["goodput_rps"], r["colocated"]))


def ranked_best(rows: list[dict], rate: float | None, key: str) -> dict:
    """:func:`most_goodput`; past every layout's goodput (:func:`overloaded`), the highest
    share ``key``, ties going to the higher goodput, then colocated."""
    if overloaded(rows, rate, key):
        return max(rows, key=lambda r: (r[key], r["goodput_rps"], r["colocated"]))
    return most_goodput(rows)


def recommend(rows: list[dict], trace_rate: float | None = None) -> str:
    best = most_goodput(rows)
    if best["goodput_rps"] > 0 and overloaded(rows, trace_rate, "attainment_at_trace_rate"):
        most = ranked_best(rows, trace_rate, "attainment_at_trace_rate")
        return (f"the trace's {trace_rate:.3g} req/s is past every configuration's goodput "
                f"(the most {best['goodput_rps']:.3g}): none meets the SLOs at its rate; "
                f"{most['layout']} serves the most of it within them "
                f"({100 * most['attainment_at_trace_rate']:.0f}%). More workers, or a "
                "lower rate, meets them")
    if best["goodput_rps"] <= 0:
        return ("no configuration meets the SLOs at any rate searched: relax the SLOs, use "
                "more workers, or shorten the requests")
    colo = next(r for r in rows if r["colocated"])
    if best["colocated"]:
        return (f"stay colocated: {best['layout']} workers serve {best['goodput_rps']:.3g} "
                "req/s within the SLOs, no split does better")
    gain = (f"{best['goodput_rps'] / colo['goodput_rps']:.2f}x colocated"
            if colo["goodput_rps"] > 0 else "colocated meets the SLOs at no rate")
    return (f"run {best['prefill']} prefill + {best['decode']} decode workers: "
            f"{best['goodput_rps']:.3g} req/s within the SLOs ({gain})")


def table(rows: list[dict], trace_rate: float | None) -> str:
    own = "attain @trace" if trace_rate is None else f"attain @{trace_rate:.3g}/s"
    lines = [f"{'configuration':<14} {'goodput req/s':>13} {own:>16}"]
    for r in rows:
        lines.append(f"{r['layout']:<14} {r['goodput_rps']:>13.3g} "
                     f"{100 * r['attainment_at_trace_rate']:>15.0f}%")
    return "\n".join(lines)


def plot(rows: list[dict], ev: Evaluator, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plot: pip install matplotlib)", file=sys.stderr)
        return None
    top = max([r["goodput_rps"] for r in rows] + [ev.search.start_rate])
    lo, hi = top / 16, top * 4
    rates = [lo * (hi / lo) ** (i / 23) for i in range(24)]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for r in rows:
        layout = Layout(r["prefill"], r["decode"], r["colocated"], r.get("prefill_tp", 1),
                        r.get("decode_tp", 1))
        ax.plot(rates, [100 * ev.at(layout, x) for x in rates], marker=".",
                label=f"{r['layout']} (goodput {r['goodput_rps']:.3g}/s)")
    ax.axhline(100 * ev.search.attainment, color="grey", ls="--", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("requests meeting both SLOs (%)")
    s = ev.search
    ax.set_title(f"baton tune: TTFT <= {s.ttft_slo:g}s, TPOT <= {s.tpot_slo * 1000:g}ms",
                 fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cmd_tune(a: argparse.Namespace) -> int:
    if a.live:
        return live(a)
    if not a.trace:
        print("error: give --trace FILE (or --live ROUTER: the router's own workload)",
              file=sys.stderr)
        return 2
    return tune(TuneConfig.from_args(a))


@dataclass(frozen=True)
class LiveConfig:
    """`baton tune --live`'s settings (control/tune_live.py)."""

    live: str
    redis_url: str
    tune: TuneConfig
    profile: Profile
    profiles: dict  # tensor-parallel size -> Profile (tp_profiles)
    apply: bool
    min_gain: float
    min_dwell: float
    min_requests: int
    every: float
    gap_s: float
    json: bool
    results: Path
    calibrate: bool = True  # the profile's factors scaled to the window first (calibrate.py)
    fill_every: float = 5.0  # the pause between looks while the window is under min_requests
    nice: int = 10  # added to the process's niceness before the first look (0: unchanged)
    confirm: int = 2  # with --every: looks in a row that must want the same switch


def live(a: argparse.Namespace) -> int:
    from baton.control.cluster_state import find_redis_url, up_secret
    from baton.control.tune_live import run_live
    from baton.transfer import cluster_secret

    a.trace = a.trace or "(live)"
    cfg = TuneConfig.from_args(a)
    try:
        profile = _check(replace(cfg, workers=2))
        by_tp = tp_profiles(cfg, profile)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    url = a.redis_url or find_redis_url()
    if not url:
        print("error: --live needs the cluster's Redis for its workers: pass --redis-url (or "
              "set BATON_REDIS_URL)", file=sys.stderr)
        return 2
    cluster_secret.adopt(up_secret(url))  # --apply's switches: a local `baton up`'s secret
    if a.min_gain < 0 or a.min_dwell < 0 or a.every < 0 or a.fill_every <= 0:
        print("error: --min-gain, --min-dwell and --every must be >= 0, --fill-every > 0",
              file=sys.stderr)
        return 2
    if a.min_requests < 1:
        print(f"error: --min-requests {a.min_requests}: must be >= 1 (the fewest requests in "
              "the router's window a look decides on)", file=sys.stderr)
        return 2
    if a.confirm < 1:
        print(f"error: --confirm {a.confirm}: must be >= 1 (1: a single look switches)",
              file=sys.stderr)
        return 2
    if not 0 <= a.nice <= 19:
        print(f"error: --nice {a.nice}: must be 0-19 (lowering the tuner's priority only)",
              file=sys.stderr)
        return 2
    results = Path(a.results) if a.results else Path(__file__).resolve().parents[1] / "bench" \
        / "results"
    return run_live(LiveConfig(a.live, url, cfg, profile, by_tp, a.apply, a.min_gain, a.min_dwell,
                               a.min_requests, a.every, a.switch_gap, a.json, results,
                               a.calibrate, a.fill_every, a.nice, a.confirm))


def _check(cfg: TuneConfig) -> Profile:
    """The profile to simulate on; SystemExit(2) naming what is wrong."""
    if cfg.workers < 2:
        raise SystemExit("error: --workers must be >= 2 (a split needs a prefill and a decode "
                         "worker)")
    if cfg.search.ttft_slo <= 0 or cfg.search.tpot_slo <= 0:
        raise SystemExit("error: --ttft-slo and --tpot-slo must be > 0 seconds")
    try:
        return Profile.load(cfg.profile or default_path())
    except ProfileError as e:
        hint = "" if cfg.profile else " (run `baton profile` first, or pass --profile)"
        raise SystemExit(f"error: {e}{hint}") from None


def tp_profiles(cfg: TuneConfig, main: Profile) -> dict[int, Profile]:
    """The profile per tensor-parallel size (``--profile`` and every ``--tp-profile``);
    SystemExit(2) for an unreadable one, two of one size, another device or dtype than the
    main profile's, or a pool size no profile measured."""
    out = {main.tensor_parallel_size: main}
    for path in cfg.tp_profiles:
        try:
            q = Profile.load(path)
        except ProfileError as e:
            raise SystemExit(f"error: --tp-profile: {e}") from None
        if q.tensor_parallel_size in out:
            raise SystemExit(f"error: --tp-profile {path}: a second profile at tensor-parallel "
                             f"size {q.tensor_parallel_size}")
        if (q.device.split(":")[0], q.dtype) != (main.device.split(":")[0], main.dtype):
            raise SystemExit(f"error: --tp-profile {path} was measured on {q.device} "
                             f"({q.dtype}), the --profile on {main.device} ({main.dtype})")
        out[q.tensor_parallel_size] = q
    for flag, tp in (("--prefill-tp", cfg.prefill_tp), ("--decode-tp", cfg.decode_tp)):
        if tp is not None and tp not in out:
            raise SystemExit(f"error: {flag} {tp}: no profile at that tensor-parallel size "
                             f"(have {sorted(out)}; `baton profile --tensor-parallel-size "
                             f"{tp}`, then --tp-profile FILE)")
    return out


def tune(cfg: TuneConfig) -> int:
    try:
        profile = _check(cfg)
        by_tp = tp_profiles(cfg, profile)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    reqs = load_trace(cfg.slice)
    ev = Evaluator(profile, reqs, cfg.search, cfg.knobs, by_tp)
    trace_rate = arrival_rate([r.at for r in reqs])
    rows = []
    t0 = time.monotonic()
    own = profile.tensor_parallel_size
    print(f"[baton tune] costs measured on {profile.device} ({profile.dtype}, "
          f"TP {sorted(by_tp)}); the profile {profile.age()}", file=sys.stderr)
    if (gap := profile.table_vs_grid()) is not None:
        print(f"[baton tune] warning: the profile: {gap}", file=sys.stderr)
    for layout in layouts(cfg.workers, cfg.prefill_tp or own, cfg.decode_tp or own):
        goodput, points = ev.goodput(layout)
        rows.append({"layout": layout.name, "prefill": layout.prefill, "decode": layout.decode,
                     "colocated": layout.colocated, "prefill_tp": layout.prefill_tp,
                     "decode_tp": layout.decode_tp, "goodput_rps": goodput, "points": points,
                     "attainment_at_trace_rate": ev.at(layout, None)})
        print(f"[baton tune {time.monotonic() - t0:5.1f}s] {layout.name}: goodput "
              f"{goodput:.3g} req/s ({len(points)} rates simulated)", file=sys.stderr,
              flush=True)
    rec = recommend(rows, trace_rate)
    print(table(rows, trace_rate))
    print(f"recommendation: {rec}")
    _write(cfg, profile, ev, rows, trace_rate, rec)
    return 0


def _write(cfg: TuneConfig, profile: Profile, ev: Evaluator, rows: list[dict],
           trace_rate: float | None, rec: str) -> None:
    """The JSON (and the plot) under ``--out``."""
    stem = Path(cfg.out or "baton-tune")
    stem.parent.mkdir(parents=True, exist_ok=True)
    s = cfg.search
    result = {"trace": cfg.slice.trace, "requests": len(ev.reqs), "trace_rate_rps": trace_rate,
              "slo": {"ttft_s": s.ttft_slo, "tpot_s": s.tpot_slo, "attainment": s.attainment},
              "profile": {"path": str(cfg.profile or default_path()), "dtype": profile.dtype,
                          "device": profile.device,
                          "tensor_parallel_size": profile.tensor_parallel_size,
                          "machine": profile.machine, **CostModel(profile).summary()},
              "args": {**asdict(cfg.slice), **asdict(s), **asdict(cfg.knobs),
                       "workers": cfg.workers, "profile": cfg.profile, "out": cfg.out,
                       "tp_profiles": cfg.tp_profiles},
              "configurations": rows, "recommendation": rec}
    Path(f"{stem}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {stem}.json")
    if cfg.plot and (png := plot(rows, ev, Path(f"{stem}.png"))):
        print(f"wrote {png}")


def _sniff(path: str) -> str:
    """A trace's format: .csv is Azure; JSON lines with ``prompt_tokens`` are a Baton router's
    live workload (/v1/baton/workload), other JSON lines Mooncake."""
    if not str(path).endswith((".jsonl", ".json", ".ndjson")):
        return "azure"
    try:
        with open(path) as f:
            first = f.readline()
    except OSError:
        return "mooncake"  # the reader reports the error
    return "baton" if '"prompt_tokens"' in first else "mooncake"


def add_tune_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--trace", default=None,
                    help="Azure LLM trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens), "
                         "Mooncake JSONL (timestamp, input_length, output_length, hash_ids), "
                         "or a router's live workload (curl ROUTER_HTTP/v1/baton/workload)")
    ap.add_argument("--format", default="auto",
                    choices=["auto", "azure", "mooncake", "baton"],
                    help="trace format (default: from the file: .csv Azure; JSON lines with "
                         "prompt_tokens a router's workload, else Mooncake)")
    ap.add_argument("--ttft-slo", type=float, required=True, help="seconds to the first token")
    ap.add_argument("--tpot-slo", type=float, required=True, help="seconds per output token")
    ap.add_argument("--workers", type=int, default=2,
                    help="workers to split into prefill and decode pools (default 2)")
    ap.add_argument("--profile", default=None,
                    help="`baton profile`'s file (default $BATON_CACHE_DIR/profile.json, else "
                         "~/.cache/baton/profile.json)")
    ap.add_argument("--tp-profile", action="append", default=[], metavar="FILE",
                    help="a profile at another tensor-parallel size (`baton profile "
                         "--tensor-parallel-size N`), for a pool of that size; repeatable")
    ap.add_argument("--prefill-tp", type=int, default=None,
                    help="the prefill pool's tensor-parallel size (default: --profile's)")
    ap.add_argument("--decode-tp", type=int, default=None,
                    help="the decode (and colocated) pool's tensor-parallel size (default: "
                         "--profile's)")
    g = ap.add_argument_group("trace slice (as `baton bench` reads it)")
    g.add_argument("--requests", type=int, default=200, help="requests used (default 200)")
    g.add_argument("--trace-start", type=int, default=0, help="first row (Azure)")
    g.add_argument("--scale", type=float, default=1.0, help="Azure: multiply the lengths")
    g.add_argument("--max-input", type=int, default=1024, help="cap on prompt tokens")
    g.add_argument("--max-output", type=int, default=256, help="cap on output tokens")
    g.add_argument("--sampling", type=sampling_arg, default=(),
                   help="every request samples with these filters, comma-separated "
                        "(temperature, top_k, min_p, top_p; `baton bench --sampling`): each "
                        "sampled token costs a step what the profile measured (default: the "
                        "trace's own: a router's window records them, the other traces are "
                        "greedy)")
    g = ap.add_argument_group("goodput search (as `baton bench --goodput`)")
    g.add_argument("--attainment", type=float, default=0.9,
                   help="share of requests that must meet both SLOs (default 0.9)")
    g.add_argument("--start-rate", type=float, default=0.5)
    g.add_argument("--max-rate", type=float, default=64.0)
    g.add_argument("--min-rate", type=float, default=None)
    g.add_argument("--refine", type=int, default=4, help="bisection steps (default 4)")
    g.add_argument("--seed", type=int, default=0, help="Poisson arrivals' seed")
    g.add_argument("--draws", type=draws_arg, default=1,
                   help="Poisson draws per rate (seeds --seed, --seed+1, ...), the attainment "
                        "over all of them, as `baton bench --draws` (default 1)")
    g = ap.add_argument_group("router and worker settings simulated")
    g.add_argument("--local-prefill-max-tokens", type=int, default=64)
    g.add_argument("--prefill-saturation", type=int, default=8)
    g.add_argument("--saturated-local-max-tokens", type=int, default=256,
                   help="as `baton router`: -1 for any length (default 256)")
    g.add_argument("--host-tier-blocks", type=int, default=0,
                   help="each worker's host KV tier, in blocks (--kv-host-tier-gb; default 0): "
                        "prefixes the pool evicts stay there, loaded back at its measured cost")
    g.add_argument("--disk-tier-blocks", type=int, default=0,
                   help="each worker's disk KV tier, in blocks (--kv-disk-tier-gb; default 0)")
    ap.add_argument("--out", default=None,
                    help="path stem for the JSON and PNG (default ./baton-tune)")
    g = ap.add_argument_group("the live cluster (--live ROUTER)")
    g.add_argument("--live", default=None, metavar="ROUTER",
                   help="tune the running cluster: the router's HTTP address (its "
                        "/v1/baton/workload is the trace; $BATON_API_KEY if it needs one), its "
                        "registered workers the layouts (instead of --trace and --workers)")
    g.add_argument("--redis-url", default=None,
                   help="the cluster's Redis (default $BATON_REDIS_URL, else a local `baton "
                        "up`'s)")
    g.add_argument("--apply", action="store_true",
                   help="switch roles, one worker at a time, to the recommended layout "
                        "(`baton role`; needs $BATON_CLUSTER_SECRET when the cluster has one)")
    g.add_argument("--min-gain", type=float, default=0.05,
                   help="switch only for at least this predicted goodput gain, also from the "
                        "top of the current layout's goodput search bracket (default 0.05)")
    g.add_argument("--min-dwell", type=float, default=600.0,
                   help="seconds since the last switch before another (default 600)")
    g.add_argument("--confirm", type=int, default=2,
                   help="with --every: switch only when this many looks in a row want the same "
                        "switch (past --min-gain, --min-dwell and the other checks), so that a "
                        "window straddling a change in the traffic does not switch on its own; "
                        "a look that decides nothing breaks the row; a steady window (its "
                        "first and last thirds by arrival time agree on their requests within "
                        "2.5x, on mean prompt and mean output within 1.5x) straddles no change "
                        "and switches on one look (default 2; "
                        "1: one look switches; a single look without --every needs no other)")
    g.add_argument("--min-requests", type=int, default=20,
                   help="fewer requests in the router's window: decide nothing (default 20)")
    g.add_argument("--every", type=float, default=0.0,
                   help="repeat every this many seconds (default 0: once)")
    g.add_argument("--fill-every", type=float, default=5.0,
                   help="with --every: while the router's window holds fewer than "
                        "--min-requests requests, look again after this many seconds instead "
                        "(at most --every), so the first decision comes as soon as the window "
                        "fills (default 5)")
    g.add_argument("--nice", type=int, default=10,
                   help="with --live: add this to the tuner's niceness (0-19), so that on a "
                        "machine it shares with workers its simulations take the CPU they "
                        "leave, not theirs (a decode-heavy window's look is ~1 s of one core "
                        "on a 2-core VM) (default 10; 0: unchanged)")
    g.add_argument("--switch-gap", type=float, default=2.0,
                   help="seconds between two workers' switches (routers re-read the registry "
                        "every second) (default 2)")
    g.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                   help="scale the profile's serving factors first so the current layout, "
                        "simulated on the window, gives the window's measured TPOT and "
                        "first-token compute (default: on; nothing is applied when no fit "
                        "comes within 5%%, or the correction is outside 0.5-2x; "
                        "docs/routing.md)")
    g.add_argument("--json", action="store_true", help="print each look as one JSON line")
    g.add_argument("--results", default=None,
                   help="where the tune validations are (default bench/results)")
    ap.add_argument("--no-plot", action="store_true")
