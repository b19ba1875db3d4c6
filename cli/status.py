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
import math
import os
import sys
import time
import urllib.request
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from baton.control.registry import WorkerRegistry


def state_file() -> Path:
    """Where ``baton up`` leaves the running cluster's addresses."""
    from baton import cache_dir

    return cache_dir() / "up.json"


def find_redis_url() -> str | None:
    """$BATON_REDIS_URL, else the Redis of a local ``baton up`` that is still running."""
    if os.environ.get("BATON_REDIS_URL"):
        return os.environ["BATON_REDIS_URL"]
    try:
        state = json.loads(state_file().read_text())
        os.kill(state["pid"], 0)
    except (OSError, ValueError, KeyError):
        return None
    return state["redis_url"]


# ---- scraping ------------------------------------------------------------------------------------

Samples = dict[tuple[str, tuple], float]  # (sample name, sorted label pairs) -> value


def parse_metrics(text: str) -> Samples:
    from prometheus_client.parser import text_string_to_metric_families

    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(address: str, tls=None, timeout: float = 2.0) -> Samples | None:
    """``http://address/metrics`` (https with ``tls``, an ``ssl.SSLContext``) parsed, or None
    when it does not answer."""
    if not address:
        return None
    url = f"{'https' if tls else 'http'}://{address}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=tls) as r:
            return parse_metrics(r.read().decode())
    except (OSError, ValueError):
        return None


def total(s: Samples | None, name: str, **labels) -> float | None:
    """Sum of ``name``'s samples whose labels include ``labels``."""
    if s is None:
        return None
    want = set(labels.items())
    vals = [v for (n, lab), v in s.items() if n == name and want <= set(lab)]
    return sum(vals) if vals else None


def buckets(s: Samples | None, name: str) -> list[tuple[float, float]]:
    """A histogram's cumulative buckets, ``[(upper bound, count), ...]`` ascending."""
    if s is None:
        return []
    out = [(float(dict(lab)["le"]), v) for (n, lab), v in s.items() if n == name + "_bucket"]
    return sorted(out)


def quantile(q: float, bks: list[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of a histogram, interpolated within its bucket (as Prometheus'
    ``histogram_quantile``); None without observations."""
    if not bks or bks[-1][1] <= 0:
        return None
    rank = q * bks[-1][1]
    lo_bound, lo_count = 0.0, 0.0
    for bound, count in bks:
        if count >= rank and count > lo_count:
            if math.isinf(bound):
                return lo_bound  # beyond the largest finite bucket: its bound
            return lo_bound + (bound - lo_bound) * (rank - lo_count) / (count - lo_count)
        lo_bound, lo_count = bound, count
    return lo_bound


def minus(a: Samples | None, b: Samples | None) -> Samples | None:
    """Counters and histograms of ``a`` since ``b`` (gauges are read from ``a`` alone)."""
    if a is None or b is None:
        return a
    return {k: v - b.get(k, 0.0) for k, v in a.items()}


# ---- the snapshot --------------------------------------------------------------------------------

@dataclass
class Node:
    kind: str  # router | prefill | decode | both
    id: str
    address: str
    metrics_address: str
    started_at: float
    model: str = ""
    tls: bool = False
    samples: Samples | None = None


@dataclass
class Snapshot:
    at: float
    redis_url: str
    nodes: list[Node] = field(default_factory=list)


def collect(registry: WorkerRegistry, redis_url: str, ssl_context=None) -> Snapshot:
    """Every registered process and its metrics; routers serving https are scraped with
    ``ssl_context`` (default: the system's trust)."""
    nodes = [Node("router", r.router_id, r.address, r.http_address, r.started_at, r.model,
                  r.tls) for r in registry.routers()]
    nodes += [Node(w.role, w.worker_id, w.address, w.metrics_address, w.started_at, w.model)
              for w in registry.workers()]

    def get(n: Node) -> Samples | None:
        if n.tls:
            import ssl

            return scrape(n.metrics_address, ssl_context or ssl.create_default_context())
        return scrape(n.metrics_address)

    with ThreadPoolExecutor(max(1, min(16, len(nodes)))) as ex:
        for node, samples in zip(nodes, ex.map(get, nodes)):
            node.samples = samples
    return Snapshot(time.time(), redis_url, nodes)


def summarize(cur: Snapshot, base: Snapshot | None = None) -> dict:
    """Per process and cluster-wide figures; counters and percentiles over ``cur`` minus
    ``base`` (the window), or since each process started without a base."""
    dt = cur.at - base.at if base else None
    prev = {n.id: n.samples for n in base.nodes} if base else {}
    out = {"at": cur.at, "redis_url": cur.redis_url, "window_s": dt, "routers": [],
           "workers": []}
    for n in cur.nodes:
        g = n.samples  # gauges: now
        c = minus(g, prev.get(n.id)) if base else g  # counters and histograms: the window
        row = {"id": n.id, "role": n.kind, "address": n.address, "model": n.model,
               "uptime_s": cur.at - n.started_at, "metrics": g is not None}
        if n.kind == "router":
            ok = total(c, "baton_router_requests_total", status="OK")
            allr = total(c, "baton_router_requests_total")
            row.update(
                requests=allr, errors=None if allr is None else allr - (ok or 0.0),
                remote=total(c, "baton_router_requests_total", path="remote"),
                local=total(c, "baton_router_requests_total", path="local"),
                rps=_rate(allr, dt),
                ttft=_pcts(c, "baton_time_to_first_token_seconds"),
                tpot=_pcts(c, "baton_time_per_output_token_seconds"),
                itl=_pcts(c, "baton_inter_token_latency_seconds"),
                index_up=total(g, "baton_prefix_index_up"))
            out["routers"].append(row)
        else:
            prompt = total(c, "baton_worker_prompt_tokens_total")
            hit = total(c, "baton_worker_prefix_hit_tokens_total")
            gen = total(c, "baton_worker_generated_tokens_total")
            row.update(
                running=total(g, "baton_worker_running_requests"),
                queued=total(g, "baton_worker_queue_depth"),
                kv_used=total(g, "baton_worker_kv_blocks_used"),
                kv_total=total(g, "baton_worker_kv_blocks_total"),
                prompt_tokens=prompt, hit_tokens=hit,
                hit_rate=hit / prompt if prompt else None,
                generated_tokens=gen, tokens_per_s=_rate(gen, dt),
                ttft=_pcts(c, "baton_worker_time_to_first_token_seconds"),
                transfer_bytes=total(c, "baton_kv_transfer_bytes_total"),
                transfer_failures=total(c, "baton_kv_transfer_failures_total"))
            out["workers"].append(row)
    ws = [w for w in out["workers"] if w["prompt_tokens"]]
    prompt = sum(w["prompt_tokens"] for w in ws)
    out["hit_rate"] = sum(w["hit_tokens"] or 0 for w in ws) / prompt if prompt else None
    return out


def _rate(count: float | None, dt: float | None) -> float | None:
    return None if count is None or not dt else count / dt


def _pcts(s: Samples | None, name: str) -> dict | None:
    bks = buckets(s, name)
    if not bks or bks[-1][1] <= 0:
        return None
    return {"count": bks[-1][1], **{f"p{int(q * 100)}": quantile(q, bks)
                                    for q in (0.5, 0.9, 0.99)}}


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
             f"(latencies and hit rates: {span})",
             "",
             f"{'ROUTER':<34} {'UP':>7} {'REQS':>6} {'ERR':>4} {'REMOTE':>6} {'LOCAL':>6} "
             f"{'REQ/S':>6} {'TTFT ms p50/90/99':>18} {'TPOT ms p50/90/99':>18} {'INDEX':>5}"]
    for r in summary["routers"]:
        if not r["metrics"]:
            lines.append(f"{r['id'][:34]:<34} {_age(r['uptime_s']):>7}  (no metrics: started "
                         "without --http-port, or unreachable)")
            continue
        idx = {None: "-", 1.0: "up", 0.0: "DOWN"}.get(r["index_up"], "?")
        lines.append(f"{r['id'][:34]:<34} {_age(r['uptime_s']):>7} {_n(r['requests']):>6} "
                     f"{_n(r['errors']):>4} {_n(r['remote']):>6} {_n(r['local']):>6} "
                     f"{_n(r['rps'], '{:.1f}'):>6} {_ms(r['ttft']):>18} {_ms(r['tpot']):>18} "
                     f"{idx:>5}")
    if not summary["routers"]:
        lines.append("(no router registered)")
    lines += ["", f"{'WORKER':<34} {'ROLE':<7} {'UP':>7} {'RUN':>4} {'QUEUE':>5} "
                  f"{'KV USED':>13} {'HIT':>5} {'TOK/S':>7} {'TTFT ms p50/90/99':>18} "
                  f"{'KV READ':>9}"]
    for r in summary["workers"]:
        if not r["metrics"]:
            lines.append(f"{r['id'][:34]:<34} {r['role']:<7} {_age(r['uptime_s']):>7}  "
                         "(no metrics: --metrics-port -1, or unreachable)")
            continue
        kv = "-"
        if r["kv_total"]:
            kv = f"{r['kv_used']:.0f}/{r['kv_total']:.0f} {100 * r['kv_used'] / r['kv_total']:.0f}%"
        hit = "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.0f}%"
        out_b = r["transfer_bytes"]
        lines.append(f"{r['id'][:34]:<34} {r['role']:<7} {_age(r['uptime_s']):>7} "
                     f"{_n(r['running']):>4} {_n(r['queued']):>5} {kv:>13} {hit:>5} "
                     f"{_n(r['tokens_per_s'], '{:.1f}'):>7} {_ms(r['ttft']):>18} "
                     f"{_bytes(out_b):>9}")
    if not summary["workers"]:
        lines.append("(no worker registered)")
    hr = summary["hit_rate"]
    by_role: dict[str, int] = {}
    for r in summary["workers"]:
        by_role[r["role"]] = by_role.get(r["role"], 0) + 1
    lines += ["", "workers: " + (", ".join(f"{v} {k}" for k, v in sorted(by_role.items()))
                                 or "none")
              + f"; routers: {len(summary['routers'])}; prefix-cache hit rate: "
              + ("-" if hr is None else f"{100 * hr:.1f}%")]
    return "\n".join(lines)


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
    import redis

    ctx = None
    if a.tls_ca:
        import ssl

        ctx = ssl.create_default_context(cafile=a.tls_ca)
    return WorkerRegistry(redis.Redis.from_url(url, socket_timeout=3,
                                               socket_connect_timeout=3)), url, ctx


def status(a: argparse.Namespace) -> int:
    from redis.exceptions import RedisError

    found = _registry(a)
    if found is None:
        return 2
    try:
        summary = summarize(collect(*found))
    except (RedisError, OSError) as e:
        print(f"error: Redis at {found[1]} did not answer: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=1) if a.json else render(summary))
    return 0


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
