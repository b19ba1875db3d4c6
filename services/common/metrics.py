"""Prometheus metrics of Baton's processes (names in docs/metrics.md's table).

Workers serve theirs on ``--metrics-port`` (``/metrics``); the router adds its own to the
OpenAI HTTP front's ``/metrics``. Latency histograms share one set of buckets, from 5 ms to 60 s.
"""

from __future__ import annotations

import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Summary,
    generate_latest,
    start_http_server,
)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class WorkerMetrics:
    """One worker's metrics. ``observe_outputs`` is called on the engine thread with each step's
    outputs; the gauges read the engine when scraped."""

    def __init__(self, engine, role: str, agent=None) -> None:
        self.registry = r = CollectorRegistry()
        self.engine, self.role = engine, role
        stats = engine.stats
        if agent is not None:
            Gauge("baton_kv_pool_memory", "1, labelled with the engine's device and the KV "
                  "pool's memory as NIXL moves it (DRAM, VRAM, or staged through pinned host "
                  "memory).", ["device", "memory"], registry=r).labels(
                      engine.cfg.device, agent.memory).set(1)
            Gauge("baton_kv_staged_bytes", "Bytes copied between the KV pool and its pinned "
                  "host mirror for staged hand-offs (stays 0 unless the pool is staged).",
                  registry=r).set_function(lambda: agent.staged_bytes)
        Gauge("baton_worker_queue_depth", "Requests waiting in the engine's queue.",
              registry=r).set_function(lambda: stats().waiting)
        Gauge("baton_worker_running_requests", "Requests in the running batch.",
              registry=r).set_function(lambda: stats().running)
        Gauge("baton_worker_kv_blocks_free", "Free KV blocks (cached ones included).",
              registry=r).set_function(lambda: stats().free_blocks)
        Gauge("baton_worker_kv_blocks_used", "KV blocks held by requests.",
              registry=r).set_function(lambda: (s := stats()).total_blocks - s.free_blocks)
        Gauge("baton_worker_kv_blocks_quarantined", "KV blocks held back because a NIXL READ "
              "into them passed its deadline and could not be cancelled (freed when it ends).",
              registry=r).set_function(lambda: stats().quarantined_blocks)
        Gauge("baton_worker_kv_blocks_total", "KV blocks in the pool.",
              registry=r).set_function(lambda: stats().total_blocks)
        _vllm_gauges(r, engine, stats)
        self._add_counters(r)
        if getattr(engine, "tiers", None) is not None:
            r.register(TierCollector(engine.tiers))
        self._last: dict[str, float] = {}  # request id -> time of its last token

    def _add_counters(self, r: CollectorRegistry) -> None:
        self.requests = Counter("baton_worker_requests", "Requests ended, by finish reason.",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("baton_worker_prompt_tokens",
                                     "Prompt tokens admitted.", registry=r)
        self.cached_tokens = Counter("baton_worker_prefix_hit_tokens",
                                     "Prompt tokens served from the prefix cache.", registry=r)
        self.generated = Counter("baton_worker_generated_tokens", "Tokens sampled.",
                                 registry=r)
        self.ttft = Histogram("baton_worker_time_to_first_token_seconds",
                              "Arrival at this engine to its first token (queue included).",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("baton_worker_inter_token_seconds",
                             "Time between a request's consecutive tokens on this engine.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.transfer_bytes = Counter("baton_kv_transfer_bytes", "KV bytes read over NIXL.",
                                      registry=r)
        self.transfer_seconds = Histogram("baton_kv_transfer_seconds",
                                          "KV hand-off time (handshake + READ + release).",
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.transfer_failures = Counter("baton_kv_transfer_failures",
                                         "KV hand-offs that failed, by error.", ["error"],
                                         registry=r)
        self.tier_tokens = Counter("baton_worker_cached_tokens",
                                   "Prompt tokens reused, by where their KV was: pool, host, "
                                   "disk (the last two loaded back from a KV tier).", ["tier"],
                                   registry=r)

    def observe_outputs(self, outputs) -> None:
        now = time.monotonic()
        for out in outputs:
            rid = out.request_id
            if out.new_token_ids:
                self.generated.inc(len(out.new_token_ids))
                last = self._last.get(rid)
                if last is None:
                    if out.first_token_s is not None and out.num_output_tokens == 1:
                        self.ttft.observe(out.first_token_s)
                    self.prompt_tokens.inc(out.num_prompt_tokens)
                    self.cached_tokens.inc(out.num_cached_tokens)
                    for tier, n in (out.cached_tokens_by_tier or {}).items():
                        if n:
                            self.tier_tokens.labels(tier).inc(n)
                else:
                    self.itl.observe(now - last)
                self._last[rid] = now
            if out.finished:
                self._last.pop(rid, None)
                self.requests.labels(out.finish_reason or "unknown").inc()

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics on ``port`` (0: a free one); returns the port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server.server_address[1]


def _vllm_gauges(r: CollectorRegistry, engine, stats) -> None:
    """The same load under vLLM's names and label, for KEDA scalers, HPAs and dashboards written
    for vLLM (Baton's own names above stay): waiting and running requests, and the KV pool's
    used fraction (0 to 1, as vLLM's ``kv_cache_usage_perc`` is; cached free blocks count as
    free)."""
    name = getattr(getattr(engine, "model_info", None), "name", "") or ""
    Gauge("vllm:num_requests_waiting", "Requests waiting in the engine's queue (vLLM's name).",
          ["model_name"], registry=r).labels(name).set_function(lambda: stats().waiting)
    Gauge("vllm:num_requests_running", "Requests in the running batch (vLLM's name).",
          ["model_name"], registry=r).labels(name).set_function(lambda: stats().running)
    Gauge("vllm:kv_cache_usage_perc", "Fraction of the KV pool held by requests, 0 to 1 "
          "(vLLM's name).", ["model_name"], registry=r).labels(name).set_function(
              lambda: 1.0 - (s := stats()).free_blocks / max(s.total_blocks, 1))


class TierCollector:
    """The KV tiers' counters (``baton.engine.kv_tiers.TierStats``), read when scraped."""

    GAUGES = (("blocks", "Blocks the tier holds."), ("capacity", "Blocks the tier can hold."),
              ("enabled", "1 while the tier works, 0 after an I/O error turned it off."))
    COUNTERS = (("stored", "stored", "Blocks written into the tier."),
                ("hits", "hits", "Blocks loaded back from the tier into the KV pool."),
                ("loads", "loads", "Load operations (one per request's run of tier blocks)."),
                ("load_bytes", "load_bytes", "Bytes loaded back into the KV pool."),
                ("load_s", "load_seconds", "Seconds spent loading (the load bandwidth is "
                 "load_bytes / load_seconds)."),
                ("evictions", "evictions", "Blocks the tier dropped for room (LRU)."),
                ("errors", "errors", "I/O errors (the disk tier turns off on the first)."),
                ("corrupt", "corrupt_blocks", "Blocks whose checksum or hash did not match "
                 "when loaded (dropped, computed instead)."),
                ("dropped", "dropped_blocks", "Evicted blocks not stored: the writer was "
                 "behind, or the tier is off."))

    def __init__(self, tiers) -> None:
        self.tiers = tiers

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.tiers.stats()
        for name, doc in self.GAUGES:
            g = GaugeMetricFamily(f"baton_kv_tier_{name}", doc, labels=["tier"])
            for tier, st in stats.items():
                g.add_metric([tier], float(getattr(st, name)))
            yield g
        for attr, name, doc in self.COUNTERS:
            c = CounterMetricFamily(f"baton_kv_tier_{name}", doc, labels=["tier"])
            for tier, st in stats.items():
                c.add_metric([tier], float(getattr(st, attr)))
            yield c


# the phases of a request's time to first token, as the router measures them (Timing fields)
TTFT_PHASES = {
    "admission": "waiting for a router slot, --max-concurrent",
    "decode_wait": "waiting for a decode worker with room in its batch",
    "route": "the routing decision",
    "prefill_queue": "the prefill worker's queue",
    "prefill": "the prefill worker's compute",
    "transfer": "the KV hand-off",
}


def ttft_phases(t) -> dict[str, float]:
    """A final message's Timing split into :data:`TTFT_PHASES`."""
    return {"admission": t.admission_wait_s, "decode_wait": t.decode_wait_s,
            "route": t.route_s, "prefill_queue": t.queue_s,
            "prefill": max(t.prefill_s - t.queue_s, 0.0), "transfer": t.transfer_s}


class RouterMetrics:
    """The router's request latencies, as clients see them (both APIs), and its routing
    decisions; ``index`` (a PrefixIndex, or None) adds the index's availability, ``admission``
    and ``decode_queue`` their queues' lengths."""

    def __init__(self, index=None, admission=None, decode_queue=None) -> None:
        self.registry = r = CollectorRegistry()
        self._queues(admission, decode_queue)
        self.decisions = Counter("baton_route_decisions", "Routing decisions by path and reason.",
                                 ["path", "reason"], registry=r)
        self.index_cached = Counter("baton_route_index_cached_tokens",
                                    "Prompt tokens the prefix index found on the chosen "
                                    "prefilling worker.", registry=r)
        self.without_index = Counter("baton_route_without_index",
                                     "Requests routed on load only.", registry=r)
        self.decision_s = Summary("baton_route_decision_seconds",
                                  "Routing decision time (block hashing + Redis).", registry=r)
        if index is not None:
            Gauge("baton_prefix_index_up", "1 while the Redis prefix index answers.",
                  registry=r).set_function(lambda: int(index.available))
            Gauge("baton_prefix_index_outages_total", "Times the Redis prefix index became "
                  "unreachable.", registry=r).set_function(lambda: index.num_outages)
        self.ttft = Histogram("baton_time_to_first_token_seconds",
                              "Request start at the router to the first token sent.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("baton_time_per_output_token_seconds",
                              "(last token - first token) / (tokens - 1), per request.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("baton_inter_token_latency_seconds",
                             "Gap between consecutive streamed chunks.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("baton_e2e_request_seconds", "Request start to its final message.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("baton_router_requests", "Requests ended, by path and status.",
                                ["path", "status"], registry=r)
        self.cached = Counter("baton_router_cached_prompt_tokens",
                              "Prompt tokens the workers served from their prefix caches.",
                              registry=r)
        self.prompt = Counter("baton_router_prompt_tokens", "Prompt tokens routed.", registry=r)
        self.migrations = Counter("baton_router_migrations", "Requests moved to another decode "
                                  "worker after tokens were streamed (theirs failed).",
                                  registry=r)
        self.phase = Histogram("baton_ttft_phase_seconds", "Where each request's time to "
                               "first token went: " + ", ".join(
                                   f"{k} ({v})" for k, v in TTFT_PHASES.items()) + ".",
                               ["phase"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft_prefill_side = Histogram(
            "baton_ttft_prefill_side_seconds", "Time to first token less the router's queue "
            "and the decode-slot wait: what routing, the prefill worker (queue and compute), "
            "the hand-off and the first step took. The autoscaler's prefill signal.",
            buckets=LATENCY_BUCKETS, registry=r)

    def _queues(self, admission, decode_queue) -> None:
        r = self.registry
        if admission is not None:
            Gauge("baton_router_queued", "Requests waiting for a slot (--max-concurrent).",
                  registry=r).set_function(lambda: admission.stats()["waiting"])
        if decode_queue is not None:
            Gauge("baton_router_decode_queued", "Requests waiting for a decode worker with "
                  "room in its running batch (every one runs its --max-num-seqs).",
                  registry=r).set_function(decode_queue.waiting)
            Gauge("baton_router_decode_queue_refused_total", "Requests refused because "
                  "--max-queued already waited for a decode slot.",
                  registry=r).set_function(lambda: decode_queue.refused)

    def routed(self, d) -> None:
        """One routing decision (baton.services.router.routing.Decision)."""
        self.decisions.labels(d.path, d.reason).inc()
        self.index_cached.inc(d.cached_tokens)
        if not d.used_index:
            self.without_index.inc()
        self.decision_s.observe(d.decide_s)

    def finished(self, final) -> None:
        t, u = final.timing, final.usage
        self.ttft.observe(t.first_token_s)
        for phase, secs in ttft_phases(t).items():
            self.phase.labels(phase).observe(secs)
        self.ttft_prefill_side.observe(
            max(t.first_token_s - t.admission_wait_s - t.decode_wait_s, 0.0))
        self.e2e.observe(t.total_s)
        if u.completion_tokens > 1:
            self.tpot.observe(t.decode_s / (u.completion_tokens - 1))
        self.requests.labels(final.path or "none", "OK").inc()
        self.prompt.inc(u.prompt_tokens)
        self.cached.inc(u.cached_tokens)

    def failed(self, code: str) -> None:
        self.requests.labels("none", code).inc()

    def render(self) -> str:
        return generate_latest(self.registry).decode()
