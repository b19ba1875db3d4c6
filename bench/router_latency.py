"""The router's added latency: the same one-token request sent to a colocated worker directly
(DecodeWorker.Generate) and through the router (Baton.Generate, local path), alternating, in
one run on one machine. Results in bench/results/router-*.json.

With one worker (the default) the router's choice is forced and it does not read the Redis
index; ``--workers 2`` registers two colocated workers, so every decision reads the index (one
Redis round trip) and the direct calls alternate between the two.

Routed requests ask for their last tokens inside the final message, as the SDK does
(``GenerateRequest.last_delta_in_final``); ``--two-messages`` measures a client that does not,
which gets one message more per request.

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
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--workers", type=int, default=1,
                    help="colocated workers behind the router (default 1; 2+: the router reads "
                         "the prefix index for every decision)")
    ap.add_argument("--model", default=None,
                    help="a model directory for the workers (default: SmolLM2). A tiny model "
                         "makes the workers' compute, and its noise, small next to the router's "
                         "part; the prompt's ids are taken modulo 400 so that any vocabulary fits")
    ap.add_argument("--two-messages", action="store_true",
                    help="routed requests do not set last_delta_in_final: the last tokens come "
                         "in a delta of their own, then the final message")
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

            def via_router(i):
                for m in routed.Generate(api_pb2.GenerateRequest(
                        token_ids=api_pb2.TokenIds(ids=prompt), params=params,
                        last_delta_in_final=not args.two_messages), timeout=30):
                    if m.HasField("final"):
                        route_s.append(m.final.timing.route_s)
                        used_index.append(m.final.index_used)

            times = {"direct": [], "router": []}
            for i in range(args.warmup + args.requests):
                for name, fn in (("direct", via_worker), ("router", via_router)):
                    t0 = time.perf_counter()
                    fn(i)
                    if i >= args.warmup:
                        times[name].append(time.perf_counter() - t0)
        finally:
            router.stop()
            for w in workers:
                w.stop()
    d, r = times["direct"], times["router"]
    res = {"machine": machine(), "requests": args.requests, "max_tokens": args.max_tokens,
           "prompt_tokens": len(prompt), "workers": args.workers,
           "model": args.model or "SmolLM2-135M-Instruct",
           "router_reads_index": args.workers > 1, "target_added_p50_ms": 2.0,
           "last_delta_in_final": not args.two_messages}
    for name, xs in times.items():
        res[name] = {"p50_ms": statistics.median(xs) * 1e3, "p99_ms": pct(xs, 0.99) * 1e3,
                     "mean_ms": statistics.fmean(xs) * 1e3}
    res["added_p50_ms"] = res["router"]["p50_ms"] - res["direct"]["p50_ms"]
    res["added_p99_ms"] = res["router"]["p99_ms"] - res["direct"]["p99_ms"]
    pairs = sorted(b - a for a, b in zip(d, r))  # same i, back to back
    res["added_paired_p50_ms"] = pairs[len(pairs) // 2] * 1e3
    res["meets_target"] = res["added_p50_ms"] <= 2.0
    rs = route_s[args.warmup:]
    res["route_decision"] = {"p50_ms": statistics.median(rs) * 1e3, "p99_ms": pct(rs, 0.99) * 1e3,
                             "index_read_share": sum(used_index[args.warmup:]) / len(rs)}
    print(f"\n{'':<8}{'p50 ms':>9}{'p99 ms':>9}")
    for name in ("direct", "router"):
        print(f"{name:<8}{res[name]['p50_ms']:>9.2f}{res[name]['p99_ms']:>9.2f}")
    print(f"added by the router: p50 {res['added_p50_ms']:.2f} ms, p99 {res['added_p99_ms']:.2f} "
          f"ms (paired p50 {res['added_paired_p50_ms']:.2f} ms); of which the routing decision "
          f"p50 {res['route_decision']['p50_ms']:.2f} ms (index read by "
          f"{res['route_decision']['index_read_share']:.0%} of them)")
    if not args.no_save:
        print(f"wrote {write_result('router', res)}")


if __name__ == "__main__":
    main()
