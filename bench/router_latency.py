"""The router's added latency: the same one-token request sent to a colocated worker directly
(DecodeWorker.Generate) and through the router (Baton.Generate, local path), alternating, in
one run on one machine. Results in bench/results/router-*.json.

With one worker (the default) the router's choice is forced and it does not read the Redis
index; ``--workers 2`` registers two colocated workers, so every decision reads the index (one
Redis round trip) and the direct calls alternate between the two.

Routed requests go two ways, alternating with the direct calls: ``router`` asks for the last
tokens inside the final message, as the SDK does (``GenerateRequest.last_delta_in_final``), and
``router-2msg`` does not, so it gets one message more (a client that reads deltas only). The
target is checked on ``router``.

    python bench/router_latency.py [--requests 300] [--max-tokens 1] [--workers 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, pct, write_result  # noqa: E402


def main() -> None:
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
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()

    from baton.control.redis_server import EmbeddedRedis
    from baton.services.common.launch import WorkerProcess
    from baton.v1 import api_pb2, api_pb2_grpc, worker_pb2, worker_pb2_grpc

    prompt = [1, 504, 3575, 282, 4649, 314, 2, 198]
    if args.model:
        prompt = [t % 400 for t in prompt]
    params = worker_pb2.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    with EmbeddedRedis() as redis:
        print(f"starting {args.workers} colocated worker(s) and a router ...", flush=True)
        model = ["--model", args.model] if args.model else []
        workers = [WorkerProcess("decode", ["--num-blocks", "64", "--redis-url", redis.url,
                                            *model]) for _ in range(args.workers)]
        router = WorkerProcess("router", ["--redis-url", redis.url, "--port", "0",
                                          "--http-port", "-1",
                                          "--local-prefill-max-tokens", "100000"])
        try:
            directs = [worker_pb2_grpc.DecodeWorkerStub(w.channel) for w in workers]
            routed = api_pb2_grpc.BatonStub(router.channel)

            def via_worker(i):
                for _ in directs[i % len(directs)].Generate(worker_pb2.LocalRequest(
                        request_id=f"d{i}", prompt_token_ids=prompt, params=params), timeout=30):
                    pass

            route_s, used_index = [], []

            def via_router(i, in_final=True):
                for m in routed.Generate(api_pb2.GenerateRequest(
                        token_ids=api_pb2.TokenIds(ids=prompt), params=params,
                        last_delta_in_final=in_final), timeout=30):
                    if m.HasField("final") and i >= args.warmup:
                        route_s.append(m.final.timing.route_s)
                        used_index.append(m.final.index_used)

            # every routed request comes right after a direct one, so both see the caches as
            # the worker's compute left them; "paired" compares each with that direct call
            arms = (("direct", via_worker), ("router", via_router),
                    ("direct", via_worker), ("router-2msg", lambda i: via_router(i, False)))
            times = {"direct": [], "router": [], "router-2msg": []}
            for i in range(args.warmup + args.requests):
                for name, fn in arms:
                    t0 = time.perf_counter()
                    fn(i)
                    if i >= args.warmup:
                        times[name].append(time.perf_counter() - t0)
        finally:
            router.stop()
            for w in workers:
                w.stop()
    d = times["direct"]
    res = {"machine": machine(), "requests": args.requests, "max_tokens": args.max_tokens,
           "prompt_tokens": len(prompt), "workers": args.workers,
           "model": args.model or "SmolLM2-135M-Instruct",
           "router_reads_index": args.workers > 1, "target_added_p50_ms": 2.0}
    print(f"\n{'':<12}{'p50 ms':>9}{'p99 ms':>9}{'added p50':>11}{'added p99':>11}"
          f"{'paired p50':>12}")
    for name, xs in times.items():
        r = res[name] = {"p50_ms": statistics.median(xs) * 1e3, "p99_ms": pct(xs, 0.99) * 1e3,
                         "mean_ms": statistics.fmean(xs) * 1e3}
        line = f"{name:<12}{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}"
        if name != "direct":
            r["added_p50_ms"] = r["p50_ms"] - res["direct"]["p50_ms"]
            r["added_p99_ms"] = r["p99_ms"] - res["direct"]["p99_ms"]
            before = d[0::2] if name == "router" else d[1::2]  # the direct call just before
            pairs = sorted(b - a for a, b in zip(before, xs))
            r["added_paired_p50_ms"] = pairs[len(pairs) // 2] * 1e3
            line += (f"{r['added_p50_ms']:>11.2f}{r['added_p99_ms']:>11.2f}"
                     f"{r['added_paired_p50_ms']:>12.2f}")
        print(line)
    for k in ("added_p50_ms", "added_p99_ms", "added_paired_p50_ms"):
        res[k] = res["router"][k]  # the SDK's way: what the target is checked on
    res["meets_target"] = res["added_p50_ms"] <= 2.0
    res["route_decision"] = {"p50_ms": statistics.median(route_s) * 1e3,
                             "p99_ms": pct(route_s, 0.99) * 1e3,
                             "index_read_share": sum(used_index) / len(route_s)}
    print(f"router: the SDK's requests (last delta inside the final message); router-2msg: one "
          f"message more. Routing decision p50 {res['route_decision']['p50_ms']:.2f} ms (index "
          f"read by {res['route_decision']['index_read_share']:.0%} of them). Target: added p50 "
          f"<= 2 ms ({'met' if res['meets_target'] else 'not met'})")
    if not args.no_save:
        print(f"wrote {write_result('router', res)}")


if __name__ == "__main__":
    main()
