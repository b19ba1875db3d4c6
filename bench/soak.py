"""Soak: many requests through `baton up`; resident memory and open file descriptors of every
process (redis-server, workers, router) sampled as it goes, growth reported after warm-up, and
the KV pools checked at the end (free == total, no lease, integrity). Results in
bench/results/soak-*.json.

    python bench/soak.py [--requests 20000] [--clients 8] [--up-args "..."]

Requests: random token prompts (--prompt-len), greedy, --max-tokens tokens each, back to back
from --clients closed-loop clients. Warm-up: the first --warmup share of the requests; growth is
the last sample minus the first one after warm-up, and per 1,000 requests after warm-up.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from baton.bench.common import machine, write_result


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                kids = [int(k) for k in (task / "children").read_text().split()]
                out += kids
                todo += kids
        except OSError:
            continue
    return out


def sample(pid: int) -> tuple[int, int] | None:
    """(resident bytes, open fds) of ``pid``; None once it is gone."""
    try:
        rss = 0
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def name_of(pid: int) -> str:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return str(pid)
    text = " ".join(a.decode(errors="replace") for a in args)
    m = re.search(r"baton\.services\.(\w+)", text)
    if m:
        return f"{m.group(1)}-{pid}"
    return f"{Path(args[0].decode()).name}-{pid}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--prompt-len", default="8:64", help="MIN:MAX prompt tokens (default 8:64)")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--warmup", type=float, default=0.1)
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--up-args", default="", help="more `baton up` options")
    ap.add_argument("--tiny", default=None, metavar="DIR",
                    help="serve a tiny random Llama (3 layers, 400-token vocabulary; built in "
                         "DIR if missing) instead of the default model: the same request path "
                         "through every process, at many more requests per second")
    a = ap.parse_args()
    lo, hi = map(int, a.prompt_len.split(":"))

    from baton.bench.loadgen import ClosedLoop, GrpcTarget, Req
    from baton.control.registry import WorkerRegistry
    from baton.transfer import cluster_secret
    from baton.v1 import worker_pb2, worker_pb2_grpc

    t0 = time.monotonic()

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.0f}s] {msg}", flush=True)

    model, vocab = [], 49152
    if a.tiny:
        if not (Path(a.tiny) / "config.json").exists():
            from baton.bench.tiny_model import make_hf_model

            make_hf_model(Path(a.tiny), tie_word_embeddings=False)
        model, vocab = ["--model", a.tiny], 400
    up = subprocess.Popen([sys.executable, "-m", "baton.cli.main", "up", "--grpc-port", "0",
                           "--http-port", "-1", *model, *shlex.split(a.up_args)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    for line in up.stdout:
        lines.append(line)
        if "ready: gRPC API" in line:
            break
    text = "".join(lines)
    m = re.search(r"on (\S+:\d+);", lines[-1])
    if not m:
        raise SystemExit(f"baton up did not start:\n{text}")
    address = m.group(1)
    redis_url = re.search(r"redis-server on (\S+)", text).group(1)
    threading.Thread(target=lambda: lines.extend(up.stdout), daemon=True).start()
    say(f"baton up serving on {address}")

    def make(rng) -> Req:
        return Req([rng.randrange(10, vocab - 10) for _ in range(rng.randint(lo, hi))],
                   a.max_tokens)

    loop = ClosedLoop(GrpcTarget(address, timeout=120), make)
    samples: list[dict] = []
    names: dict[int, str] = {}

    def take() -> None:
        done = loop.ok + len(loop.errors)
        row = {"t": round(time.monotonic() - t0, 1), "requests": done, "procs": {}}
        for pid in descendants(up.pid):
            s = sample(pid)
            if s is not None:
                names.setdefault(pid, name_of(pid))
                row["procs"][names[pid]] = {"rss": s[0], "fds": s[1]}
        samples.append(row)

    take()
    loop.set(a.clients)
    last_say = time.monotonic()
    while loop.ok + len(loop.errors) < a.requests:
        time.sleep(a.interval)
        take()
        if time.monotonic() - last_say > 30:
            done = samples[-1]["requests"]
            rate = done / max(1e-9, samples[-1]["t"] - samples[0]["t"])
            say(f"{done}/{a.requests} requests ({len(loop.errors)} failed), {rate:.1f} req/s, "
                f"eta {(a.requests - done) / max(rate, 1e-9):.0f}s")
            last_say = time.monotonic()
    loop.set(0)
    take()
    say(f"{loop.ok + len(loop.errors)} requests, {len(loop.errors)} failed; checking the pools")

    # ---- the KV pools once quiet -----------------------------------------------------------------
    registry = WorkerRegistry.from_url(redis_url)
    pools = {}
    end = time.monotonic() + 30
    while True:
        pools = {}
        for w in registry.workers():

            with cluster_secret.channel(w.address) as ch:
                stub = (worker_pb2_grpc.PrefillWorkerStub(ch) if w.role == "prefill"
                        else worker_pb2_grpc.DecodeWorkerStub(ch))
                i = stub.Info(worker_pb2.InfoRequest(check_integrity=True), timeout=30)
            pools[w.worker_id] = {"blocks": i.num_blocks, "free": i.num_free_blocks,
                                  "leases": i.active_leases, "running": i.running_requests,
                                  "integrity_ok": i.integrity_ok}
        if all(p["free"] == p["blocks"] and not p["leases"] for p in pools.values()) or \
                time.monotonic() > end:
            break
        time.sleep(0.5)
    up.send_signal(signal.SIGINT)
    up.wait(120)

    # ---- growth after warm-up ------------------------------------------------------------------
    warm = next((s for s in samples if s["requests"] >= a.warmup * a.requests), samples[0])
    final = samples[-1]
    after = max(1, final["requests"] - warm["requests"])
    growth = {}
    for proc, v in final["procs"].items():
        w0 = warm["procs"].get(proc)
        if w0 is None:
            continue
        growth[proc] = {"rss_mib_at_warmup": round(w0["rss"] / 2**20, 1),
                        "rss_mib_at_end": round(v["rss"] / 2**20, 1),
                        "rss_growth_mib": round((v["rss"] - w0["rss"]) / 2**20, 2),
                        "rss_growth_kib_per_1k_requests":
                            round((v["rss"] - w0["rss"]) / 1024 / after * 1000, 1),
                        "fds_at_warmup": w0["fds"], "fds_at_end": v["fds"],
                        "fds_growth": v["fds"] - w0["fds"]}
    leaked = sum(p["blocks"] - p["free"] for p in pools.values())
    errors: dict[str, int] = {}
    for _, e in loop.errors:
        errors[e] = errors.get(e, 0) + 1
    result = {"machine": machine(), "args": vars(a), "address": address,
              "requests": loop.ok + len(loop.errors), "succeeded": loop.ok, "errors": errors,
              "wall_s": round(final["t"] - samples[0]["t"], 1),
              "warmup_requests": warm["requests"], "growth": growth, "pools": pools,
              "leaked_blocks": leaked, "samples": samples}
    path = write_result("soak", result)
    print(f"\n{'process':<24}{'RSS MiB warm->end':>20}{'KiB/1k req':>12}{'fds warm->end':>16}")
    for proc, g in sorted(growth.items()):
        print(f"{proc:<24}{g['rss_mib_at_warmup']:>9} -> {g['rss_mib_at_end']:<8}"
              f"{g['rss_growth_kib_per_1k_requests']:>12}"
              f"{g['fds_at_warmup']:>8} -> {g['fds_at_end']:<6}")
    print(f"requests {result['requests']} ({loop.ok} ok, errors {errors}) in "
          f"{result['wall_s']}s; leaked blocks {leaked}; pools {pools}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
