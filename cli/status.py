"""``baton status`` and ``baton top``: the cluster at a glance, from Redis and the metrics.

Routers and workers are listed from the Redis registry; each one's ``/metrics`` (Prometheus
text) is scraped for load, KV usage, prefix-cache hits and latencies. ``status`` prints once,
with latencies and hit rates since each process started; ``top`` redraws every ``--interval``
seconds with them over the last ``--window`` seconds, plus throughput. Without ``--redis-url``
both find the cluster a local ``baton up`` runs (it leaves its address in the cache folder).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque

from baton.control.cluster_state import (
    Snapshot,
    collect,
    find_redis_url,
    summarize,
    up_restarts,
    up_router_health,
)
from baton.control.redis_client import redact
from baton.control.registry import WorkerRegistry

# ---- rendering -----------------------------------------------------------------------------------

def _ms(p: dict | None, keys=("p50", "p90", "p99")) -> str:
    if not p:
        return "-"
    return "/".join(f"{p[k] * 1000:.0f}" for k in keys)


def _n(v, fmt="{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def _age(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def render(summary: dict) -> str:
    w = summary["window_s"]
    span = f"last {w:.0f}s" if w else "since start"
    t = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(summary["at"]))
    models = sorted({r["model"] for r in summary["routers"] + summary["workers"] if r["model"]})
    lines = [f"Baton  {summary['redis_url']}  {', '.join(models) or '?'}  {t}  "
             f"(latencies and hit rates: {span})", ""]
    lines += _router_lines(summary["routers"]) + [""] + _worker_lines(summary["workers"])
    hr = summary["hit_rate"]
    by_role: dict[str, int] = {}
    for r in summary["workers"]:
        by_role[r["role"]] = by_role.get(r["role"], 0) + 1
    lines += ["", "workers: " + (", ".join(f"{v} {k}" for k, v in sorted(by_role.items()))
                                 or "none")
              + f"; routers: {len(summary['routers'])}; prefix-cache hit rate: "
              + ("-" if hr is None else f"{100 * hr:.1f}%")]
    restarted = [r for r in summary.get("restarts") or () if r["restarts"]]
    if summary.get("restarts") is not None:  # a local `baton up` supervises this cluster
        lines.append("baton up restarts: " + (", ".join(
            f"{r['what']} {r['worker_id'] or '(starting)'} x{r['restarts']}"
            for r in restarted) or "none"))
    return "\n".join(lines)


def _unmeasured(r: dict, role: str, why: str) -> str:
    """A process's row when its /metrics could not be read."""
    return f"{r['id'][:34]:<34} {role}{_age(r['uptime_s']):>7}  (no metrics: {why}, or unreachable)"


def _router_lines(routers: list[dict]) -> list[str]:
    lines = [f"{'ROUTER':<34} {'UP':>7} {'REQS':>6} {'ERR':>4} {'REMOTE':>6} {'LOCAL':>6} "
             f"{'REQ/S':>6} {'TTFT ms p50/90/99':>18} {'TPOT ms p50/90/99':>18} {'INDEX':>5}"]
    for r in routers:
        if not r["metrics"]:
            lines.append(_unmeasured(r, "", "started without --http-port"))
            continue
        idx = {None: "-", 1.0: "up", 0.0: "DOWN"}.get(r["index_up"], "?")
        lines.append(f"{r['id'][:34]:<34} {_age(r['uptime_s']):>7} {_n(r['requests']):>6} "
                     f"{_n(r['errors']):>4} {_n(r['remote']):>6} {_n(r['local']):>6} "
                     f"{_n(r['rps'], '{:.1f}'):>6} {_ms(r['ttft']):>18} {_ms(r['tpot']):>18} "
                     f"{idx:>5}")
    return lines if routers else lines + ["(no router registered)"]


def _worker_lines(workers: list[dict]) -> list[str]:
    lines = [f"{'WORKER':<34} {'ROLE':<7} {'UP':>7} {'RUN':>4} {'QUEUE':>5} "
             f"{'KV USED':>13} {'HIT':>5} {'TOK/S':>7} {'TTFT ms p50/90/99':>18} "
             f"{'KV READ':>9}"]
    for r in workers:
        if not r["metrics"]:
            lines.append(_unmeasured(r, f"{r['role']:<7} ", "--metrics-port -1"))
            continue
        kv = "-"
        if r["kv_total"]:
            kv = f"{r['kv_used']:.0f}/{r['kv_total']:.0f} {100 * r['kv_used'] / r['kv_total']:.0f}%"
        hit = "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.0f}%"
        lines.append(f"{r['id'][:34]:<34} {r['role']:<7} {_age(r['uptime_s']):>7} "
                     f"{_n(r['running']):>4} {_n(r['queued']):>5} {kv:>13} {hit:>5} "
                     f"{_n(r['tokens_per_s'], '{:.1f}'):>7} {_ms(r['ttft']):>18} "
                     f"{_bytes(r['transfer_bytes']):>9}")
        if r.get("ranks"):
            lines.append(f"  {r['ranks']}")
        for tier, t in (r.get("tiers") or {}).items():
            bw = "-" if not t["load_bandwidth"] else _bytes(t["load_bandwidth"]) + "/s"
            off = "" if t["enabled"] != 0 else "  OFF (I/O error, see its log)"
            lines.append(f"  {tier} tier: {_n(t['blocks'])}/{_n(t['capacity'])} blocks, "
                         f"{t['hits']:.0f} hits ({_n(t['cached_tokens'])} tokens) in "
                         f"{t['loads']:.0f} loads at {bw}, {t['evictions']:.0f} evictions, "
                         f"{t['errors']:.0f} errors, {t['corrupt']:.0f} corrupt{off}")
    return lines if workers else lines + ["(no worker registered)"]


def _bytes(b: float | None) -> str:
    if not b:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if b < 1024 or unit == "TiB":
            return f"{b:.0f}{unit}" if unit == "B" else f"{b:.1f}{unit}"
        b /= 1024
    return "-"


# ---- commands ------------------------------------------------------------------------------------

def add_args(ap: argparse.ArgumentParser, top: bool) -> None:
    ap.add_argument("--redis-url", default=None,
                    help="the cluster's Redis (default $BATON_REDIS_URL, else the local "
                         "`baton up` cluster's)")
    ap.add_argument("--tls-ca", default=None,
                    help="PEM CA certificate to trust for routers serving https")
    if top:
        ap.add_argument("--interval", type=float, default=2.0,
                        help="seconds between refreshes (default 2)")
        ap.add_argument("--window", type=float, default=30.0,
                        help="latency percentiles, hit rates and rates over the last this many "
                             "seconds (default 30)")
        ap.add_argument("--iterations", type=int, default=0,
                        help="stop after this many refreshes (default 0: until Ctrl-C)")
    else:
        ap.add_argument("--json", action="store_true", help="print the figures as JSON")


def _registry(a: argparse.Namespace) -> tuple | None:
    """(registry, Redis URL, SSL context) for ``collect``, or None (said why)."""
    url = a.redis_url or find_redis_url()
    if not url:
        print("error: no cluster found: pass --redis-url (or set BATON_REDIS_URL), or start one "
              "with `baton up`", file=sys.stderr)
        return None
    from baton.control.redis_client import connect

    ctx = None
    if a.tls_ca:
        import ssl

        ctx = ssl.create_default_context(cafile=a.tls_ca)
    return WorkerRegistry(connect(url, socket_timeout=3)), url, ctx


def status(a: argparse.Namespace) -> int:
    from redis.exceptions import RedisError

    found = _registry(a)
    if found is None:
        return 2
    try:
        summary = summarize(collect(*found))
    except (RedisError, OSError) as e:
        return _redis_down(found[1], e, a.json)
    summary["restarts"] = up_restarts(found[1])
    print(json.dumps(summary, indent=1) if a.json else render(summary))
    return 0


def _redis_down(url: str, e: Exception, as_json: bool) -> int:
    """Redis does not answer: say so, with what the local ``baton up``'s router still sees
    (the workers that answer it, how long it has been without Redis, its restarts)."""
    health = up_router_health(url)
    restarts = up_restarts(url)
    if as_json:
        print(json.dumps({"redis": {"url": redact(url), "reachable": False, "error": str(e)},
                          "router_health": health, "restarts": restarts}, indent=1))
        return 1
    print(f"Redis at {redact(url)}: DOWN ({e})")
    if health is None:
        print("no router of a local `baton up` answered either", file=sys.stderr)
        return 1
    down = health.get("registry", {}).get("unreachable_for_s")
    print(f"router: {health.get('status')}" + (f", without Redis for {down:.0f}s"
                                               if down is not None else "")
          + f"; workers answering it: {health.get('workers', {})}")
    for reason in health.get("reasons", []):
        print(f"  {reason}")
    for r in restarts or ():
        if r["what"] == "redis-server":
            print(f"baton up has restarted redis-server {r['restarts']} time(s)")
    return 1


def top(a: argparse.Namespace) -> int:
    from redis.exceptions import RedisError

    found = _registry(a)
    if found is None:
        return 2
    history: deque[Snapshot] = deque()
    n = 0
    try:
        while True:
            try:
                snap = collect(*found)
            except (RedisError, OSError) as e:
                print(f"error: Redis at {found[1]} did not answer: {e}", file=sys.stderr)
                return 1
            history.append(snap)
            while len(history) > 1 and snap.at - history[1].at >= a.window:
                history.popleft()
            base = history[0] if len(history) > 1 else None
            tty = sys.stdout.isatty()
            sys.stdout.write(("\x1b[H\x1b[2J" if tty else "") + render(summarize(snap, base))
                             + "\n" + ("" if tty else "\n"))
            sys.stdout.flush()
            n += 1
            if a.iterations and n >= a.iterations:
                return 0
            time.sleep(a.interval)
    except KeyboardInterrupt:
        return 0
