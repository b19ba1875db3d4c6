"""Replay the Mooncake trace through a real cluster and compare its prefix-hit rate with an ideal
single infinite cache on the same requests.

``../shared/data/mooncake_synthetic_trace.jsonl``: one request per line, ``hash_ids`` naming its
prompt's 512-token blocks (same leading ids = same prefix). Scaled down as the data README says:
each id becomes a fixed pseudo-random block of 16 tokens (same id -> same tokens; Baton's block
size is 16, so one id is one KV block) and each prompt is cut to ``input_length * 16 / 512``
tokens, which keeps the ratio of shared to unshared tokens.

The cluster is real (redis-server, 2 prefill workers, 1 decode worker, cache-aware router, gRPC,
NIXL) but its workers run a tiny random Llama: the hit rate depends on routing and the cache, not
on the weights, and the real model would need hours on a laptop for the trace's 1.9M tokens.
Requests go in trace order, ``--concurrency`` at a time, as fast as the cluster takes them.

    achieved = prompt tokens the workers reused (usage.cached_tokens) / prompt tokens
    ideal    = the same, for one cache that never evicts and sees every request in order
               (same rule as the engine: whole blocks, at most all but the last prompt token)

    python bench/trace_replay.py [--requests 3993] [--concurrency 4] [--round-robin]

Results in bench/results/trace-replay-*.json.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from baton.bench.common import machine, run_threads, write_result

ROOT = Path(__file__).resolve().parent.parent

TRACE = ROOT.parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
BLOCK = 16
VOCAB = 400


def scaled_prompts(rows: list[dict]) -> list[list[int]]:
    blocks: dict[int, list[int]] = {}

    def block(hid: int) -> list[int]:
        if hid not in blocks:
            rng = random.Random(hid)
            blocks[hid] = [rng.randrange(4, VOCAB) for _ in range(BLOCK)]
        return blocks[hid]

    out = []
    for r in rows:
        n = max(2, round(r["input_length"] * BLOCK / 512))
        ids = [t for h in r["hash_ids"] for t in block(h)][:n]
        out.append(ids)
    return out


def ideal_hits(prompts: list[list[int]]) -> list[int]:
    """Cached tokens per request for one infinite cache (engine rules)."""
    from baton.engine.block_hash import hash_blocks, namespace_for

    ns = namespace_for("ideal")
    seen: set[bytes] = set()
    out = []
    for ids in prompts:
        hashes = hash_blocks(ids, BLOCK, ns)
        usable = (len(ids) - 1) // BLOCK
        hit = 0
        while hit < usable and hashes[hit] in seen:
            hit += 1
        out.append(hit * BLOCK)
        seen.update(hashes)
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--requests", type=int, default=0, help="first N requests (default: all)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--blocks", type=int, default=40000, help="KV blocks per worker")
    ap.add_argument("--round-robin", action="store_true",
                    help="also replay through a round-robin router (another cache salt)")
    ap.add_argument("--no-save", action="store_true")
    return ap.parse_args()


def main() -> None:
    args = parse_args()

    with open(args.trace) as f:
        rows = [json.loads(line) for line in f]
    if args.requests:
        rows = rows[: args.requests]
    prompts = scaled_prompts(rows)
    ideal = ideal_hits(prompts)
    total = sum(map(len, prompts))
    print(f"{len(prompts)} requests, {total} prompt tokens after scaling; ideal single infinite "
          f"cache hit rate {sum(ideal) / total:.1%}", flush=True)

    from baton.bench.tiny_model import make_hf_model
    from baton.control.redis_server import EmbeddedRedis
    from baton.services.launch.local import WorkerProcess

    model_dir = Path(tempfile.mkdtemp(prefix="baton-trace-model-"))
    max_len = max(map(len, prompts)) + args.max_tokens + 16
    make_hf_model(model_dir, vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=max_len)
    modes = ["cache-aware"] + (["round-robin"] if args.round_robin else [])
    results = {}
    with EmbeddedRedis() as redis:
        common = ["--model", str(model_dir), "--redis-url", redis.url, "--threads", "1",
                  "--num-blocks", str(args.blocks), "--max-num-seqs", "16"]
        print("starting 2 prefill workers, 1 decode worker (tiny random Llama) ...", flush=True)
        workers = [WorkerProcess("prefill", common) for _ in range(2)]
        workers.append(WorkerProcess("decode", common))
        try:
            for mode in modes:
                router = WorkerProcess("router", ["--redis-url", redis.url, "--port", "0",
                                                  "--http-port", "-1", "--routing", mode])
                try:
                    results[mode] = replay(router, prompts, ideal, args, salt=mode)
                finally:
                    router.stop()
        finally:
            for w in workers:
                w.stop()
    report(args, prompts, ideal, total, results)


def report(args, prompts, ideal, total: int, results: dict) -> None:
    res = {"benchmark": "trace_replay", "machine": machine(), "trace": Path(args.trace).name,
           "requests": len(prompts), "prompt_tokens": total, "block_tokens": BLOCK,
           "scale": "512-token trace blocks -> 16 tokens", "model": "tiny random Llama "
           "(2 layers, hidden 64)", "workers": "2 prefill + 1 decode",
           "concurrency": args.concurrency, "ideal_hit_rate": round(sum(ideal) / total, 4)}
    for mode, r in results.items():
        r["fraction_of_ideal"] = round(r["hit_rate"] / res["ideal_hit_rate"], 4)
        res[mode.replace("-", "_")] = r
    res["target_fraction_of_ideal"] = 0.9
    print(f"\n{'policy':12} {'hit rate':>9} {'of ideal':>9} {'req/s':>7}  paths")
    print(f"{'ideal':12} {res['ideal_hit_rate']:9.1%} {1:9.1%}")
    for mode, r in results.items():
        print(f"{mode:12} {r['hit_rate']:9.1%} {r['fraction_of_ideal']:9.1%} "
              f"{r['requests_per_s']:7.1f}  {r['paths']}")
    if not args.no_save:
        print(f"wrote {write_result('trace-replay', res)}")


def replay(router, prompts, ideal, args, salt):
    import grpc
    from baton_client.v1 import api_pb2, api_pb2_grpc

    stub = api_pb2_grpc.BatonStub(router.channel)
    lock = threading.Lock()
    nxt = iter(range(len(prompts)))
    cached = [0] * len(prompts)
    paths: Counter = Counter()
    errors: list[str] = []
    done = [0]
    t0 = time.perf_counter()

    def worker():
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            req = api_pb2.GenerateRequest(params=api_pb2.SamplingParams(
                max_tokens=args.max_tokens, ignore_eos=True, cache_salt=salt))
            req.token_ids.ids.extend(prompts[i])
            try:
                final = [m.final for m in stub.Generate(req, timeout=300)
                         if m.HasField("final")][0]
            except grpc.RpcError as e:
                errors.append(f"request {i}: {e.code().name}: {e.details()}")
                continue
            with lock:
                cached[i] = final.usage.cached_tokens
                paths[f"{final.path}/{final.route_reason}"] += 1
                done[0] += 1
                if done[0] % 500 == 0:
                    print(f"  {salt}: {done[0]}/{len(prompts)} "
                          f"({time.perf_counter() - t0:.0f}s)", flush=True)

    run_threads(worker, args.concurrency)
    if errors:
        raise SystemExit(f"{len(errors)} requests failed; first: {errors[0]}")
    wall = time.perf_counter() - t0
    total = sum(map(len, prompts))
    return {"hit_rate": round(sum(cached) / total, 4), "cached_tokens": sum(cached),
            "requests_over_ideal": sum(c > h for c, h in zip(cached, ideal)),
            "paths": dict(paths), "wall_s": round(wall, 1),
            "requests_per_s": round(len(prompts) / wall, 2)}


if __name__ == "__main__":
    main()
