"""The router's added latency: the same one-token request sent to a colocated worker directly
(DecodeWorker.Generate) and through the router (Baton.Generate, local path), alternating, in
one run on one machine. Results in bench/results/router-*.json.

With one worker (the default) the router's choice is forced and it does not read the Redis
index; ``--workers 2`` registers two colocated workers, so every decision reads the index (one
Redis round trip).

With two or more workers, which worker serves a call matters as much as the router: a worker
that served the call just before is ~2 ms faster on this 2-core machine than one that sat idle
meanwhile, and the router, seeing the other worker's load as it was a moment ago, nearly always
picks the idle one. So every call is classed by whether the worker that served it also served
the call before ("same") or not ("other"); the direct calls go to the same worker and to
another in turn, so both classes are measured directly; and the router's calls are compared
with direct calls of their own classes, mixed in the router's proportions ("matched"). The
plain comparison with every direct call is reported too ("unmatched").

Routed requests go two ways, alternating with the direct calls: ``router`` asks for the last
tokens inside the final message, as the SDK does (``GenerateRequest.last_delta_in_final``), and
``router-2msg`` does not, so it gets one message more (a client that reads deltas only). The
target is checked on ``router``.

    python bench/router_latency.py [--requests 300] [--max-tokens 1] [--workers 1]
        [--baseline DIR]

``--baseline DIR`` starts a second router from another build of Baton (``DIR`` goes first on its
PYTHONPATH: ``pip install --no-deps --target DIR <old checkout>``) beside this one, in front of
the same workers, and adds its calls as one more arm (``baseline``) of every round: the two
routers' added latencies come from one run, at the same moment, on the same workers.
"""

from __future__ import annotations

import argparse
import statistics
import time

from baton.bench.common import machine, pct, write_result


def wpct(pairs: list[tuple[float, float]], q: float) -> float:
    """The q-quantile of (value, weight) pairs: the smallest value whose cumulative weight
    reaches q of the total."""
    pairs = sorted(pairs)
    total, acc = sum(w for _, w in pairs), 0.0
    for v, w in pairs:
        acc += w
        if acc >= q * total - 1e-12:
            return v
    return pairs[-1][0]


def main() -> None:
    args = parse_args()
    prompt = [1, 504, 3575, 282, 4649, 314, 2, 198]
    if args.model:
        prompt = [t % 400 for t in prompt]
    times, route_s, used_index = measure(args, prompt)
    res = {"machine": machine(), "requests": args.requests, "max_tokens": args.max_tokens,
           "prompt_tokens": len(prompt), "workers": args.workers,
           "model": args.model or "SmolLM2-135M-Instruct",
           "router_reads_index": args.workers > 1, "target_added_p50_ms": 2.0}
    report(args, res, times, route_s, used_index)
    if not args.no_save:
        print(f"wrote {write_result('router', res)}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300,
                    help="rounds of: direct, router, direct, router-2msg (default 300)")
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--workers", type=int, default=1,
                    help="colocated workers behind the router (default 1; 2+: the router reads "
                         "the prefix index for every decision)")
    ap.add_argument("--model", default=None,
                    help="a model directory for the workers (default: SmolLM2). A tiny model "
                         "makes the workers' compute, and its noise, small next to the router's "
                         "part; the prompt's ids are taken modulo 400 so that any vocabulary fits")
    ap.add_argument("--baseline", default=None, metavar="DIR",
                    help="also measure the router of another Baton build installed in DIR "
                         "(pip install --no-deps --target DIR <checkout>), in the same run")
    ap.add_argument("--no-save", action="store_true")
    return ap.parse_args()


def measure(args, prompt: list[int]):
    """Start the workers and the router(s), run the rounds; (seconds and worker class per call
    by arm, the routers' route_s, whether each read the index)."""
    from baton.control.redis_server import EmbeddedRedis
    from baton.services.launch.local import WorkerProcess

    with EmbeddedRedis() as redis:
        print(f"starting {args.workers} colocated worker(s) and a router ...", flush=True)
        model = ["--model", args.model] if args.model else []
        workers = [WorkerProcess("decode", ["--num-blocks", "64", "--redis-url", redis.url,
                                            *model]) for _ in range(args.workers)]
        router_args = ["--redis-url", redis.url, "--port", "0", "--http-port", "-1",
                       "--local-prefill-max-tokens", "100000"]
        router = WorkerProcess("router", router_args)
        baseline = (WorkerProcess("router", router_args, env={"PYTHONPATH": args.baseline})
                    if args.baseline else None)
        try:
            return _rounds(args, prompt, workers, router, baseline)
        finally:
            router.stop()
            if baseline is not None:
                baseline.stop()
            for w in workers:
                w.stop()


def _rounds(args, prompt, workers, router, baseline):
    """Each round: every arm once, in turn (see the module's docs)."""
    from baton.v1 import worker_pb2, worker_pb2_grpc
    from baton_client.v1 import api_pb2, api_pb2_grpc

    params = api_pb2.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    directs = {w.worker_id: worker_pb2_grpc.DecodeWorkerStub(w.channel) for w in workers}
    ids = list(directs)
    routed = api_pb2_grpc.BatonStub(router.channel)
    base = api_pb2_grpc.BatonStub(baseline.channel) if baseline else None
    last = [ids[0]]  # the worker that served the previous call

    def via_worker(i, k):
        # one direct call per round goes to the worker of the call before, one to another
        # (k: which of the round's two direct calls this is)
        prev = last[0]
        wid = prev if (i + k) % 2 == 0 else ids[(ids.index(prev) + 1) % len(ids)]
        for _ in directs[wid].Generate(worker_pb2.LocalRequest(
                request_id=f"d{i}.{k}", prompt_token_ids=prompt, params=params), timeout=30):
            pass
        return wid

    route_s, used_index = [], []

    def via_router(i, in_final=True, stub=None):
        wid = None
        for m in (stub or routed).Generate(api_pb2.GenerateRequest(
                token_ids=api_pb2.TokenIds(ids=prompt), params=params,
                last_delta_in_final=in_final), timeout=30):
            if m.HasField("final"):
                wid = m.final.decode_worker
                if i >= args.warmup:
                    route_s.append(m.final.timing.route_s)
                    used_index.append(m.final.index_used)
        return wid

    arms = (("direct", lambda i: via_worker(i, 0)), ("router", via_router),
            ("direct", lambda i: via_worker(i, 1)),
            ("router-2msg", lambda i: via_router(i, False)))
    if base is not None:
        arms += (("baseline", lambda i: via_router(i, stub=base)),)
    return _time_arms(args, arms, last), route_s, used_index


def _time_arms(args, arms, last: list) -> dict:
    """(seconds, "same" | "other": whether the call's worker served the call before) per call,
    by arm, after the warm-up rounds."""
    times: dict[str, list] = {name: [] for name, _ in arms}
    for i in range(args.warmup + args.requests):
        for name, fn in arms:
            prev = last[0]
            t0 = time.perf_counter()
            last[0] = fn(i)
            if i >= args.warmup:
                times[name].append((time.perf_counter() - t0,
                                    "same" if last[0] == prev else "other"))
    return times


def _row(name, calls, extra=""):
    xs = [t for t, _ in calls]
    r = {"calls": len(xs), "p50_ms": pct(xs, 0.5) * 1e3, "p99_ms": pct(xs, 0.99) * 1e3,
         "mean_ms": statistics.fmean(xs) * 1e3}
    print(f"{name:<14}{len(xs):>6}{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}{extra}")
    return r


def _added(res: dict, name: str, calls, direct) -> None:
    """A routed arm's row: its latency added to direct calls of the same classes, mixed in its
    proportions (see the module's docs)."""
    share = {cls: sum(c == cls for _, c in calls) / len(calls) for cls in ("same", "other")}
    mixed = []
    for cls, w in share.items():
        sub = [t for t, c in direct if c == cls]
        mixed += [(t, w / len(sub)) for t in sub] if sub and w else []
    base50, base99 = wpct(mixed, 0.5), wpct(mixed, 0.99)
    xs = [t for t, _ in calls]
    added50, added99 = (pct(xs, 0.5) - base50) * 1e3, (pct(xs, 0.99) - base99) * 1e3
    unmatched = (pct(xs, 0.5) - pct([t for t, _ in direct], 0.5)) * 1e3
    r = res[name] = _row(name, calls, f"{added50:>11.2f}{added99:>11.2f}{unmatched:>11.2f}")
    r.update(added_p50_ms=added50, added_p99_ms=added99, added_p50_unmatched_ms=unmatched,
             served_by_same_worker=share["same"])


def report(args, res: dict, times, route_s, used_index) -> None:
    """Fill ``res`` and print the table."""
    direct = times["direct"]
    print(f"\n{'':<14}{'calls':>6}{'p50 ms':>9}{'p99 ms':>9}{'added p50':>11}{'added p99':>11}"
          f"{'unmatched':>11}")
    res["direct"] = _row("direct", direct)
    for cls in ("same", "other"):
        sub = [c for c in direct if c[1] == cls]
        if sub and len(sub) < len(direct):
            res[f"direct-{cls}"] = _row(f"  {cls} worker", sub)
    for name in [n for n in ("router", "router-2msg", "baseline") if n in times]:
        _added(res, name, times[name], direct)
    for k in ("added_p50_ms", "added_p99_ms", "added_p50_unmatched_ms"):
        res[k] = res["router"][k]  # the SDK's way: what the target is checked on
    res["meets_target"] = res["added_p50_ms"] <= 2.0
    if "baseline" in times:
        _against_baseline(args, res)
    res["route_decision"] = {"p50_ms": statistics.median(route_s) * 1e3,
                             "p99_ms": pct(route_s, 0.99) * 1e3,
                             "index_read_share": sum(used_index) / len(route_s)}
    if args.workers > 1:
        print(f"the router's calls were served by the worker of the call before "
              f"{res['router']['served_by_same_worker']:.0%} of the time; added = against "
              "direct calls to workers in the same position, mixed in that proportion")
    print(f"router: the SDK's requests (last delta inside the final message); router-2msg: one "
          f"message more. Routing decision p50 {res['route_decision']['p50_ms']:.2f} ms (index "
          f"read by {res['route_decision']['index_read_share']:.0%} of them). Target: added p50 "
          f"<= 2 ms ({'met' if res['meets_target'] else 'not met'})")


def _against_baseline(args, res: dict) -> None:
    b = res["baseline"]
    res["baseline_dir"] = args.baseline
    res["added_p50_vs_baseline"] = res["added_p50_ms"] / b["added_p50_ms"]
    res["p50_vs_baseline"] = res["router"]["p50_ms"] / b["p50_ms"]
    print(f"this router vs the baseline's: added p50 {res['added_p50_ms']:.2f} vs "
          f"{b['added_p50_ms']:.2f} ms ({res['added_p50_vs_baseline']:.2f}x); whole call p50 "
          f"{res['router']['p50_ms']:.2f} vs {b['p50_ms']:.2f} ms ({res['p50_vs_baseline']:.3f}x)")


if __name__ == "__main__":
    main()
