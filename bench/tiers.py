"""KV tiers: prefix-hit rate and follow-up TTFT with a deliberately small KV pool, tiers off and
on, in one run, through a real cluster (redis-server, one prefill and one decode worker, the
cache-aware router, gRPC, NIXL hand-offs).

Two workloads, each run twice on fresh workers (tiers off, then on; nothing else changes):

* ``multi-turn`` (``baton.control.workload.multi_turn``) on the real model (SmolLM2-135M): chats
  whose every turn extends the previous one, interleaved across conversations, so by the time a
  conversation's next turn comes, the others have pushed its blocks out of a pool a tenth the
  size of the working set. Reported: hit rate, and TTFT p50/p90 of the follow-up turns (turn 2
  on), measured by the client from sending to the first token.
* ``mooncake`` (``../shared/data/mooncake_synthetic_trace.jsonl``, scaled as
  ``bench/trace_replay.py`` scales it: a 512-token trace block becomes 16 tokens) on a tiny
  random Llama (the hit rate depends on the cache, not the weights): hit rate.

Both pools are sized to ``--pool-fraction`` (default 0.1) of the workload's working set (the
distinct blocks of all its prompts), at least the largest request. With tiers on, each worker
gets a disk tier (a CPU worker's pool is host memory already) sized to hold the working set:
``--tier-factor`` (default 1.25) times it. Requests go one at a time in workload order, always to
the prefill worker (``--local-prefill-max-tokens 0``), so the prefill worker's cache is the one
cache compared with the ideal:

    hit rate = prompt tokens the workers reused (usage.cached_tokens) / prompt tokens
    ideal    = the same for one cache that never evicts, seeing every request in order (engine
               rules: whole blocks, at most all but the last prompt token)

Targets (issue 33): hit rate with tiers >= 90% of the ideal where the tier holds the working set;
follow-up-turn TTFT p50 at least 2x lower with tiers than without.

    python bench/tiers.py [--conversations 24 --turns 6] [--mooncake-requests N]

Results in bench/results/tiers-*.json.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from baton.bench.common import machine, pct, write_result
from baton.bench.trace_replay import TRACE, ideal_hits, scaled_prompts

BLOCK = 16


def working_set(prompts: list[list[int]]) -> int:
    """Distinct full blocks over all prompts (chained: a block is its whole prefix)."""
    from baton.engine.block_hash import hash_blocks, namespace_for

    ns = namespace_for("ws")
    seen: set[bytes] = set()
    for ids in prompts:
        seen.update(hash_blocks(ids, BLOCK, ns))
    return len(seen)


def run_cluster(model: str | None, prompts, max_tokens: list[int], pool_blocks: int,
                tier_bytes: int, threads: int, label: str) -> dict:
    """One cluster (tiers on when ``tier_bytes``), the prompts one at a time; per request:
    TTFT, cached tokens (total, from disk), and the workers' tier metrics at the end."""
    from baton.control.redis_server import EmbeddedRedis
    from baton.services.launch.local import WorkerProcess
    from baton_client.v1 import api_pb2_grpc

    tmp = Path(tempfile.mkdtemp(prefix="baton-tiers-"))
    with EmbeddedRedis() as redis:
        common = ["--redis-url", redis.url, "--threads", str(threads), "--num-blocks",
                  str(pool_blocks), "--block-size", str(BLOCK)]
        if model:
            common += ["--model", model]

        def tier(role: str) -> list[str]:
            if not tier_bytes:
                return []
            return ["--kv-disk-tier-gb", f"{tier_bytes / (1 << 30):.9f}",
                    "--kv-disk-tier-dir", str(tmp / role)]

        workers = [WorkerProcess("prefill", common + tier("prefill"))]
        workers.append(WorkerProcess("decode", common + tier("decode")))
        router = WorkerProcess("router", ["--redis-url", redis.url, "--port", "0",
                                          "--http-port", "-1", "--local-prefill-max-tokens",
                                          "0"])
        stub = api_pb2_grpc.BatonStub(router.channel)
        rows = []
        t0 = time.perf_counter()
        try:
            for i, (ids, mt) in enumerate(zip(prompts, max_tokens)):
                rows.append(_one_request(stub, ids, mt, f"{label}: request {i}"))
                if (i + 1) % 100 == 0:
                    print(f"  {label}: {i + 1}/{len(prompts)} "
                          f"({time.perf_counter() - t0:.0f}s)", flush=True)
            wall = time.perf_counter() - t0
            metrics = {w.role: _tier_metrics(w.metrics_address) for w in workers}
        finally:
            router.stop()
            for w in workers:
                w.stop()
    return {"rows": rows, "wall_s": round(wall, 1), "tier_metrics": metrics}


def _one_request(stub, ids: list[int], max_tokens: int, what: str) -> dict:
    """TTFT, cached tokens (total, from disk) and path of one request; exits on a failure."""
    import grpc
    from baton_client.v1 import api_pb2

    req = api_pb2.GenerateRequest(params=api_pb2.SamplingParams(max_tokens=max_tokens,
                                                                   ignore_eos=True))
    req.token_ids.ids.extend(ids)
    sent = time.perf_counter()
    first = final = None
    try:
        for msg in stub.Generate(req, timeout=600):
            if msg.HasField("delta") and first is None:
                first = time.perf_counter() - sent
            elif msg.HasField("final"):
                final = msg.final
    except grpc.RpcError as e:
        raise SystemExit(f"{what} failed: {e.code().name}: {e.details()}") from None
    u = final.usage
    return {"ttft_s": first, "cached": u.cached_tokens, "cached_disk": u.cached_tokens_disk,
            "path": final.path, "prompt": len(ids)}


def _tier_metrics(address: str) -> dict:
    import urllib.request

    body = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    out = {}
    for line in body.splitlines():
        if line.startswith("baton_kv_tier_") and 'tier="disk"' in line:
            name, _, value = line.rpartition(" ")
            out[name.split("{")[0].removeprefix("baton_kv_tier_")] = float(value)
    return out


def summarize(res: dict, prompts, ideal: list[int], follow: list[bool]) -> dict:
    rows = res.pop("rows")
    total = sum(map(len, prompts))
    hit = sum(r["cached"] for r in rows) / total
    ideal_rate = sum(ideal) / total
    ttft = [r["ttft_s"] for r, f in zip(rows, follow) if f]
    out = {"hit_rate": round(hit, 4), "fraction_of_ideal": round(hit / ideal_rate, 4),
           "cached_tokens": sum(r["cached"] for r in rows),
           "cached_tokens_disk": sum(r["cached_disk"] for r in rows),
           "follow_up_requests": len(ttft),
           "follow_up_ttft_p50_s": _r(pct(ttft, 0.5)), "follow_up_ttft_p90_s": _r(pct(ttft, 0.9)),
           "all_ttft_p50_s": _r(pct([r["ttft_s"] for r in rows], 0.5)),
           "paths": sorted({r["path"] for r in rows}), **res}
    return out


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def workload(name: str, args) -> tuple[list[list[int]], list[int], list[bool], str | None, dict]:
    """Prompts, max tokens, whether each is a follow-up turn, the model, and a description."""
    if name == "multi-turn":
        from baton.control.workload import Tokens, multi_turn

        reqs = multi_turn(args.conversations * args.turns, args.conversations, args.system_len,
                          (args.user_min, args.user_max), (args.reply_min, args.reply_max),
                          Tokens(100, 10000, "tiers"), seed=0)
        prompts = [r.prompt for r in reqs]
        follow = [i >= args.conversations for i in range(len(reqs))]
        desc = {"conversations": args.conversations, "turns": args.turns,
                "system_tokens": args.system_len, "user_tokens": [args.user_min, args.user_max],
                "reply_tokens": [args.reply_min, args.reply_max],
                "model": "SmolLM2-135M-Instruct (float32)"}
        return prompts, [args.max_tokens] * len(prompts), follow, args.model, desc
    with open(args.trace) as f:
        rows = [json.loads(line) for line in f]
    rows = rows[: args.mooncake_requests or None]
    prompts = scaled_prompts(rows)
    # a request whose first block an earlier one shared continues a session: a follow-up
    firsts: set[int] = set()
    follow = []
    for r in rows:
        follow.append(bool(r["hash_ids"]) and r["hash_ids"][0] in firsts)
        firsts.update(r["hash_ids"][:1])
    from baton.bench.tiny_model import make_hf_model

    model_dir = Path(tempfile.mkdtemp(prefix="baton-tiers-model-"))
    make_hf_model(model_dir, vocab_size=400, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=max(map(len, prompts)) + 64)
    desc = {"trace": Path(args.trace).name, "requests": len(prompts),
            "scale": "512-token trace blocks -> 16 tokens",
            "model": "tiny random Llama (2 layers, hidden 64)"}
    return prompts, [1] * len(prompts), follow, str(model_dir), desc


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="multi-turn,mooncake")
    ap.add_argument("--model", default=None, help="multi-turn's model (default SmolLM2)")
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-len", type=int, default=256)
    ap.add_argument("--user-min", type=int, default=32)
    ap.add_argument("--user-max", type=int, default=64)
    ap.add_argument("--reply-min", type=int, default=16)
    ap.add_argument("--reply-max", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=4,
                    help="tokens generated per multi-turn request (the workload's stand-in "
                         "replies make the next turn; TTFT is the figure) (default 4)")
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--mooncake-requests", type=int, default=0,
                    help="the trace's first N requests (default 0: all of them)")
    ap.add_argument("--pool-fraction", type=float, default=0.1)
    ap.add_argument("--tier-factor", type=float, default=1.25)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--no-save", action="store_true")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    result = {"benchmark": "tiers", "machine": machine(), "block_tokens": BLOCK,
              "pool_fraction": args.pool_fraction, "tier_factor": args.tier_factor,
              "targets": {"fraction_of_ideal_with_tiers": 0.9, "follow_up_ttft_p50_ratio": 2.0},
              "workloads": {}}
    table = []
    for name in args.workloads.split(","):
        w = result["workloads"][name] = run_workload(name, args)
        table.append((name, w))
    print_table(table)
    if not args.no_save:
        print(f"wrote {write_result('tiers', result)}")


def run_workload(name: str, args) -> dict:
    """One workload with tiers off and on, in the same run."""
    from baton.engine.config import EngineConfig
    from baton.engine.kv_tiers import disk_tier_bytes
    from baton.engine.loader import load_model
    from baton.engine.runner import ModelRunner

    prompts, max_tokens, follow, model, desc = workload(name, args)
    ideal = ideal_hits(prompts)
    total = sum(map(len, prompts))
    ws = working_set(prompts)
    largest = max(-(-(len(p) + m) // BLOCK) for p, m in zip(prompts, max_tokens))
    pool = max(round(ws * args.pool_fraction), largest + 2)
    cfg = load_model(model).config
    block_nbytes = ModelRunner.block_nbytes(cfg, EngineConfig(block_size=BLOCK))
    tier_blocks = round(ws * args.tier_factor)
    print(f"{name}: {len(prompts)} requests, {total} prompt tokens, working set {ws} "
          f"blocks; pool {pool} blocks ({pool / ws:.0%}), disk tier {tier_blocks} blocks "
          f"({tier_blocks * block_nbytes / (1 << 20):.0f} MiB); ideal hit rate "
          f"{sum(ideal) / total:.1%}", flush=True)
    w = {**desc, "requests": len(prompts), "prompt_tokens": total,
         "working_set_blocks": ws, "pool_blocks": pool, "block_bytes": block_nbytes,
         "disk_tier_blocks": tier_blocks, "ideal_hit_rate": round(sum(ideal) / total, 4)}
    for label, tier_bytes in (("tiers_off", 0),
                              ("tiers_on", disk_tier_bytes(tier_blocks, block_nbytes))):
        print(f"  {label} ...", flush=True)
        res = run_cluster(model, prompts, max_tokens, pool, tier_bytes, args.threads,
                          f"{name}/{label}")
        w[label] = summarize(res, prompts, ideal, follow)
    off, on = w["tiers_off"], w["tiers_on"]
    if off["follow_up_ttft_p50_s"] and on["follow_up_ttft_p50_s"]:
        w["follow_up_ttft_p50_ratio"] = round(off["follow_up_ttft_p50_s"]
                                              / on["follow_up_ttft_p50_s"], 2)
    return w


def print_table(table) -> None:
    print(f"\n{'workload':11} {'tiers':5} {'hit rate':>9} {'of ideal':>9} {'from disk':>10} "
          f"{'follow-up TTFT p50/p90 ms':>26}")
    for name, w in table:
        print(f"{name:11} {'ideal':5} {w['ideal_hit_rate']:9.1%}")
        for label in ("tiers_off", "tiers_on"):
            r = w[label]
            p50, p90 = r["follow_up_ttft_p50_s"], r["follow_up_ttft_p90_s"]
            ttft = "-" if p50 is None else f"{p50 * 1000:.0f} / {p90 * 1000:.0f}"
            print(f"{'':11} {label[6:]:5} {r['hit_rate']:9.1%} {r['fraction_of_ideal']:9.1%} "
                  f"{r['cached_tokens_disk']:10d} {ttft:>26}")
        if "follow_up_ttft_p50_ratio" in w:
            print(f"{'':11} follow-up TTFT p50 off/on: {w['follow_up_ttft_p50_ratio']}x")


if __name__ == "__main__":
    random.seed(0)
    main()
