"""``baton bench run`` and ``baton bench compare`` (see ``baton bench --help``)."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from baton.bench import loadgen as lg
from baton.control.workload import draws_arg, sampling_arg

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want N or LO:HI") from None
    if a < 1 or b < a:
        raise argparse.ArgumentTypeError(f"{text!r}: want 1 <= LO <= HI")
    return a, b


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("workload")
    g.add_argument("--workload", default="synthetic",
                   choices=["synthetic", "shared-prefix", "multi-turn", "azure", "mooncake"],
                   help="synthetic: uniform lengths; shared-prefix: system prompts + own "
                        "suffixes; multi-turn: chats whose every turn extends the last; "
                        "azure: an Azure LLM trace CSV's lengths (and arrivals); mooncake: the "
                        "Mooncake JSONL trace (shared prefixes, arrivals)")
    g.add_argument("--trace", default=None,
                   help="trace file (default ../shared/data/azure_llm_2023_conv.csv or "
                        "mooncake_synthetic_trace.jsonl)")
    g.add_argument("--trace-start", type=int, default=0, help="first trace row used")
    g.add_argument("--requests", type=int, default=50, help="requests per run (default 50)")
    g.add_argument("--input-len", type=_range, default=(64, 512),
                   help="synthetic prompt tokens, N or LO:HI (default 64:512)")
    g.add_argument("--output-len", type=_range, default=(16, 64),
                   help="output tokens, N or LO:HI (default 16:64)")
    g.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: system prompt "
                                                               "tokens (default 256)")
    g.add_argument("--groups", type=int, default=4,
                   help="shared-prefix: system prompts; multi-turn: conversations")
    g.add_argument("--scale", type=float, default=1.0,
                   help="azure: multiply the trace's lengths (fit a small model / machine)")
    g.add_argument("--max-input", type=int, default=1024, help="cap on prompt tokens")
    g.add_argument("--max-output", type=int, default=256, help="cap on output tokens")
    g.add_argument("--vocab", type=_range, default=(100, 10000),
                   help="prompt token ids are drawn from LO:HI (default 100:10000)")
    g.add_argument("--sampling", type=sampling_arg, default=(),
                   help="every request samples with these filters, comma-separated: "
                        "temperature (1.0), top_k (50), min_p (0.05), top_p (0.95), as "
                        "`baton profile` times them (default greedy)")
    g.add_argument("--seed", type=int, default=0)


def add_load_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("load (one of)")
    m = g.add_mutually_exclusive_group()
    m.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s")
    m.add_argument("--speedup", type=float, default=None,
                   help="the trace's own arrival times, this many times faster")
    m.add_argument("--concurrency", type=int, default=None,
                   help="closed loop: this many requests in flight")
    m.add_argument("--goodput", action="store_true",
                   help="search the highest Poisson rate at which --attainment of requests "
                        "meet both SLOs (runs at doubling rates, then bisects)")
    g.add_argument("--start-rate", type=float, default=0.5,
                   help="--goodput: first rate tried (default 0.5/s)")
    g.add_argument("--max-rate", type=float, default=64.0,
                   help="--goodput: stop doubling here (default 64/s)")
    g.add_argument("--min-rate", type=float, default=None,
                   help="--goodput: stop halving here; a target failing even this rate has "
                        "goodput 0 (default --start-rate / 64)")
    g.add_argument("--refine", type=int, default=3, help="--goodput: bisection steps")
    g.add_argument("--draws", type=draws_arg, default=1,
                   help="--rate/--goodput: run each rate this many times, each with its own "
                        "Poisson arrivals (seeds --seed, --seed+1, ...); a rate's attainment is "
                        "over all of them (default 1)")
    s = ap.add_argument_group("SLOs")
    s.add_argument("--ttft-slo", type=float, default=2.0, help="seconds (default 2)")
    s.add_argument("--tpot-slo", type=float, default=0.2, help="seconds per token (default 0.2)")
    s.add_argument("--attainment", type=float, default=0.9,
                   help="share of requests that must meet both SLOs (default 0.9)")
    o = ap.add_argument_group("output")
    o.add_argument("--out", default=None,
                   help="folder for the JSON and PNG files (default bench/results in a "
                        "checkout, else ./baton-bench)")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--quiet", action="store_true", help="no progress line")


def _pick(cls, a: argparse.Namespace, **given):
    """``cls`` (a frozen dataclass) from the namespace's attributes of its fields' names."""
    return cls(**{f.name: given[f.name] if f.name in given else getattr(a, f.name)
                  for f in fields(cls)})


@dataclass(frozen=True)
class Workload:
    """:func:`add_workload_args`' flags."""

    workload: str
    trace: str | None
    trace_start: int
    requests: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    prefix_len: int
    groups: int
    scale: float
    max_input: int
    max_output: int
    vocab: tuple[int, int]
    seed: int
    sampling: tuple[str, ...] = ()


@dataclass(frozen=True)
class Load:
    """:func:`add_load_args`' load and SLO flags: one run at a rate / speed-up / concurrency, or
    a goodput search."""

    rate: float | None
    speedup: float | None
    concurrency: int | None
    goodput: bool
    start_rate: float
    max_rate: float
    min_rate: float | None
    refine: int
    ttft_slo: float
    tpot_slo: float
    attainment: float
    draws: int = 1


@dataclass(frozen=True)
class Output:
    out: str | None
    plots: bool
    quiet: bool


@dataclass(frozen=True)
class RunConfig:
    """`baton bench run`'s settings, built once from its command line."""

    target: str
    token: str | None
    tls_ca: str | None
    model: str | None
    workload: Workload
    load: Load
    output: Output

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> RunConfig:
        return cls(a.target, a.token, a.tls_ca, a.model, *_common(a))


@dataclass(frozen=True)
class CompareConfig:
    """`baton bench compare`'s settings, built once from its command line. ``rerun``: after a
    goodput search, run every target once more at the colocated setup's goodput rate."""

    model: str | None
    dtype: str
    prefill: int
    decode: int
    colocated: int
    cores: str | None
    num_blocks: int | None
    local_prefill_max_tokens: int | None
    router_args: str
    peer: tuple[str, ...]
    only: str | None
    workload: Workload
    load: Load
    output: Output
    rerun: bool = True

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> CompareConfig:
        wl, load, out = _common(a)
        return _pick(cls, a, peer=tuple(a.peer), workload=wl, load=load, output=out,
                     rerun=True)


def _common(a: argparse.Namespace) -> tuple[Workload, Load, Output]:
    return (_pick(Workload, a), _pick(Load, a),
            Output(a.out, not a.no_plots, a.quiet))


def flat(cfg) -> dict:
    """A config's settings as one flat dict (the JSON's ``args``)."""
    out = {}
    for k, v in asdict(cfg).items():
        out.update(v if isinstance(v, dict) else {k: v})
    return out


def workload(a: Workload, salt: str) -> list[lg.Req]:
    reqs = _lengths(a, salt)
    return lg.with_sampling(reqs, a.sampling) if a.sampling else reqs


def _lengths(a: Workload, salt: str) -> list[lg.Req]:
    toks = lg.Tokens(a.vocab[0], a.vocab[1], salt)
    if a.workload == "synthetic":
        return lg.synthetic(a.requests, a.input_len, a.output_len, toks, a.seed)
    if a.workload == "shared-prefix":
        return lg.shared_prefix(a.requests, a.groups, a.prefix_len, a.input_len, a.output_len,
                                toks, a.seed)
    if a.workload == "multi-turn":
        return lg.multi_turn(a.requests, a.groups, a.prefix_len, a.input_len, a.output_len,
                             toks, a.seed)
    if a.workload == "azure":
        path = a.trace or DATA / "azure_llm_2023_conv.csv"
        return lg.azure(path, a.requests, toks, a.scale, a.max_input, a.max_output,
                        a.trace_start)
    path = a.trace or DATA / "mooncake_synthetic_trace.jsonl"
    return lg.mooncake(path, a.requests, toks, max_input=a.max_input, max_output=a.max_output)


class Progress:
    def __init__(self, quiet: bool) -> None:
        self.quiet, self.label, self.t0 = quiet, "", time.monotonic()

    def start(self, label: str) -> None:
        self.label, self.t0 = label, time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        if not self.quiet:
            print(f"\r  {self.label}: {done}/{total} requests, {time.monotonic() - self.t0:.0f}s",
                  end="" if done < total else "\n", file=sys.stderr, flush=True)


def measure(target, wl: Workload, a: Load, name: str, progress: Progress) -> dict:
    """One target: a single run (rate / speedup / concurrency / the trace's times) or a goodput
    search; returns the JSON-able result."""
    runs: list[dict] = []

    def once(rate: float | None, label: str, draw: int = 0) -> dict:
        salt = f"{name}/{len(runs)}/{time.time_ns()}"  # no run finds another's prompts cached
        reqs = workload(wl, salt)
        if rate is not None:
            reqs = lg.poisson(reqs, rate, wl.seed + draw)
        elif a.speedup:
            reqs = lg.speed_up(reqs, a.speedup)
        elif wl.workload not in ("azure", "mooncake") and not a.concurrency:
            reqs = lg.poisson(reqs, 1.0, wl.seed)  # no timing given: 1 request/s
        progress.start(f"{name} {label}")
        records, wall = lg.run(target, reqs, a.concurrency or 0, progress)
        s = lg.summarize(records, wall, a.ttft_slo, a.tpot_slo)
        s.update(rate=rate, label=label, draw=draw,
                 ttft_values=[r.ttft for r in records if r.ttft],
                 tpot_values=[r.tpot for r in records if r.tpot],
                 # per request, in order: [TPOT, its first token's compute (loadgen's
                 # "prefill" stage), path], null where it failed: what a router's live window
                 # measures, for control/calibrate.py
                 observed=[None if r.error else [r.tpot, (r.stages or {}).get("prefill"),
                                                 r.path] for r in records],
                 # per request, in order: what it asked and what it got, so a run can be set
                 # beside the simulator's account of the same requests (bench/plateau.py)
                 per_request=[lg.request_row(r) for r in records])
        runs.append(s)
        t = s["ttft_s"]["p90"]
        print(f"  {name} {label}: {s['succeeded']}/{s['requests']} ok, attainment "
              f"{100 * (s['attainment'] or 0):.0f}%, TTFT p90 "
              f"{'-' if t is None else f'{t * 1000:.0f} ms'}", file=sys.stderr, flush=True)
        return s

    def at_rate(rate: float, label: str) -> float:
        """The attainment over ``a.draws`` runs at ``rate``, each its own Poisson draw (the
        same number of requests each: the mean of theirs)."""
        got = [once(rate, label + (f", draw {k + 1}/{a.draws}" if a.draws > 1 else ""), k)
               for k in range(a.draws)]
        return sum(s["attainment"] or 0.0 for s in got) / len(got)

    if a.goodput:
        goodput, points = lg.find_goodput(
            lambda r: at_rate(r, f"{r:.3g} req/s"), a.start_rate, a.attainment,
            max_rate=a.max_rate, refine=a.refine, min_rate=a.min_rate)
        return {"target": name, "goodput_rps": goodput, "points": points, "runs": runs}
    if a.rate:
        at_rate(a.rate, f"{a.rate} req/s")
        return {"target": name, "runs": runs}
    label = (f"trace x{a.speedup}" if a.speedup
             else f"{a.concurrency} concurrent" if a.concurrency else "default")
    once(a.rate, label)
    return {"target": name, "runs": runs}


def table(results: list[dict]) -> str:
    def ms(x):
        return "-" if x is None else f"{x * 1000:.0f}"

    head = (f"{'target':<22} {'run':<14} {'ok':>7} {'attain':>6} {'tok/s':>7} "
            f"{'TTFT ms p50/p90/p99':>20} {'TPOT ms p50/p90/p99':>20} {'ITL p99':>7} "
            f"{'E2E p50':>7}")
    lines = [head]
    for res in results:
        for r in res["runs"]:
            t, p = r["ttft_s"], r["tpot_s"]
            lines.append(
                f"{res['target'][:22]:<22} {r['label'][:14]:<14} "
                f"{r['succeeded']:>3}/{r['requests']:<3} {100 * (r['attainment'] or 0):>5.0f}% "
                f"{(r['output_tokens_per_s'] or 0):>7.1f} "
                f"{ms(t['p50']) + '/' + ms(t['p90']) + '/' + ms(t['p99']):>20} "
                f"{ms(p['p50']) + '/' + ms(p['p90']) + '/' + ms(p['p99']):>20} "
                f"{ms(r['itl_s']['p99']):>7} {ms(r['e2e_s']['p50']):>7}")
        if "goodput_rps" in res:
            lines.append(f"{res['target'][:22]:<22} goodput {res['goodput_rps']:.3g} req/s")
    return "\n".join(lines)


def out_dir(a: Output) -> Path:
    if a.out:
        return Path(a.out)
    here = Path(__file__).resolve().parent / "results"  # a checkout's bench/results
    return here if here.is_dir() and os.access(here, os.W_OK) else Path("baton-bench")


def save(cfg: RunConfig | CompareConfig, kind: str, result: dict) -> list[Path]:
    from baton.bench.common import machine

    d = out_dir(cfg.output)
    d.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    result = {"kind": kind, "machine": machine(), "args": flat(cfg), **result}
    path = d / f"bench-{kind}-{stamp}.json"
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    paths = [path]
    if cfg.output.plots:
        paths += plots(result["results"], d / f"bench-{kind}-{stamp}")
    return paths


def plots(results: list[dict], stem: Path) -> list[Path]:
    """Latency CDFs (TTFT, TPOT; each target's last run) and attainment against rate."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plots: pip install matplotlib)", file=sys.stderr)
        return []
    out = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "ttft_values", "TTFT"), (axes[1], "tpot_values", "TPOT")):
        for res in results:
            r = res["runs"][-1]
            xs = sorted(r[key])
            if xs:
                ax.plot([x * 1000 for x in xs], [(i + 1) / len(xs) for i in range(len(xs))],
                        label=f"{res['target']} ({r['label']})")
        ax.set_xscale("log")
        _finish(ax, f"{title} (ms)", "fraction of requests")
    out.append(_save(plt, fig, f"{stem}-cdf.png"))
    if any("points" in r for r in results):
        fig, ax = plt.subplots(figsize=(6, 4))
        for res in results:
            if "points" in res:
                pts = sorted(res["points"])
                ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o",
                        label=f"{res['target']} (goodput {res['goodput_rps']:.3g}/s)")
        ax.axhline(90, color="grey", ls="--", lw=0.8)
        _finish(ax, "request rate (req/s)", "SLO attainment (%)")
        out.append(_save(plt, fig, f"{stem}-attainment.png"))
    return out


def _finish(ax, xlabel: str, ylabel: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def _save(plt, fig, path: str) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def cmd_run(args: argparse.Namespace) -> int:
    a = RunConfig.from_args(args)
    target = lg.target_for(a.target, token=a.token, tls_ca=a.tls_ca, model=a.model)
    try:
        res = measure(target, a.workload, a.load, a.target, Progress(a.output.quiet))
    finally:
        target.close()
    print(table([res]))
    for p in save(a, "run", {"results": [res]}):
        print(f"wrote {p}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from baton.bench.compare import compare

    return compare(CompareConfig.from_args(args))


def add_bench_args(ap: argparse.ArgumentParser) -> None:
    sub = ap.add_subparsers(dest="bench_cmd", required=True)
    r = sub.add_parser("run", help="measure one target (Baton's gRPC API or any OpenAI API)",
                       description="Drive TARGET with a workload and report TTFT, TPOT, "
                                   "inter-token and end-to-end latency (mean, p50/p90/p99), "
                                   "throughput, SLO attainment, and with --goodput the highest "
                                   "rate meeting the SLOs. Writes JSON and PNG plots.")
    r.add_argument("target", help="host:port (Baton gRPC) or http(s)://host:port/v1 (OpenAI)")
    r.add_argument("--token", default=os.environ.get("BATON_AUTH_TOKEN"),
                   help="bearer token / API key")
    r.add_argument("--tls-ca", default=None, help="gRPC over TLS, trusting this CA (PEM)")
    r.add_argument("--model", default=None, help="OpenAI targets: model name (default: the "
                                                 "first /v1/models lists)")
    add_workload_args(r)
    add_load_args(r)
    r.set_defaults(func=cmd_run)
    c = sub.add_parser("compare", help="disaggregated vs colocated Baton on the same cores, "
                                       "same workload (plus OpenAI peers)",
                       description="Start the same model on the same cores as prefill + decode "
                                   "pools and as colocated workers, run the identical workload "
                                   "(a goodput search by default) against each and against "
                                   "any --peer, and print the side-by-side table and the "
                                   "goodput ratio.")
    c.add_argument("--model", default=None, help="GGUF file or HF folder (default SmolLM2)")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    c.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    c.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    c.add_argument("--colocated", type=int, default=2, help="colocated workers (default 2)")
    c.add_argument("--cores", default=None,
                   help="comma-separated cores, one per worker in each setup (default: the "
                        "first cores of this process's affinity)")
    c.add_argument("--num-blocks", type=int, default=None, help="KV blocks per worker")
    c.add_argument("--local-prefill-max-tokens", type=int, default=None,
                   help="the disaggregated router's setting (default: the router's)")
    c.add_argument("--router-args", default="",
                   help="extra flags for every setup's router, e.g. "
                        "\"--prefill-saturation 2\" (see `baton router --help`)")
    c.add_argument("--peer", action="append", default=[], metavar="NAME=URL",
                   help="also measure this OpenAI-compatible server (e.g. vLLM) with the same "
                        "workload; repeatable")
    c.add_argument("--only", default=None, help="comma-separated: disaggregated,colocated "
                                                "(default both)")
    add_workload_args(c)
    add_load_args(c)
    c.set_defaults(func=cmd_compare)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="baton bench", description="Baton's load generator.")
    add_bench_args(ap)
    a = ap.parse_args(argv)
    return a.func(a)
