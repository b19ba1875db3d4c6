"""``baton status``'s arithmetic on real Prometheus exposition text: percentiles from histogram
buckets, windows as differences of two scrapes, hit rates, and the table for processes whose
metrics are missing. The command against a live cluster is in tests/integration/test_routing.py.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from baton.cli import status
from baton.control import cluster_state
from baton.services.common.metrics import LATENCY_BUCKETS
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


def _worker_registry():
    r = CollectorRegistry()
    h = Histogram("baton_worker_time_to_first_token_seconds", "x", buckets=LATENCY_BUCKETS,
                  registry=r)
    prompt = Counter("baton_worker_prompt_tokens", "x", registry=r)
    hit = Counter("baton_worker_prefix_hit_tokens", "x", registry=r)
    gen = Counter("baton_worker_generated_tokens", "x", registry=r)
    Gauge("baton_worker_kv_blocks_used", "x", registry=r).set(30)
    Gauge("baton_worker_kv_blocks_total", "x", registry=r).set(120)
    Gauge("baton_worker_running_requests", "x", registry=r).set(2)
    Gauge("baton_worker_queue_depth", "x", registry=r).set(1)
    return r, h, prompt, hit, gen


def _scrape(r) -> cluster_state.Samples:
    return cluster_state.parse_metrics(generate_latest(r).decode())


def test_quantiles_from_buckets_land_in_the_true_bucket():
    r, h, *_ = _worker_registry()
    rng = random.Random(0)
    xs = sorted(rng.lognormvariate(-3, 1) for _ in range(2000))
    for x in xs:
        h.observe(x)
    bks = cluster_state.buckets(_scrape(r), "baton_worker_time_to_first_token_seconds")
    assert bks[-1][1] == 2000
    bounds = (0.0, *LATENCY_BUCKETS)
    for q in (0.5, 0.9, 0.99):
        est, true = cluster_state.quantile(q, bks), xs[int(q * len(xs))]
        # the estimate lies in the bucket holding the true quantile
        i = next(i for i, b in enumerate(LATENCY_BUCKETS) if true <= b)
        assert bounds[i] <= est <= bounds[i + 1], (q, est, true)
    assert cluster_state.quantile(0.5, []) is None
    assert cluster_state.quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None
    # all beyond the largest finite bucket: its bound, not infinity
    assert cluster_state.quantile(0.9, [(0.1, 0.0), (60.0, 0.0), (float("inf"), 5.0)]) == 60.0


def test_a_window_counts_only_what_happened_in_it():
    r, h, prompt, hit, gen = _worker_registry()
    for _ in range(10):
        h.observe(5.0)  # slow, before the window
    prompt.inc(100)
    gen.inc(50)
    node = cluster_state.Node("prefill", "p1", "127.0.0.1:1", "127.0.0.1:2", started_at=0.0)
    before = cluster_state.Snapshot(1000.0, "redis://x", [cluster_state.Node(**{**node.__dict__,
                                                                   "samples": _scrape(r)})])
    for _ in range(10):
        h.observe(0.02)  # fast, in the window
    prompt.inc(100)
    hit.inc(75)
    gen.inc(40)
    now = cluster_state.Snapshot(1010.0, "redis://x", [cluster_state.Node(**{**node.__dict__,
                                                                "samples": _scrape(r)})])
    (w,) = cluster_state.summarize(now, before)["workers"]
    assert w["ttft"]["count"] == 10 and w["ttft"]["p99"] <= 0.025
    assert w["hit_rate"] == pytest.approx(0.75) and w["tokens_per_s"] == pytest.approx(4.0)
    assert (w["kv_used"], w["kv_total"], w["running"], w["queued"]) == (30, 120, 2, 1)
    (w,) = cluster_state.summarize(now)["workers"]  # since start
    assert w["ttft"]["count"] == 20 and w["hit_rate"] == pytest.approx(75 / 200)
    assert w["tokens_per_s"] is None


def test_the_table_names_processes_without_metrics():
    nodes = [cluster_state.Node("router", "router-a", "h:1", "", 0.0, "m"),
             cluster_state.Node("decode", "decode-a", "h:2", "h:3", 0.0, "m")]
    text = status.render(cluster_state.summarize(cluster_state.Snapshot(100.0, "redis://x", nodes)))
    assert "router-a" in text and "no metrics" in text and "decode-a" in text
    assert "1 decode; routers: 1" in text


def test_the_redis_password_is_not_printed():
    # `baton status` (text and --json) shows the cluster's Redis, never its password
    nodes = [cluster_state.Node("router", "router-a", "h:1", "", 0.0, "m")]
    summary = cluster_state.summarize(cluster_state.Snapshot(
        100.0, "redis://:s3cret-pw@10.0.0.5:6379/0", nodes))
    text, as_json = status.render(summary), json.dumps(summary)
    for out in (text, as_json):
        assert "s3cret-pw" not in out and "redis://:***@10.0.0.5:6379/0" in out


def test_a_worker_with_kv_tiers_shows_a_line_per_tier():
    from baton.engine.kv_tiers import TierStats, TierStore
    from baton.services.common.metrics import TierCollector

    r = CollectorRegistry()
    Counter("baton_worker_prompt_tokens", "", registry=r).inc(100)
    Counter("baton_worker_prefix_hit_tokens", "", registry=r).inc(48)
    Counter("baton_worker_cached_tokens", "", ["tier"], registry=r).labels("disk").inc(48)
    disk = TierStats(capacity=500, blocks=120, stored=130, hits=3, loads=1,
                     load_bytes=3 << 20, load_s=0.002, evictions=10)

    class Store(TierStore):
        def __init__(self):
            pass

        def stats(self):
            return {"disk": disk}

    r.register(TierCollector(Store()))
    node = cluster_state.Node("prefill", "p1", "h:1", "h:2", 0.0, "m", samples=_scrape(r))
    summary = cluster_state.summarize(cluster_state.Snapshot(100.0, "redis://x", [node]))
    (w,) = summary["workers"]
    t = w["tiers"]["disk"]
    assert (t["blocks"], t["capacity"], t["hits"], t["loads"], t["evictions"]) == (
        120, 500, 3, 1, 10)
    assert t["load_bandwidth"] == pytest.approx((3 << 20) / 0.002)
    assert t["cached_tokens"] == 48 and t["enabled"] == 1
    text = status.render(summary)
    assert "disk tier: 120/500 blocks, 3 hits (48 tokens) in 1 loads at 1.5GiB/s" in text


def test_a_baton_up_that_ended_without_cleaning_up_is_not_found_and_its_file_goes(
        tmp_path, monkeypatch):
    """`baton status`, `baton role` and `baton tune --live` find a local `baton up` by the
    state file it leaves. One killed by SIGKILL leaves its file: a dead pid, or a pid the
    system gave to another process since (told apart by the process's start time), is not that
    `baton up`, and its file is removed; a live one's is read, an older file without a start
    time by its pid alone."""
    import subprocess
    import sys

    from baton.control.cluster_state import find_redis_url, process_start, up_secret

    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("BATON_REDIS_URL", raising=False)
    states = tmp_path / "up"
    states.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    me, born = os.getpid(), process_start(os.getpid())
    assert born is not None and process_start(gone.pid) is None

    def leave(name: str, pid: int, url: str, started: float, **extra) -> Path:
        path = states / f"{name}.json"
        path.write_text(json.dumps({"pid": pid, "started": started, "redis_url": url,
                                    "secret": f"s-{name}", **extra}))
        return path

    live = leave("live", me, "redis://127.0.0.1:1", 1.0, process_start=born)
    older = leave("older", me, "redis://127.0.0.1:2", 2.0)
    dead = leave("dead", gone.pid, "redis://127.0.0.1:3", 3.0, process_start=born)
    reused = leave("reused", me, "redis://127.0.0.1:4", 4.0, process_start=born - 1)
    # the newest that still runs: the pid-only file of 2.0, not the dead or reused ones after it
    assert find_redis_url() == "redis://127.0.0.1:2"
    assert up_secret("redis://127.0.0.1:1") == "s-live"
    assert up_secret("redis://127.0.0.1:4") is None
    assert live.exists() and older.exists() and not dead.exists() and not reused.exists()
