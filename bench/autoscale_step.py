"""`baton up --autoscale` under a step in load, then under steady load: how fast the decode pool
grows after the step up and shrinks after the step down, whether any request fails across the
changes, and whether 10 minutes of steady load change anything. Results in
bench/results/autoscale-*.json.

    python bench/autoscale_step.py [--steady-s 600] [--high 8] [--steady 4]

Closed-loop clients (each sends its next request when the last ends), 256-token prompts and 64
output tokens; the pool sizes come from the Redis registry every second, the pressures from the
same metrics the autoscaler reads.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

from baton.bench.common import machine, write_result


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--low", type=int, default=1, help="clients before and after the step")
    ap.add_argument("--high", type=int, default=8, help="clients during the step")
    ap.add_argument("--steady", type=int, default=4, help="clients in the steady phase")
    ap.add_argument("--before-s", type=float, default=60)
    ap.add_argument("--high-s", type=float, default=150)
    ap.add_argument("--after-s", type=float, default=180)
    ap.add_argument("--steady-s", type=float, default=600)
    ap.add_argument("--settle-s", type=float, default=60,
                    help="steady load before the no-change window starts")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--up-args", default="--num-blocks 200 --kv-target 0.5 --ttft-slo 10 "
                                         "--tpot-slo 1.0 --max-prefill 1 --max-decode 2",
                    help="extra `baton up` flags (the policy's)")
    return ap.parse_args()


def main() -> None:
    from baton.bench import loadgen as lg

    a = parse_args()
    t0 = time.time()
    up, lines, address, redis_url = start_up(a)
    timeline: list[dict] = []
    stop = threading.Event()
    threading.Thread(target=watch, args=(a, redis_url, t0, timeline, stop), daemon=True).start()
    clients = lg.ClosedLoop(lg.GrpcTarget(address, timeout=300), lambda rng: lg.Req(
        [rng.randrange(100, 10000) for _ in range(a.prompt)], a.output))
    phases: list[dict] = []
    try:
        for name, n, seconds in (("before", a.low, a.before_s), ("step up", a.high, a.high_s),
                                 ("step down", a.low, a.after_s),
                                 ("settle", a.steady, a.settle_s),
                                 ("steady", a.steady, a.steady_s)):
            phases.append(phase(clients, name, n, seconds, t0))
        clients.set(0)
    finally:
        stop.set()
        clients.set(0)
        up.send_signal(signal.SIGINT)
        up.wait(180)
    result = summarize(a, lines, phases, timeline, clients, up.returncode, t0)
    print(f"wrote {write_result('autoscale', result)}")


def start_up(a):
    """`baton up --autoscale` in a fresh cache; (the process, its (time, line)s as they come,
    the router's gRPC address, the Redis URL)."""
    cache = tempfile.mkdtemp(prefix="baton-autoscale-bench-")
    cmd = [sys.executable, "-m", "baton.cli.main", "up", "--threads", "1", "--grpc-port", "0",
           "--http-port", "0", "--autoscale", *a.up_args.split()]
    print("$ baton " + " ".join(cmd[3:]), flush=True)
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "BATON_CACHE_DIR": cache})
    lines: list[tuple[float, str]] = []
    for line in up.stdout:
        lines.append((time.time(), line))
        print(line, end="", flush=True)
        if "ready: gRPC API" in line:
            break
    address = re.search(r"on (\S+:\d+);", lines[-1][1]).group(1)
    redis_url = re.search(r"redis-server on (\S+)", "".join(x for _, x in lines)).group(1)

    def pump() -> None:
        for line in up.stdout:
            lines.append((time.time(), line))
            if "autoscale:" in line:
                print(line, end="", flush=True)
    threading.Thread(target=pump, daemon=True).start()
    return up, lines, address, redis_url


def watch(a, redis_url: str, t0: float, timeline: list[dict], stop: threading.Event) -> None:
    """Every 2 s until ``stop``: the pools' sizes, the policy's pressures and signals."""
    from baton.control.autoscale import SLO, MetricsSignals, pressures
    from baton.control.registry import WorkerRegistry

    registry = WorkerRegistry.from_url(redis_url)
    slo = SLO(*(float(re.search(rf"--{k} (\S+)", a.up_args).group(1))
                if re.search(rf"--{k} ", a.up_args) else d
                for k, d in (("ttft-slo", 2.0), ("tpot-slo", 0.1), ("kv-target", 0.85))))
    signals = MetricsSignals(redis_url, 20.0)
    while not stop.wait(2.0):
        s = signals()
        timeline.append({"t": time.time() - t0,
                         "prefill": len(registry.workers("prefill")),
                         "decode": len(registry.workers("decode")),
                         "pressure": pressures(s, slo, True), "signals": vars(s)})


def phase(clients, name: str, n: int, seconds: float, t0: float) -> dict:
    start = time.time() - t0
    print(f"[{start:6.0f}s] phase {name}: {n} clients for {seconds:.0f}s", flush=True)
    clients.set(n)
    time.sleep(seconds)
    return {"name": name, "clients": n, "start_s": start, "end_s": time.time() - t0}


def summarize(a, lines, phases, timeline, clients, exit_code, t0: float) -> dict:
    """When the decode pool grew and shrank after the steps, and what changed while steady."""
    changes = [(ts - t0, x.strip()) for ts, x in lines if "autoscale:" in x and "->" in x]
    by = {p["name"]: p for p in phases}

    def first_change(after: float, pattern: str):
        return next((t for t, x in changes if t >= after and re.search(pattern, x)), None)

    grew = first_change(by["step up"]["start_s"], r"decode pool 1 -> 2")
    shrank = first_change(by["step down"]["start_s"], r"decode pool 2 -> 1")
    steady = [c for c in changes if by["steady"]["start_s"] <= c[0] <= by["steady"]["end_s"]]
    steady_press = [x["pressure"]["decode"] for x in timeline
                    if by["steady"]["start_s"] <= x["t"] <= by["steady"]["end_s"]]
    result = {
        "machine": machine(), "args": vars(a), "phases": phases, "changes": changes,
        "grew_after_step_up_s": None if grew is None else grew - by["step up"]["start_s"],
        "shrank_after_step_down_s": (None if shrank is None
                                     else shrank - by["step down"]["start_s"]),
        "changes_during_steady": steady,
        "steady_decode_pressure": ({"min": min(steady_press), "max": max(steady_press)}
                                   if steady_press else None),
        "requests_ok": clients.ok, "requests_failed": len(clients.errors),
        "errors": clients.errors[:50], "timeline": timeline, "exit_code": exit_code}
    print(f"\ndecode pool grew {result['grew_after_step_up_s']}s after the step up, shrank "
          f"{result['shrank_after_step_down_s']}s after the step down")
    print(f"requests: {clients.ok} ok, {len(clients.errors)} failed")
    print(f"steady {a.steady_s:.0f}s at {a.steady} clients: {len(steady)} scaling changes; "
          f"decode pressure {result['steady_decode_pressure']}")
    return result


if __name__ == "__main__":
    main()
