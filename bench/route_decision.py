"""The routing decision's cost, Redis included: an 8k-token prompt against 16 registered workers.

One run on one machine, against a real redis-server: 16 workers registered (registry records,
prefix-index sets of realistic size, load hashes, in-flight entries; the records are written the
way workers write them, the worker processes themselves are not started), then the router's
decision code (block hashing, one index script call, scoring, conditional disaggregation) timed
per request, next to the physical floor of one Redis round trip (PING) on the same connection.

    python bench/route_decision.py [--prompt-tokens 8192] [--workers 16] [--requests 2000]

Results in bench/results/route-decision-*.json.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections import deque

from baton.bench.common import machine, pct, write_result


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--blocks-per-worker", type=int, default=20000,
                    help="hashes in each worker's index set (default 20000)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--no-save", action="store_true")
    return ap.parse_args()


def main() -> None:
    import redis
    from baton.control.prefix_index import PrefixIndex
    from baton.control.redis_server import EmbeddedRedis
    from baton.control.registry import WorkerRegistry
    from baton.services.router.routing import RoutingPolicy
    from baton.services.router.server import WorkerPool

    args = parse_args()
    rng = random.Random(0)
    fp = "bench-fingerprint"
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url, socket_timeout=0.5,
                                      socket_connect_timeout=0.5)
        registry = WorkerRegistry(client, ttl_s=600)
        docs = populate(args, client, registry, rng, fp)
        index = PrefixIndex(client, "bench-router")
        for i in range(args.workers):  # some requests in flight everywhere
            index.claim(f"warm-{i}", [f"prefill-{i}" if i < args.workers // 2 else f"decode-{i}"])
        index.flush()
        pool = WorkerPool(registry, refresh_s=3600)
        policy = RoutingPolicy(pool, index, local_max_new_tokens=64)
        assert len(pool.workers()) == args.workers
        prompts = [d[: args.prompt_tokens - rng.randrange(1, 64)] for d in docs]
        timed = time_decisions(args, policy, client, prompts, fp)
        index.close()
    res = report(args, *timed)
    if not args.no_save:
        print(f"wrote {write_result('route-decision', res)}")


def populate(args, client, registry, rng, fp: str) -> list[list[int]]:
    """Register the workers and fill their index sets: random hashes, and a random-depth prefix
    of each of a few shared 8k-token "documents" (returned)."""
    from baton.control.prefix_index import IndexPublisher
    from baton.control.registry import WorkerRecord
    from baton.engine.block_hash import hash_blocks, namespace_for
    from baton.engine.kv_cache import STORED

    bs = args.block_size
    docs = [[rng.randrange(49152) for _ in range(args.prompt_tokens)] for _ in range(4)]
    ns = namespace_for(fp)
    doc_hashes = [hash_blocks(d, bs, ns) for d in docs]
    print(f"registering {args.workers} workers with {args.blocks_per_worker} cached blocks "
          "each ...", flush=True)
    for i in range(args.workers):
        role = "prefill" if i < args.workers // 2 else "decode"
        rec = WorkerRecord(f"{role}-{i}", role, f"127.0.0.1:{40000 + i}", fp, f"inc{i}",
                           "bench", block_size=bs)
        registry.put(rec)
        events = deque((STORED, rng.randbytes(32)) for _ in range(args.blocks_per_worker))
        for d in doc_hashes:  # a random-depth prefix of each document
            events.extend((STORED, h) for h in d[: rng.randrange(len(d))])
        load = (rng.randrange(4), rng.randrange(32), rng.randrange(10000), 10000)
        IndexPublisher(client, rec.worker_id, rec.incarnation, events, lambda load=load: load,
                       ttl_s=600).flush()
    gc.collect()  # the router process holds none of this
    return docs


def time_decisions(args, policy, client, prompts, fp: str):
    """(decision ms, of which hashing ms, Redis PING ms, reasons, the prompt's hash bytes),
    after 100 warm-up decisions."""
    decide, hashing, ping = [], [], []
    reasons: dict[str, int] = {}
    hashes = b""
    for i in range(args.requests + 100):
        ids = prompts[i % len(prompts)]
        t0 = time.perf_counter()
        hashes = policy.prompt_hashes(ids, fp, None, args.block_size)
        t1 = time.perf_counter()
        d = policy.decide(ids, hashes, set())
        t2 = time.perf_counter()
        client.ping()
        t3 = time.perf_counter()
        assert d.used_index, "the index did not answer"
        if i >= 100:  # warm-up excluded
            decide.append((t2 - t0) * 1e3)
            hashing.append((t1 - t0) * 1e3)
            ping.append((t3 - t2) * 1e3)
            reasons[d.reason] = reasons.get(d.reason, 0) + 1
    return decide, hashing, ping, reasons, hashes


def _summary(xs):
    return {"p50_ms": round(pct(xs, 0.5), 4), "p99_ms": round(pct(xs, 0.99), 4),
            "mean_ms": round(statistics.fmean(xs), 4)}


def report(args, decide, hashing, ping, reasons, hashes) -> dict:
    res = {"benchmark": "route_decision", "machine": machine(),
           "prompt_tokens": args.prompt_tokens, "prompt_blocks": len(hashes) // 32,
           "workers": args.workers, "blocks_per_worker": args.blocks_per_worker,
           "requests": args.requests, "decision": _summary(decide),
           "of_which_hashing": _summary(hashing), "redis_ping": _summary(ping),
           "reasons": reasons, "target_p99_ms": 2.0}
    res["decision_p50_over_ping_p50"] = round(res["decision"]["p50_ms"]
                                              / res["redis_ping"]["p50_ms"], 2)
    res["meets_target"] = res["decision"]["p99_ms"] <= 2.0
    print(f"\nrouting decision, {args.prompt_tokens}-token prompt ({len(hashes) // 32} blocks), "
          f"{args.workers} workers, {args.requests} requests")
    print(f"{'':26} {'p50 ms':>8} {'p99 ms':>8}")
    for name, key in (("decision (incl. Redis)", "decision"),
                      ("  of which block hashing", "of_which_hashing"),
                      ("Redis PING round trip", "redis_ping")):
        print(f"{name:26} {res[key]['p50_ms']:8.3f} {res[key]['p99_ms']:8.3f}")
    print(f"target p99 <= 2 ms: {'met' if res['meets_target'] else 'NOT met'}")
    return res


if __name__ == "__main__":
    main()
