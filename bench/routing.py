"""Cache-aware routing against round-robin on a real cluster, one run, same workers.

A real redis-server, 2 prefill workers and 1 decode worker on the default model (SmolLM2-135M),
and two routers over the same workers: ``--routing cache-aware`` and ``--routing round-robin``.
The workload is the one prefix caches exist for: a few long system prompts shared by many users,
each user in a multi-turn conversation (each turn = the whole history + the model's last answer
+ a new message). The prefill workers' KV pools are sized to hold about half of the working set,
as in a loaded production pool, so where a request lands decides whether its prefix is cached.
Each policy replays the same conversations under its own cache salt, so neither sees the other's
cache. Reported: TTFT (client-side, first streamed token) p50/p90, the prefix-hit rate (cached
prompt tokens / prompt tokens, as the workers report it), paths and reasons.

    python bench/routing.py [--systems 8] [--system-tokens 320] [--users 3] [--turns 3]

Results in bench/results/routing-*.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from collections import Counter

from baton.bench.common import machine, pct, random_word_prompts, run_threads, write_result


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", type=int, default=8, help="distinct system prompts")
    ap.add_argument("--system-tokens", type=int, default=320)
    ap.add_argument("--users", type=int, default=3, help="conversations per system prompt")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--message-tokens", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=8, help="answer length per turn")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--prefill-blocks", type=int, default=128,
                    help="KV blocks per prefill worker (default 128: the system prompts alone "
                         "are 160)")
    ap.add_argument("--decode-blocks", type=int, default=768)
    ap.add_argument("--no-save", action="store_true")
    return ap.parse_args()


def main() -> None:
    from baton.control.redis_server import EmbeddedRedis
    from baton.services.launch.local import WorkerProcess

    args = parse_args()
    rng = random.Random(0)
    sessions = [(s, u) for u in range(args.users) for s in range(args.systems)]
    rng.shuffle(sessions)
    with EmbeddedRedis() as redis:
        common = ["--redis-url", redis.url, "--threads", "1"]
        print("starting 2 prefill workers, 1 decode worker, 2 routers (SmolLM2) ...", flush=True)
        prefill = [WorkerProcess("prefill", [*common, "--num-blocks", str(args.prefill_blocks)])
                   for _ in range(2)]
        decode = WorkerProcess("decode", [*common, "--num-blocks", str(args.decode_blocks)])
        systems, messages = _texts(args, decode)
        routers = {mode: WorkerProcess("router", ["--redis-url", redis.url, "--port", "0",
                                                  "--http-port", "-1", "--routing", mode])
                   for mode in ("round-robin", "cache-aware")}
        try:
            results = {mode: _policy_run(args, mode, router, systems, messages, sessions)
                       for mode, router in routers.items()}
        finally:
            for w in (*routers.values(), decode, *prefill):
                w.stop()
    report(args, sessions, results)


def _texts(args, decode) -> tuple[list, list]:
    """The system prompts and the users' messages, in the workers' own tokenizer."""
    import json

    from baton.engine.tokenizer import BatonTokenizer
    from baton.v1 import worker_pb2, worker_pb2_grpc

    info = worker_pb2_grpc.DecodeWorkerStub(decode.channel).Tokenizer(
        worker_pb2.InfoRequest(), timeout=30)
    tok = BatonTokenizer.from_json(json.loads(info.tokenizer_json))
    lengths = [args.system_tokens] * args.systems + [args.message_tokens] * (
        args.systems * args.users * args.turns)
    texts = random_word_prompts(tok, lengths, "routing-bench")
    return texts[: args.systems], texts[args.systems:]


def _policy_run(args, mode: str, router, systems, messages, sessions) -> dict:
    """Warm one router up, then run the workload through it."""
    import grpc
    from baton.v1 import worker_pb2
    from baton_client.v1 import api_pb2, api_pb2_grpc

    stub = api_pb2_grpc.BatonStub(router.channel)
    warm = api_pb2.GenerateRequest(params=api_pb2.SamplingParams(
        max_tokens=2, cache_salt=f"warm-{mode}"))
    warm.token_ids.ids.extend(messages[0] * 4)
    for _ in range(3):
        list(stub.Generate(warm, timeout=120))
    print(f"{mode}: {len(sessions)} conversations x {args.turns} turns ...", flush=True)
    return run_workload(stub, api_pb2, worker_pb2, grpc, systems, messages, sessions, args,
                        salt=mode)


def report(args, sessions, results: dict) -> None:
    rr, ca = results["round-robin"], results["cache-aware"]
    res = {"benchmark": "routing", "machine": machine(), "model": "SmolLM2-135M-Instruct",
           "config": vars(args), "round_robin": rr, "cache_aware": ca,
           "ttft_p50_speedup": round(rr["ttft_p50_s"] / ca["ttft_p50_s"], 2),
           "target_ttft_p50_speedup": 2.0}
    print(f"\n{len(sessions)} conversations x {args.turns} turns, {args.systems} system prompts "
          f"of {args.system_tokens} tokens; 2 prefill + 1 decode workers")
    print(f"{'policy':12} {'TTFT p50 s':>10} {'TTFT p90 s':>10} {'hit rate':>9} paths")
    for name, r in (("round-robin", rr), ("cache-aware", ca)):
        print(f"{name:12} {r['ttft_p50_s']:10.3f} {r['ttft_p90_s']:10.3f} "
              f"{r['hit_rate']:9.1%} {r['paths']}")
    print(f"cache-aware TTFT p50 is {res['ttft_p50_speedup']:.2f}x better (target >= 2x)")
    if not args.no_save:
        print(f"wrote {write_result('routing', res)}")


def _timed(stub, req):
    """(time to the first delta, the tokens, the final message) of one request."""
    t0, first, out, final = time.perf_counter(), None, [], None
    for msg in stub.Generate(req, timeout=300):
        if msg.HasField("delta"):
            if first is None:
                first = time.perf_counter() - t0
            out += msg.delta.token_ids
        else:
            final = msg.final
    return first, out, final


def run_workload(stub, api_pb2, worker_pb2, grpc, systems, messages, sessions, args, salt):
    """Every conversation's first turn, then every second turn, and so on (users think between
    turns, so a conversation's next turn comes after many other requests), ``concurrency``
    requests at a time."""
    lock = threading.Lock()
    order = [(k, turn) for turn in range(args.turns) for k in range(len(sessions))]
    histories = {k: list(systems[s]) for k, (s, _u) in enumerate(sessions)}
    done = {k: threading.Event() for k in order}  # (conversation, turn) finished
    ttft, prompt_tokens, cached, paths, errors = [], 0, 0, Counter(), []
    nxt = iter(range(len(order)))

    def worker():
        nonlocal prompt_tokens, cached
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            k, turn = order[i]
            if turn:
                done[k, turn - 1].wait()
            history = histories[k]
            history += messages[i]
            req = api_pb2.GenerateRequest(params=api_pb2.SamplingParams(
                max_tokens=args.max_tokens, ignore_eos=True, cache_salt=salt))
            req.token_ids.ids.extend(history)
            try:
                first, out, final = _timed(stub, req)
            except grpc.RpcError as e:
                errors.append(f"{e.code().name}: {e.details()}")
                done[k, turn].set()
                continue
            with lock:
                ttft.append(first)
                prompt_tokens += final.usage.prompt_tokens
                cached += final.usage.cached_tokens
                paths[f"{final.path}/{final.route_reason}"] += 1
            history += out
            done[k, turn].set()

    t = time.perf_counter()
    run_threads(worker, args.concurrency)
    if errors:
        raise SystemExit(f"{salt}: {len(errors)} requests failed, first: {errors[0]}")
    return _figures(ttft, prompt_tokens, cached, paths, time.perf_counter() - t)


def _figures(ttft: list[float], prompt_tokens: int, cached: int, paths, wall: float) -> dict:
    return {"requests": len(ttft), "ttft_p50_s": round(pct(ttft, 0.5), 4),
            "ttft_p90_s": round(pct(ttft, 0.9), 4),
            "ttft_mean_s": round(statistics.fmean(ttft), 4),
            "hit_rate": round(cached / prompt_tokens, 4), "prompt_tokens": prompt_tokens,
            "cached_tokens": cached, "paths": dict(paths), "wall_s": round(wall, 2)}


if __name__ == "__main__":
    main()
