"""Autoscaling per pool: a policy turns SLO signals into desired replica counts, an actuator
carries them out (local processes, Ray actors, Kubernetes Deployments).

Signals, per window (router-measured, so queue wait counts)::

    prefill pressure = max(TTFT' p90 / TTFT SLO, prefill queue per worker / queue target)
    decode pressure  = max(TPOT p90 / TPOT SLO, KV blocks used / KV target,
                           decode-slot wait p90 / TTFT SLO, decode queue per worker / queue target)
                       (and TTFT p90 / TTFT SLO when there is no prefill pool: colocated)

TTFT' is the time to first token less the router's own queue and the wait for a decode slot
(``baton_ttft_prefill_side_seconds``): a request that waited because every decode worker's
batch was full has a long TTFT, and that wait is the decode pool's, so it counts there, never
against the prefill pool. The queues are requests waiting per worker: the prefill workers'
engine queues; the routers' decode queues plus the decode workers' engine queues.

A pool's pressure against the policy's band, with ``now`` the policy's clock::

    p > up_at, up cooldown passed          -> grow to cur + max(1, ceil(cur * (p/up_at - 1)))
    p * cur/(cur-1) < down_at for down_after_s,
      down cooldown passed                 -> shrink by one (drained, never killed)
    otherwise (the hysteresis band)        -> no change; resets the low clock

A pool shrinks only when its pressure, spread over one replica fewer, would still be below
``down_at``: a 2-replica pool at pressure 0.36 stays (it would be 0.72 on one, and in practice
more: a slower pool holds each request's blocks longer). Without that rule a steady load at
pressure ~0.4 on 2 replicas flapped 2 -> 1 -> 2 within 25 s (bench/results/
autoscale-20261123T0704Z-flap-log.txt). So steady load inside the band never changes anything,
and a pool shrinks one replica at a time, after pressure stayed low for a while. A window
without traffic has pressure 0.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger("baton.control.autoscale")

POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class PoolPolicy:
    min_replicas: int = 1
    max_replicas: int = 4
    up_at: float = 1.0  # pressure above which the pool grows
    down_at: float = 0.5  # pressure below which it may shrink (the band between: no change)
    up_cooldown_s: float = 20.0  # since this pool's last change
    down_cooldown_s: float = 60.0
    down_after_s: float = 30.0  # pressure must stay below down_at this long

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"replicas: want 0 <= min ({self.min_replicas}) <= max "
                             f"({self.max_replicas})")
        if not 0 < self.down_at < self.up_at:
            raise ValueError(f"want 0 < down_at ({self.down_at}) < up_at ({self.up_at})")
        for name in ("up_cooldown_s", "down_cooldown_s", "down_after_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 2.0
    tpot_s: float = 0.1
    kv_usage: float = 0.85  # decode pool: share of KV blocks in use that counts as full
    queue: float = 4.0  # requests waiting per worker that count as full (either pool)


@dataclass(frozen=True)
class Signals:
    """One window of measurements; None where nothing was measured (no traffic)."""

    ttft_p90_s: float | None = None  # at the router: includes every queue
    tpot_p90_s: float | None = None
    kv_usage: float | None = None  # decode pool: used / total blocks
    requests: float = 0.0  # requests that ended in the window
    # the phase split: TTFT less the router's queue and the decode-slot wait, and that wait
    prefill_ttft_p90_s: float | None = None
    decode_wait_p90_s: float | None = None
    # requests waiting per worker, now: prefill workers' queues; routers' decode queues and
    # decode workers' queues
    prefill_queue: float | None = None
    decode_queue: float | None = None


def pressures(s: Signals, slo: SLO, has_prefill_pool: bool) -> dict[str, float]:
    def ratio(x: float | None, target: float) -> float:
        return 0.0 if x is None else x / target

    ttft = ratio(s.ttft_p90_s, slo.ttft_s)
    decode = max(ratio(s.tpot_p90_s, slo.tpot_s), ratio(s.kv_usage, slo.kv_usage),
                 ratio(s.decode_wait_p90_s, slo.ttft_s), ratio(s.decode_queue, slo.queue))
    if not has_prefill_pool:
        return {"decode": max(decode, ttft, ratio(s.prefill_queue, slo.queue))}
    # a router without the phase split (an older one): its whole TTFT
    prefill_ttft = ttft if s.prefill_ttft_p90_s is None else ratio(s.prefill_ttft_p90_s,
                                                                   slo.ttft_s)
    return {"prefill": max(prefill_ttft, ratio(s.prefill_queue, slo.queue)), "decode": decode}


@dataclass
class Decision:
    pool: str
    current: int
    desired: int
    pressure: float
    reason: str

    @property
    def changes(self) -> bool:
        return self.desired != self.current


@dataclass
class _PoolState:
    last_change: float = -math.inf
    low_since: float | None = None


class Policy:
    """Desired replicas per pool from :class:`Signals`. Keeps per-pool timers (cooldowns, how
    long pressure has been low); ``decide`` is called once per tick with the current counts."""

    def __init__(self, pools: dict[str, PoolPolicy], slo: SLO,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pools, self.slo, self.clock = pools, slo, clock
        self._state = {name: _PoolState() for name in pools}

    def decide(self, s: Signals, current: dict[str, int]) -> list[Decision]:
        now = self.clock()
        press = pressures(s, self.slo, "prefill" in self.pools)
        return [self._one(name, pol, press.get(name, 0.0), current[name], now)
                for name, pol in self.pools.items()]

    def _one(self, name: str, pol: PoolPolicy, p: float, cur: int, now: float) -> Decision:
        st = self._state[name]
        if cur < pol.min_replicas or cur > pol.max_replicas:
            return self._change(st, now, Decision(name, cur, min(max(cur, pol.min_replicas),
                                                               pol.max_replicas), p,
                                                  "outside min/max"))
        if p > pol.up_at:
            st.low_since = None
            if cur >= pol.max_replicas:
                return Decision(name, cur, cur, p, "at max")
            if now - st.last_change < pol.up_cooldown_s:
                return Decision(name, cur, cur, p, "up cooldown")
            step = max(1, math.ceil(cur * (p / pol.up_at - 1)))
            return self._change(st, now, Decision(name, cur, min(pol.max_replicas, cur + step),
                                                  p, f"pressure {p:.2f} > {pol.up_at:g}"))
        if cur > pol.min_replicas and p * cur / (cur - 1) >= pol.down_at or p >= pol.down_at:
            st.low_since = None  # (one fewer would not be low: no shrink, and no flap back)
            return Decision(name, cur, cur, p, "in band")
        st.low_since = now if st.low_since is None else st.low_since
        if cur <= pol.min_replicas:
            return Decision(name, cur, cur, p, "at min")
        if now - st.low_since < pol.down_after_s:
            return Decision(name, cur, cur, p, "low, waiting")
        if now - st.last_change < pol.down_cooldown_s:
            return Decision(name, cur, cur, p, "down cooldown")
        st.low_since = now  # the next step down needs its own low period
        return self._change(st, now, Decision(name, cur, cur - 1, p,
                                              f"pressure {p:.2f} ({p * cur / (cur - 1):.2f} on "
                                              f"{cur - 1}) < {pol.down_at:g} for "
                                              f"{pol.down_after_s:g}s"))

    @staticmethod
    def _change(st: _PoolState, now: float, d: Decision) -> Decision:
        if d.changes:
            st.last_change = now
        return d


# ---- actuators -----------------------------------------------------------------------------------


class ActuatorError(RuntimeError):
    pass


class Actuator(Protocol):
    """Carries out replica counts.

    ``replicas(pool)``: the replicas that count toward the pool now: started or starting, not
    draining. ``scale(pool, n)``: start or drain replicas until ``replicas(pool) == n``; returns
    without waiting for starts to finish or drains to end. A drained replica takes no new work,
    finishes what it has, then stops; no in-flight request fails because of a scale-down.
    Raises :class:`ActuatorError` when the backend refuses (the autoscaler logs it and tries
    again next tick); nothing else about the pool changes then."""

    def replicas(self, pool: str) -> int: ...

    def scale(self, pool: str, n: int) -> None: ...


class ProcessActuator:
    """Worker processes this process owns: local ones (``WorkerProcess``) or Ray actors
    (``RayWorker``), made by ``spawn(pool)`` (which blocks until the worker serves; it runs on
    a thread here). Scale-down drains the newest replica (SIGTERM: deregister, finish, exit)."""

    def __init__(self, spawn: Callable[[str], object], initial: dict[str, list] | None = None,
                 drain_timeout: float = 60.0) -> None:
        self.spawn, self.drain_timeout = spawn, drain_timeout
        self.workers: dict[str, list] = {p: list((initial or {}).get(p, [])) for p in POOLS}
        self._starting = {p: 0 for p in POOLS}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.events: deque[tuple[float, str, str]] = deque(maxlen=1000)  # (time, pool, what)

    def replicas(self, pool: str) -> int:
        with self._lock:
            return len(self.workers[pool]) + self._starting[pool]

    def scale(self, pool: str, n: int) -> None:
        with self._lock:
            have = len(self.workers[pool]) + self._starting[pool]
            for _ in range(n - have):
                self._starting[pool] += 1
                self._go(self._start, pool)
            for _ in range(have - n):
                if not self.workers[pool]:
                    break  # the rest are still starting; they are drained once they serve
                w = self.workers[pool].pop()
                self._go(self._drain, pool, w)

    def _go(self, fn, *args) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True, name=f"autoscale-{fn.__name__}")
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def _start(self, pool: str) -> None:
        try:
            w = self.spawn(pool)
        except Exception as e:  # a worker that fails to start: counted out, logged
            log.error("could not start a %s worker: %s", pool, e)
            with self._lock:
                self._starting[pool] -= 1
            self.events.append((time.time(), pool, f"start failed: {e}"))
            return
        with self._lock:
            self._starting[pool] -= 1
            self.workers[pool].append(w)
        self.events.append((time.time(), pool, f"started {w.worker_id}"))
        log.info("%s pool: started %s on %s", pool, w.worker_id, w.address)

    def _drain(self, pool: str, w) -> None:
        self.events.append((time.time(), pool, f"draining {w.worker_id}"))
        log.info("%s pool: draining %s", pool, w.worker_id)
        w.stop(timeout=self.drain_timeout)
        self.events.append((time.time(), pool, f"stopped {w.worker_id}"))

    def all(self) -> list:
        with self._lock:
            return [w for p in POOLS for w in self.workers[p]]

    def forget(self, w) -> None:
        """``w`` exited on its own: its pool counts one fewer (the policy grows it back to its
        minimum)."""
        with self._lock:
            for pool in POOLS:
                if w in self.workers[pool]:
                    self.workers[pool].remove(w)
        w.stop(timeout=1.0)  # it has exited: this closes its channel and log

    def wait(self, timeout: float = 120.0) -> None:
        """Until every start and drain in progress has ended (tests, shutdown)."""
        end = time.monotonic() + timeout
        for t in list(self._threads):
            t.join(max(0.0, end - time.monotonic()))


DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


class KubernetesActuator:
    """The pool Deployments' ``scale`` subresource, through the official ``kubernetes`` client
    (``pip install 'baton[kubernetes]'``). Pods stop by SIGTERM, which drains a Baton worker;
    the chart gives them ``terminationGracePeriodSeconds`` above the worker's drain timeout.
    ``deployments`` maps pool -> Deployment name.

    Scaling down, the actuator chooses the pods that go (their workers run the fewest requests,
    per ``load(pool)``: pod IP -> requests; the newest on a tie) and gives them the lowest
    ``controller.kubernetes.io/pod-deletion-cost``, so that the ReplicaSet removes exactly those
    (the chart's Role lets it read the Deployments and list and patch their pods)."""

    def __init__(self, namespace: str, deployments: dict[str, str], api=None, core=None,
                 load: Callable[[str], dict[str, float]] | None = None) -> None:
        self.namespace, self.deployments, self.load = namespace, deployments, load
        if api is None or core is None:
            try:
                from kubernetes import client, config
            except ImportError:
                raise ActuatorError("the Kubernetes actuator needs the kubernetes package: "
                                    "pip install 'baton[kubernetes]'") from None
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api, core = api or client.AppsV1Api(), core or client.CoreV1Api()
        self.api, self.core = api, core

    def _name(self, pool: str) -> str:
        try:
            return self.deployments[pool]
        except KeyError:
            raise ActuatorError(f"no Deployment configured for the {pool} pool") from None

    def replicas(self, pool: str) -> int:
        try:
            s = self.api.read_namespaced_deployment_scale(self._name(pool), self.namespace)
        except Exception as e:  # ApiException, connection errors
            raise ActuatorError(f"reading {self.namespace}/{self._name(pool)}'s scale: "
                                f"{e}") from e
        return int(s.spec.replicas or 0)

    def scale(self, pool: str, n: int) -> None:
        try:
            fewer = self.replicas(pool) - n
        except ActuatorError as e:
            raise ActuatorError(f"scaling {self.namespace}/{self._name(pool)} to {n}: "
                                f"{e}") from e
        if fewer > 0:
            try:
                self.choose_removed(pool, fewer)
            except Exception as e:  # the scale-down still drains; Kubernetes picks the pods
                log.warning("could not mark the %s pods to remove (%s): the ReplicaSet "
                            "chooses", pool, e)
        try:
            self.api.patch_namespaced_deployment_scale(
                self._name(pool), self.namespace, {"spec": {"replicas": n}})
        except Exception as e:
            raise ActuatorError(f"scaling {self.namespace}/{self._name(pool)} to {n}: "
                                f"{e}") from e

    def choose_removed(self, pool: str, k: int) -> list[str]:
        """Mark the ``k`` pods of ``pool`` to remove (lowest deletion cost) and clear the mark
        on the others; returns their names."""
        name = self._name(pool)
        dep = self.api.read_namespaced_deployment(name, self.namespace)
        selector = ",".join(f"{a}={b}" for a, b in sorted(
            (dep.spec.selector.match_labels or {}).items()))
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=selector).items
        load = self.load(pool) if self.load is not None else {}
        newest_first = sorted(pods, key=lambda p: p.metadata.creation_timestamp, reverse=True)
        order = sorted(newest_first, key=lambda p: load.get(p.status.pod_ip, 0.0))
        chosen = {p.metadata.name for p in order[:k]}
        for p in pods:
            want = "-1000" if p.metadata.name in chosen else None
            if (p.metadata.annotations or {}).get(DELETION_COST) != want:
                self.core.patch_namespaced_pod(p.metadata.name, self.namespace, {
                    "metadata": {"annotations": {DELETION_COST: want}}})
        log.info("%s pool: removing %s (fewest requests running)", pool, sorted(chosen))
        return sorted(chosen)


# ---- the loop ------------------------------------------------------------------------------------


@dataclass
class Autoscaler:
    """Every ``interval_s``: read signals, decide, actuate. ``history`` keeps every decision
    that changed something, with its signals."""

    policy: Policy
    actuator: Actuator
    signals: Callable[[], Signals]
    interval_s: float = 5.0
    on_change: Callable[[Decision], None] | None = None
    history: list[dict] = field(default_factory=list)

    last_tick: float = 0.0  # time.monotonic() of the last tick that read its signals

    def tick(self) -> list[Decision]:
        s = self.signals()
        self.last_tick = time.monotonic()
        try:
            current = {pool: self.actuator.replicas(pool) for pool in self.policy.pools}
        except ActuatorError as e:
            log.warning("autoscaler: %s", e)
            return []
        decisions = self.policy.decide(s, current)
        for d in decisions:
            if not d.changes:
                continue
            log.info("autoscaler: %s pool %d -> %d (%s)", d.pool, d.current, d.desired,
                     d.reason)
            if self.on_change is not None:
                self.on_change(d)
            try:
                self.actuator.scale(d.pool, d.desired)
            except ActuatorError as e:
                log.warning("autoscaler: %s", e)
                continue
            self.history.append({"at": time.time(), "pool": d.pool, "from": d.current,
                                 "to": d.desired, "pressure": d.pressure, "reason": d.reason,
                                 "signals": vars(s)})
        return decisions

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception:  # one bad tick (a scrape that failed oddly) must not end scaling
                log.exception("autoscaler tick failed")


class MetricsSignals:
    """Signals from the cluster's own metrics: the routers' TTFT / TPOT histograms and the decode
    workers' KV gauges, found through the Redis registry, over the last ``window_s``."""

    def __init__(self, redis_url: str, window_s: float = 20.0) -> None:
        from baton.control.registry import WorkerRegistry

        self.redis_url, self.window_s = redis_url, window_s
        self.registry = WorkerRegistry.from_url(redis_url)
        self._snaps: deque = deque()

    def running(self, pool: str) -> dict[str, float]:
        """Requests on each of ``pool``'s workers (running and queued), by host, from the
        latest snapshot: what a scale-down removes the idlest by."""
        from baton.control.cluster_state import total

        if not self._snaps:
            return {}
        roles = {pool, "both"} if pool == "decode" else {pool}
        return {n.address.rsplit(":", 1)[0]: (total(n.samples, "baton_worker_running_requests")
                                               or 0.0) + (total(n.samples,
                                                                "baton_worker_queue_depth")
                                                          or 0.0)
                for n in self._snaps[-1].nodes if n.kind in roles}

    def __call__(self) -> Signals:
        from baton.control.cluster_state import collect, summarize

        cur = collect(self.registry, self.redis_url)
        self._snaps.append(cur)
        while len(self._snaps) > 1 and cur.at - self._snaps[1].at >= self.window_s:
            self._snaps.popleft()
        base = self._snaps[0] if len(self._snaps) > 1 else None
        if base is None:
            return Signals()
        return signals_from_summary(summarize(cur, base))


def signals_from_summary(s: dict) -> Signals:
    """`baton status`'s windowed summary -> Signals (the worst router's percentiles)."""
    def worst(key: str) -> float | None:
        xs = [r[key]["p90"] for r in s["routers"] if r.get(key) and r[key].get("p90")]
        return max(xs) if xs else None

    decode = [w for w in s["workers"] if w["role"] in ("decode", "both") and w.get("kv_total")]
    prefill = [w for w in s["workers"] if w["role"] == "prefill"]
    used = sum(w["kv_used"] or 0 for w in decode)
    tot = sum(w["kv_total"] for w in decode)
    waiting = sum(r.get("decode_queued") or 0 for r in s["routers"]) + sum(
        w.get("queued") or 0 for w in decode)
    return Signals(ttft_p90_s=worst("ttft"), tpot_p90_s=worst("tpot"),
                   kv_usage=used / tot if tot else None,
                   requests=sum(r.get("requests") or 0 for r in s["routers"]),
                   prefill_ttft_p90_s=worst("ttft_prefill_side"),
                   decode_wait_p90_s=worst("decode_wait"),
                   prefill_queue=(sum(w.get("queued") or 0 for w in prefill) / len(prefill)
                                  if prefill else None),
                   decode_queue=waiting / len(decode) if decode else None)


# ---- command line --------------------------------------------------------------------------------


def add_policy_args(g, min_default: str = "1") -> None:
    """The policy's flags (``baton up --autoscale`` and ``baton autoscale``)."""
    g.add_argument("--ttft-slo", type=float, default=2.0, help="seconds (default 2)")
    g.add_argument("--tpot-slo", type=float, default=0.1, help="seconds per token (default 0.1)")
    g.add_argument("--kv-target", type=float, default=0.85,
                   help="decode pool: share of KV blocks in use that counts as full "
                        "(default 0.85)")
    g.add_argument("--queue-target", type=float, default=4.0,
                   help="requests waiting per worker that count as full, either pool (prefill: "
                        "its queue; decode: the routers' decode-slot queues and its own; "
                        "default 4)")
    for pool in POOLS:
        g.add_argument(f"--min-{pool}", type=int, default=None,
                       help=f"fewest {pool} workers (default: {min_default})")
        g.add_argument(f"--max-{pool}", type=int, default=4,
                       help=f"most {pool} workers (default 4)")
    g.add_argument("--scale-interval", type=float, default=5.0,
                   help="seconds between decisions (default 5)")
    g.add_argument("--scale-window", type=float, default=20.0,
                   help="seconds of metrics each decision looks at (default 20)")
    g.add_argument("--scale-up-cooldown", type=float, default=20.0,
                   help="seconds after a pool's change before it grows again (default 20)")
    g.add_argument("--scale-down-cooldown", type=float, default=60.0,
                   help="seconds after a pool's change before it shrinks (default 60)")
    g.add_argument("--scale-down-after", type=float, default=30.0,
                   help="seconds pressure must stay below half the target before a pool "
                        "shrinks (default 30)")


@dataclass(frozen=True)
class ScalingConfig:
    """The policy's settings (:func:`add_policy_args`' flags), built once from the command line.
    ``min_replicas``/``max_replicas``: per pool; a pool missing from ``min_replicas`` starts
    from its starting count (at least 1)."""

    slo: SLO
    min_replicas: dict[str, int]
    max_replicas: dict[str, int]
    up_cooldown_s: float
    down_cooldown_s: float
    down_after_s: float
    interval_s: float
    window_s: float

    @classmethod
    def from_args(cls, a) -> ScalingConfig:
        return cls(SLO(a.ttft_slo, a.tpot_slo, a.kv_target, a.queue_target),
                   {p: getattr(a, f"min_{p}") for p in POOLS
                    if getattr(a, f"min_{p}") is not None},
                   {p: getattr(a, f"max_{p}") for p in POOLS},
                   a.scale_up_cooldown, a.scale_down_cooldown, a.scale_down_after,
                   a.scale_interval, a.scale_window)

    def policies(self, pools: list[str], start: dict[str, int] | None = None) -> dict:
        """PoolPolicy per pool; raises ValueError naming the bad values."""
        out = {}
        for pool in pools:
            lo = self.min_replicas.get(pool)
            lo = max(1, (start or {}).get(pool, 1)) if lo is None else lo
            out[pool] = PoolPolicy(min_replicas=lo, max_replicas=self.max_replicas[pool],
                                   up_cooldown_s=self.up_cooldown_s,
                                   down_cooldown_s=self.down_cooldown_s,
                                   down_after_s=self.down_after_s)
        s = self.slo
        if s.ttft_s <= 0 or s.tpot_s <= 0 or not 0 < s.kv_usage <= 1 or s.queue <= 0:
            raise ValueError(f"want --ttft-slo ({s.ttft_s}) > 0, --tpot-slo ({s.tpot_s}) > 0, "
                             f"0 < --kv-target ({s.kv_usage}) <= 1, --queue-target "
                             f"({s.queue}) > 0")
        return out


def add_autoscale_args(ap) -> None:
    ap.add_argument("--redis-url", default=None,
                    help="the cluster's Redis (default $BATON_REDIS_URL, else a local `baton "
                         "up`'s)")
    ap.add_argument("--kubernetes", action="store_true",
                    help="scale Kubernetes Deployments (in a pod: its service account; "
                         "elsewhere: ~/.kube/config)")
    ap.add_argument("--namespace", default=None,
                    help="the Deployments' namespace (default $POD_NAMESPACE, else default)")
    ap.add_argument("--prefill-deployment", default="baton-prefill")
    ap.add_argument("--decode-deployment", default="baton-decode")
    ap.add_argument("--colocated", action="store_true",
                    help="one pool (the decode Deployment runs --role both)")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the decisions, change nothing")
    ap.add_argument("--health-port", type=int, default=-1,
                    help="serve /healthz (200 while decisions are being made) and /decisions "
                         "(the changes so far, JSON) on this port (-1: none)")
    add_policy_args(ap)


@dataclass(frozen=True)
class AutoscaleConfig:
    """`baton autoscale`'s settings (:func:`add_autoscale_args`), built once from its command
    line."""

    redis_url: str | None
    kubernetes: bool
    namespace: str | None
    deployments: dict[str, str]
    colocated: bool
    dry_run: bool
    health_port: int
    scaling: ScalingConfig

    @classmethod
    def from_args(cls, a) -> AutoscaleConfig:
        return cls(a.redis_url, a.kubernetes, a.namespace,
                   {"prefill": a.prefill_deployment, "decode": a.decode_deployment},
                   a.colocated, a.dry_run, a.health_port, ScalingConfig.from_args(a))


def cmd_autoscale(a) -> int:
    return autoscale(AutoscaleConfig.from_args(a))


def autoscale(cfg: AutoscaleConfig) -> int:
    """``baton autoscale``: the policy as its own process, for clusters whose workers it does
    not own (Kubernetes Deployments)."""
    import os
    import sys

    from baton.control.cluster_state import find_redis_url

    from baton import set_on_signals

    url = cfg.redis_url or find_redis_url()
    if not url:
        print("error: no Redis: pass --redis-url (or set BATON_REDIS_URL)", file=sys.stderr)
        return 2
    if not cfg.kubernetes:
        print("error: choose an actuator: --kubernetes (local clusters: `baton up "
              "--autoscale`, which owns its workers)", file=sys.stderr)
        return 2
    sc = cfg.scaling
    try:
        pols = sc.policies(["decode"] if cfg.colocated else ["prefill", "decode"])
        ns = cfg.namespace or os.environ.get("POD_NAMESPACE", "default")
        signals = MetricsSignals(url, sc.window_s)
        act = KubernetesActuator(ns, cfg.deployments, load=signals.running)
    except (ValueError, ActuatorError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.dry_run:
        act = _DryRun(act)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    set_on_signals(stop)
    scaler = Autoscaler(Policy(pols, sc.slo), act, signals, sc.interval_s)
    log.info("autoscaling %s in namespace %s on %s", ", ".join(
        f"{p} {pol.min_replicas}..{pol.max_replicas}" for p, pol in pols.items()), ns, url)
    if cfg.health_port >= 0:
        serve_health(scaler, cfg.health_port)
    scaler.run(stop)
    return 0


def serve_health(scaler: Autoscaler, port: int, host: str = "0.0.0.0"):
    """/healthz: 200 while ticks keep reading signals (within 3 intervals, at least 30 s),
    else 503; /decisions: the scaler's history as JSON. Returns the server (a daemon thread
    serves it)."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    started = time.monotonic()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            if self.path == "/healthz":
                since = time.monotonic() - (scaler.last_tick or started)
                ok = since <= max(3 * scaler.interval_s, 30.0)
                code, body = (200, b"ok\n") if ok else (503, b"no decision lately\n")
            elif self.path == "/decisions":
                code, body = 200, json.dumps(scaler.history, default=str).encode()
            else:
                code, body = 404, b"not found\n"
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True, name="autoscale-health").start()
    return server


class _DryRun:
    """Reads through to the real actuator, scales nothing."""

    def __init__(self, inner: Actuator) -> None:
        self.inner = inner

    def replicas(self, pool: str) -> int:
        return self.inner.replicas(pool)

    def scale(self, pool: str, n: int) -> None:
        log.info("dry run: would scale the %s pool to %d", pool, n)
