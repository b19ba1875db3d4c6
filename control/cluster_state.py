"""The cluster's state, for ``baton status``, ``baton top`` and the autoscaler: the routers and
workers in the Redis registry, each one's ``/metrics`` scraped and summarized (load, KV usage,
prefix-cache hits, latency quantiles from the histograms), and where a local ``baton up`` leaves
its Redis address. Rendering is the CLI's (``baton.cli.status``).
"""

from __future__ import annotations

import json
import math
import os
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from baton.control.redis_client import redact
from baton.control.registry import WorkerRegistry


def state_file() -> Path:
    """Where this process, a ``baton up``, leaves its cluster's addresses: a file per ``baton
    up``, so each of several on one machine is found by its Redis URL."""
    return _states() / f"{os.getpid()}.json"


def _states() -> Path:
    from baton import cache_dir

    return cache_dir() / "up"


def process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot (/proc/PID/stat's 22nd field),
    or None when there is no such process: with the pid, it names one process, where a pid
    alone may be reused by another after it ends."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])


def _running_up(redis_url: str | None = None) -> dict:
    """The state a local ``baton up`` on ``redis_url`` left (None: the one started last), if
    that ``baton up`` still runs (else {}). The file of one that ended without removing it
    (SIGKILL, a power cut) is removed here: its pid no longer runs, or runs another process."""
    found = []
    for path in _states().glob("*.json"):
        try:
            state = json.loads(path.read_text())
            pid, born = state["pid"], state.get("process_start")
            os.kill(pid, 0)
            if born is not None and process_start(pid) != born:
                raise ProcessLookupError(pid)  # the pid was reused after that baton up ended
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            continue
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if redis_url is None or state.get("redis_url") == redis_url:
            found.append(state)
    return max(found, key=lambda st: st.get("started", 0.0), default={})


def up_restarts(redis_url: str) -> list[dict] | None:
    """The restarts of a local ``baton up`` serving on ``redis_url`` (what it supervises, and
    how often each was started again), or None when no such ``baton up`` runs."""
    state = _running_up(redis_url)
    return state.get("restarts") if state else None


def up_router_health(redis_url: str, timeout: float = 3.0) -> dict | None:
    """The ``/health`` of the router of a local ``baton up`` on ``redis_url`` (its view: workers
    that answer, how long Redis has been unreachable), or None without one that answers."""
    state = _running_up(redis_url)
    if not state.get("http"):
        return None
    import urllib.error

    try:
        with urllib.request.urlopen(f"http://{state['http']}/health", timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:  # 503: degraded, the body says why
        try:
            return json.loads(e.read())
        except ValueError:
            return None
    except (OSError, ValueError):
        return None


def up_secret(redis_url: str) -> str | None:
    """The cluster secret of a local ``baton up`` serving on ``redis_url`` (it makes one per
    cluster, hands it to its processes in their environment and keeps it in its state file,
    which its user only may read), or None when no such ``baton up`` runs."""
    return _running_up(redis_url).get("secret") or None


def find_redis_url() -> str | None:
    """$BATON_REDIS_URL, else the Redis of the local ``baton up`` started last that still
    runs."""
    if os.environ.get("BATON_REDIS_URL"):
        return os.environ["BATON_REDIS_URL"]
    return _running_up().get("redis_url")


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


def buckets(s: Samples | None, name: str, **labels) -> list[tuple[float, float]]:
    """A histogram's cumulative buckets, ``[(upper bound, count), ...]`` ascending (of the
    series whose labels include ``labels``, summed)."""
    if s is None:
        return []
    want = set(labels.items())
    out: dict[float, float] = {}
    for (n, lab), v in s.items():
        if n == name + "_bucket" and want <= set(lab):
            le = float(dict(lab)["le"])
            out[le] = out.get(le, 0.0) + v
    return sorted(out.items())


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
    ranks: str = ""  # a worker's tensor-parallel ranks and devices


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
    nodes += [Node(w.role, w.worker_id, w.address, w.metrics_address, w.started_at, w.model,
                   ranks=w.ranks) for w in registry.workers()]

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
    # the URL without its password: `baton status` prints this, and its JSON gets pasted
    out = {"at": cur.at, "redis_url": redact(cur.redis_url), "window_s": dt, "routers": [],
           "workers": []}
    for n in cur.nodes:
        g = n.samples  # gauges: now
        c = minus(g, prev.get(n.id)) if base else g  # counters and histograms: the window
        row = {"id": n.id, "role": n.kind, "address": n.address, "model": n.model,
               "uptime_s": cur.at - n.started_at, "metrics": g is not None, "ranks": n.ranks}
        if n.kind == "router":
            out["routers"].append({**row, **_router_figures(g, c, dt)})
        else:
            out["workers"].append({**row, **_worker_figures(g, c, dt)})
    ws = [w for w in out["workers"] if w["prompt_tokens"]]
    prompt = sum(w["prompt_tokens"] for w in ws)
    out["hit_rate"] = sum(w["hit_tokens"] or 0 for w in ws) / prompt if prompt else None
    return out


def _router_figures(g: Samples | None, c: Samples | None, dt: float | None) -> dict:
    """A router's figures: gauges ``g`` now, counters and histograms ``c`` over the window."""
    ok = total(c, "baton_router_requests_total", status="OK")
    allr = total(c, "baton_router_requests_total")
    return dict(
        requests=allr, errors=None if allr is None else allr - (ok or 0.0),
        remote=total(c, "baton_router_requests_total", path="remote"),
        local=total(c, "baton_router_requests_total", path="local"),
        rps=_rate(allr, dt),
        ttft=_pcts(c, "baton_time_to_first_token_seconds"),
        tpot=_pcts(c, "baton_time_per_output_token_seconds"),
        itl=_pcts(c, "baton_inter_token_latency_seconds"),
        # the time to first token less the router's queue and the decode-slot wait, and that
        # wait: the autoscaler's prefill and decode signals (control/autoscale.py)
        ttft_prefill_side=_pcts(c, "baton_ttft_prefill_side_seconds"),
        decode_wait=_pcts(c, "baton_ttft_phase_seconds", phase="decode_wait"),
        queued=total(g, "baton_router_queued"),
        decode_queued=total(g, "baton_router_decode_queued"),
        index_up=total(g, "baton_prefix_index_up"))


def _worker_figures(g: Samples | None, c: Samples | None, dt: float | None) -> dict:
    """A worker's figures: gauges ``g`` now, counters and histograms ``c`` over the window."""
    prompt = total(c, "baton_worker_prompt_tokens_total")
    hit = total(c, "baton_worker_prefix_hit_tokens_total")
    gen = total(c, "baton_worker_generated_tokens_total")
    return dict(
        running=total(g, "baton_worker_running_requests"),
        queued=total(g, "baton_worker_queue_depth"),
        kv_used=total(g, "baton_worker_kv_blocks_used"),
        kv_total=total(g, "baton_worker_kv_blocks_total"),
        prompt_tokens=prompt, hit_tokens=hit,
        hit_rate=hit / prompt if prompt else None,
        generated_tokens=gen, tokens_per_s=_rate(gen, dt),
        ttft=_pcts(c, "baton_worker_time_to_first_token_seconds"),
        transfer_bytes=total(c, "baton_kv_transfer_bytes_total"),
        transfer_failures=total(c, "baton_kv_transfer_failures_total"),
        tiers=_tier_figures(g, c))


def _tier_figures(g: Samples | None, c: Samples | None) -> dict:
    """Per KV tier (``--kv-host-tier-gb``, ``--kv-disk-tier-gb``): blocks now and capacity,
    and over the window hits, loads, load bandwidth, evictions, errors."""
    out = {}
    for tier in ("host", "disk"):
        cap = total(g, "baton_kv_tier_capacity", tier=tier)
        if cap is None:
            continue

        def count(name: str, tier: str = tier) -> float:
            return total(c, f"baton_kv_tier_{name}_total", tier=tier) or 0.0

        secs = count("load_seconds")
        out[tier] = dict(blocks=total(g, "baton_kv_tier_blocks", tier=tier), capacity=cap,
                         enabled=total(g, "baton_kv_tier_enabled", tier=tier),
                         hits=count("hits"), loads=count("loads"),
                         load_bandwidth=count("load_bytes") / secs if secs else None,
                         evictions=count("evictions"), errors=count("errors"),
                         corrupt=count("corrupt_blocks"),
                         cached_tokens=total(c, "baton_worker_cached_tokens_total", tier=tier))
    return out


def _rate(count: float | None, dt: float | None) -> float | None:
    return None if count is None or not dt else count / dt


def _pcts(s: Samples | None, name: str, **labels) -> dict | None:
    bks = buckets(s, name, **labels)
    if not bks or bks[-1][1] <= 0:
        return None
    return {"count": bks[-1][1], **{f"p{int(q * 100)}": quantile(q, bks)
                                    for q in (0.5, 0.9, 0.99)}}
