"""The router's OpenAI HTTP front under load, against its gRPC API, in one run.

Starts Redis, one colocated worker and the router, then sends the same requests (a short prompt,
``--max-tokens`` tokens) two ways:

1. **load**: ``--requests`` requests at ``--concurrency`` open connections, first through the
   official ``openai`` client (``AsyncOpenAI``, one connection per concurrent request, no
   retries: every connection error is counted, not hidden), then through the gRPC API
   (``grpc.aio``, the same concurrency). Reports connection errors (target 0), other errors,
   requests/s and latency p50/p99 per API.
2. **added latency**: ``--pairs`` rounds of one request through HTTP and the same request through
   gRPC, one at a time, alternating; the HTTP front's added latency is HTTP minus gRPC, p50/p99
   of the per-round differences and of each side.

    python bench/http_load.py [--requests 2000] [--concurrency 256] [--pairs 200]
        [--baseline DIR]

``--baseline DIR`` also starts the router of another Baton build (``pip install --no-deps
--target DIR <old checkout>``) in front of the same worker and runs the same load through its HTTP
front after this one's: the two fronts' connection errors and requests/s from one run.

Writes bench/results/http-load-*.json.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from baton.bench.common import machine, pct, write_result

PROMPT = "The capital of France is"


async def _openai_load(base_url: str, model: str, n: int, concurrency: int,
                       max_tokens: int) -> dict:
    import httpx
    import openai

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    http = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(300.0))
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0,
                                http_client=http)

    async def one() -> str | None:
        try:
            r = await client.completions.create(model=model, prompt=PROMPT,
                                                max_tokens=max_tokens, temperature=0)
            assert r.choices[0].finish_reason in ("length", "stop")
        except openai.APIConnectionError as e:
            return f"connection: {type(e.__cause__ or e).__name__}"
        except openai.APIStatusError as e:
            return f"HTTP {e.status_code}"
        return None

    async with client:
        return await _drive(one, n, concurrency)


async def _grpc_load(address: str, n: int, concurrency: int, max_tokens: int) -> dict:
    import grpc
    from baton_client.v1 import api_pb2, api_pb2_grpc

    channel = grpc.aio.insecure_channel(address)
    stub = api_pb2_grpc.BatonStub(channel)
    req = api_pb2.GenerateRequest(text=PROMPT, params=api_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0), last_delta_in_final=True)

    async def one() -> str | None:
        try:
            last = None
            async for last in stub.Generate(req, timeout=300):  # noqa: B007
                pass
            assert last is not None and last.HasField("final")
        except grpc.aio.AioRpcError as e:
            return f"gRPC {e.code().name}"
        return None

    async with channel:
        return await _drive(one, n, concurrency)


async def _drive(one, n: int, concurrency: int) -> dict:
    """``n`` calls of ``one`` (which returns an error's name, or None), ``concurrency`` at a
    time; latencies of the calls that succeeded, errors by name, requests/s."""
    todo = iter(range(n))
    latencies: list[float] = []
    errors: dict[str, int] = {}

    async def lane() -> None:
        for _ in todo:
            t0 = time.perf_counter()
            error = await one()
            if error is None:
                latencies.append(time.perf_counter() - t0)
            else:
                errors[error] = errors.get(error, 0) + 1

    t0 = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    conn = sum(v for k, v in errors.items() if k.startswith("connection"))
    return {"requests": n, "ok": len(latencies), "connection_errors": conn,
            "errors": errors, "wall_s": wall, "req_per_s": len(latencies) / wall,
            "p50_ms": pct(latencies, 0.5) * 1e3 if latencies else None,
            "p99_ms": pct(latencies, 0.99) * 1e3 if latencies else None}


def _pairs(http_address: str, grpc_address: str, model: str, rounds: int,
           max_tokens: int) -> dict:
    """One request at a time, HTTP then gRPC, per round: the front's added latency."""
    import grpc
    import openai
    from baton_client.v1 import api_pb2, api_pb2_grpc

    client = openai.OpenAI(base_url=f"http://{http_address}/v1", api_key="none", max_retries=0)
    stub = api_pb2_grpc.BatonStub(grpc.insecure_channel(grpc_address))
    req = api_pb2.GenerateRequest(text=PROMPT, params=api_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0), last_delta_in_final=True)
    http_s, grpc_s = [], []
    for i in range(rounds + 10):  # 10 warm-up rounds
        t0 = time.perf_counter()
        client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens,
                                  temperature=0)
        t1 = time.perf_counter()
        for _ in stub.Generate(req, timeout=60):
            pass
        t2 = time.perf_counter()
        if i >= 10:
            http_s.append(t1 - t0)
            grpc_s.append(t2 - t1)
    added = [h - g for h, g in zip(http_s, grpc_s)]
    client.close()
    return {"rounds": rounds, "http_p50_ms": pct(http_s, 0.5) * 1e3,
            "http_p99_ms": pct(http_s, 0.99) * 1e3, "grpc_p50_ms": pct(grpc_s, 0.5) * 1e3,
            "grpc_p99_ms": pct(grpc_s, 0.99) * 1e3,
            "added_p50_ms": (pct(http_s, 0.5) - pct(grpc_s, 0.5)) * 1e3,
            "added_p99_ms": (pct(http_s, 0.99) - pct(grpc_s, 0.99)) * 1e3,
            "added_per_round_median_ms": statistics.median(added) * 1e3}


def _report(res: dict) -> None:
    print(f"\n{'load':<8}{'requests':>9}{'ok':>6}{'conn err':>10}{'other err':>10}"
          f"{'req/s':>8}{'p50 ms':>9}{'p99 ms':>9}")
    for api in [a for a in ("http", "grpc", "baseline_http") if a in res]:
        r = res[api]
        other = sum(r["errors"].values()) - r["connection_errors"]
        name = api.replace("_http", "")
        print(f"{name:<8}{r['requests']:>9}{r['ok']:>6}{r['connection_errors']:>10}{other:>10}"
              f"{r['req_per_s']:>8.1f}{r['p50_ms'] or 0:>9.1f}{r['p99_ms'] or 0:>9.1f}")
    p = res["added"]
    print(f"\none at a time, {p['rounds']} rounds: HTTP p50 {p['http_p50_ms']:.2f} ms, gRPC p50 "
          f"{p['grpc_p50_ms']:.2f} ms; the HTTP front adds p50 {p['added_p50_ms']:.2f} ms, "
          f"p99 {p['added_p99_ms']:.2f} ms (per-round median {p['added_per_round_median_ms']:.2f}"
          f" ms)")
    print(f"connection errors at {res['concurrency']} connections: "
          f"{res['http']['connection_errors']} (target 0: "
          f"{'met' if res['meets_target'] else 'missed'})")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--baseline", default=None, metavar="DIR",
                    help="also load the HTTP front of another Baton build installed in DIR")
    ap.add_argument("--no-save", action="store_true")
    return ap.parse_args()


def main() -> None:
    from baton.control.redis_server import EmbeddedRedis
    from baton.services.launch.local import WorkerProcess

    args = parse_args()
    with EmbeddedRedis() as redis:
        print("starting a colocated worker and a router ...", flush=True)
        worker = WorkerProcess("decode", ["--redis-url", redis.url, "--max-num-seqs", "64"])
        router_args = ["--redis-url", redis.url, "--http-port", "0", "--max-concurrent", "512"]
        router = WorkerProcess("router", router_args)
        baseline = (WorkerProcess("router", router_args, env={"PYTHONPATH": args.baseline})
                    if args.baseline else None)
        try:
            model = "SmolLM2-135M-Instruct"
            base = f"http://{router.http_address}/v1"
            http = asyncio.run(_openai_load(base, model, args.requests, args.concurrency,
                                            args.max_tokens))
            grpc_ = asyncio.run(_grpc_load(router.address, args.requests, args.concurrency,
                                           args.max_tokens))
            added = _pairs(router.http_address, router.address, model, args.pairs,
                           args.max_tokens)
            old = None
            if baseline is not None:
                old = asyncio.run(_openai_load(f"http://{baseline.http_address}/v1", model,
                                               args.requests, args.concurrency,
                                               args.max_tokens))
        finally:
            if baseline is not None:
                baseline.stop()
            router.stop()
            worker.stop()
    res = {"machine": machine(), "requests": args.requests, "concurrency": args.concurrency,
           "max_tokens": args.max_tokens, "prompt": PROMPT, "http": http, "grpc": grpc_,
           "added": added, "target_connection_errors": 0,
           "meets_target": http["connection_errors"] == 0}
    if old is not None:
        res.update(baseline_dir=args.baseline, baseline_http=old)
    _report(res)
    if not args.no_save:
        print(f"wrote {write_result('http-load', res)}")


if __name__ == "__main__":
    main()
