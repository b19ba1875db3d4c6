"""What every server process shares: engine construction from flags, the gRPC server, process
stats for worker info, and typed errors mapped to gRPC status codes. Torch-free at import time
(the router uses it too); ``build_engine`` imports the engine when called."""

from __future__ import annotations

import json
import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
from baton.engine.errors import InvalidRequestError
from baton.engine.params import SamplingParams
from baton.services.common import tracing
from baton.services.common.config import EngineSettings, ServerSettings, WorkerConfig
from baton.transfer import cluster_secret
from baton.transfer.errors import (
    ChecksumMismatchError,
    FingerprintMismatchError,
    LeaseLostError,
    PeerUnavailableError,
    TransferDeadlineError,
)
from baton.v1 import worker_pb2

from baton import set_on_signals

log = logging.getLogger("baton.services")


class EngineDied(RuntimeError):
    """The engine thread stopped on an unexpected error; every open stream gets this (the
    engine loop raises it; defined here, torch-free, for the status it maps to)."""


def build_engine(settings: EngineSettings, record_kv_events: bool,
                 worker_name: str | None = None):
    from baton.engine.engine import LLMEngine

    try:
        cfg = settings.engine_config(record_kv_events, worker_name)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    return LLMEngine.from_path(settings.model, cfg)


@dataclass
class WorkerBoot:
    """What every worker process sets up first: engine, identity, gRPC server, NIXL agent."""

    engine: object  # baton.engine.engine.LLMEngine
    role: str
    host: str
    address: str
    worker_id: str
    incarnation: str
    server: grpc.Server
    agent: object  # baton.transfer.agent.KVAgent
    metrics: object  # baton.services.common.metrics.WorkerMetrics

    def serve(self, cfg: ServerSettings, services: list[str], on_stop,
              busy: Callable[[], bool] | None = None,
              died: threading.Event | None = None) -> None:
        """Start serving, register, announce, and block until drained (``busy``, ``died``:
        see :func:`serve_forever`)."""
        health = add_standard_services(self.server, services)
        self.server.start()
        metrics_address = ""
        if cfg.metrics_port >= 0:
            mport = self.metrics.serve(self.host, cfg.metrics_port)
            host = self.address.rsplit(":", 1)[0]
            metrics_address = f"{host}:{mport}"
            log.info("Prometheus metrics on http://%s/metrics", metrics_address)
            print(f"BATON_METRICS {metrics_address}", flush=True)
        log.info("%s worker %s (incarnation %s) serving on %s, model fingerprint %s", self.role,
                 self.worker_id, self.incarnation, self.address, self.engine.fingerprint[:16])
        registration = register(cfg, self.role, self.worker_id, self.address,
                                self.engine.fingerprint, self.incarnation,
                                self.engine.model_info.name, self.engine.cfg.block_size,
                                metrics_address, self.engine.cfg.max_num_seqs)
        publisher = publish_index(cfg, self.engine, self.worker_id, self.incarnation)
        drain = announce(self.address, self.worker_id, self.incarnation)

        def stop() -> None:
            if publisher is not None:
                publisher.stop(withdraw=True)
            on_stop()
            self.engine.close()  # the disk tier's queued blocks are written before exit
            tracing.shutdown()
        serve_forever(self.server, stop, registration, cfg.drain_timeout, health=health,
                      busy=busy, died=died, drain=drain)


def boot_worker(cfg: WorkerConfig) -> WorkerBoot:
    """Logging, UCX reporting, the engine, a bound (not started) gRPC server, the NIXL agent."""
    from baton.transfer.agent import KVAgent, configure_ucx

    net, role = cfg.server, cfg.role
    setup_logging(net.log_level)
    # before the agent: UCX reads its environment once
    configure_ucx(loopback_only=is_loopback(net.host))
    try:
        engine = build_engine(cfg.engine, record_kv_events=bool(net.redis_url),
                              worker_name=net.worker_id or (f"{role}-{net.port}" if net.port
                                                            else None))
    except InvalidRequestError as e:  # --device, --gpu-memory-utilization: say which, no trace
        raise SystemExit(f"error: {e}") from None
    report_memory(engine)
    incarnation = new_incarnation()
    try:
        gate = cluster_secret.interceptors()
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    server = make_server(interceptors=gate)
    port = server.add_insecure_port(f"{net.host}:{net.port}")
    port = net.advertise_port or port  # a proxy or port mapping in front of this one
    host = advertised_host(net)
    worker_id = net.worker_id or f"{role}-{host}-{port}"
    tracing.setup(role, worker_id)
    agent = KVAgent(f"{worker_id}/{incarnation}", engine.kv_cache,
                    staging=cfg.engine.kv_staging)
    from baton.services.common.metrics import WorkerMetrics

    return WorkerBoot(engine, role, net.host, f"{host}:{port}", worker_id, incarnation,
                      server, agent, WorkerMetrics(engine, role, agent))


def report_memory(engine) -> None:
    """Log where the engine runs and how its KV pool was sized (GPU: the device's share)."""
    plan = engine.memory_plan
    if plan is not None:
        log.info("KV pool on %s", plan.describe())
        log.info("%s holds %.2f GiB for this engine with the pool and its CUDA graphs",
                 engine.cfg.device, engine.device_reserved / (1 << 30))
    else:
        log.info("KV pool on %s: %d blocks of %d KiB (%.2f GiB)", engine.cfg.device,
                 engine.num_blocks, engine.block_nbytes // 1024,
                 engine.num_blocks * engine.block_nbytes / (1 << 30))
    for tier in engine.tiers.tiers if engine.tiers is not None else ():
        where = f" ({tier.startup})" if getattr(tier, "startup", "") else ""
        log.info("KV %s tier: %d blocks (%.2f GiB)%s", tier.name, tier.stats.capacity,
                 tier.stats.capacity * engine.block_nbytes / (1 << 30), where)


def is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def advertised_host(args) -> str:
    """The host part of the address this process registers (see ``--advertise-host``); ``args``
    has ``host`` and ``advertise_host`` (the command line, or a role's config)."""
    if getattr(args, "advertise_host", None):
        return args.advertise_host
    if args.host in ("0.0.0.0", "", "::"):
        import socket

        return socket.gethostbyname(socket.gethostname())
    return args.host


def tokenizer_info(engine):
    """What a router needs to tokenize exactly as the workers do."""
    return worker_pb2.TokenizerResponse(model=engine.model_info.name,
                                        tokenizer_json=json.dumps(engine.tokenizer.to_json()),
                                        max_model_len=engine.max_model_len)


def worker_info(loop, role: str, worker_id: str, incarnation: str, agent, check: bool,
                holder=None, num_peers: int = 0, pulling: int = 0):
    """WorkerInfo for Info RPCs; pool counts and the integrity check run on the engine thread."""
    engine = loop.engine
    rss, fds = process_stats()

    def snapshot():
        ok, err = True, ""
        if check:
            try:
                engine.check_integrity()
            except AssertionError as e:
                ok, err = False, str(e) or "check_integrity failed"
        stats = engine.stats()
        return (stats.free_blocks, stats.running, ok, err)

    free, running, ok, err = loop.run(snapshot)
    info = worker_pb2.WorkerInfo(
        worker_id=worker_id, incarnation=incarnation, role=role, fingerprint=engine.fingerprint,
        transports=agent.transports(), ucx_tls=agent.ucx_tls, rss_bytes=rss, open_fds=fds,
        num_blocks=engine.num_blocks, num_free_blocks=free, running_requests=running,
        integrity_ok=ok, integrity_error=err, known_peers=num_peers,
        handoffs_in_flight=pulling, device=engine.cfg.device, kv_memory=agent.memory,
        kv_staged_bytes=agent.staged_bytes)
    if holder is not None:
        info.active_leases = len(holder.leases)
        info.leases_granted = holder.leases.num_granted
        info.leases_expired = holder.leases.num_expired
    return info


def new_incarnation() -> str:
    return secrets.token_hex(6)


def make_server(max_workers: int = 32, interceptors=(),
                max_concurrent_rpcs: int | None = None) -> grpc.Server:
    """A gRPC server on ``max_workers`` threads; with ``max_concurrent_rpcs``, calls past that
    many at once end RESOURCE_EXHAUSTED instead of queueing for a thread without bound."""
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                       interceptors=list(interceptors), options=[("grpc.so_reuseport", 0)],
                       maximum_concurrent_rpcs=max_concurrent_rpcs)


def register(cfg: ServerSettings, role: str, worker_id: str, address: str,
             fingerprint: str, incarnation: str, model: str, block_size: int = 16,
             metrics_address: str = "", max_num_seqs: int = 0):
    """Put this worker in the Redis registry (if ``--redis-url``); returns the Registration."""
    if not cfg.redis_url:
        return None
    from baton.control.registry import Registration, WorkerRecord, WorkerRegistry

    registry = WorkerRegistry.from_url(cfg.redis_url, cfg.registry_ttl)
    record = WorkerRecord(worker_id, role, address, fingerprint, incarnation, model,
                          block_size=block_size, metrics_address=metrics_address,
                          max_num_seqs=max_num_seqs)
    reg = Registration(registry, record).start()
    log.info("registered as %s (%s) in Redis", worker_id, role)
    return reg


def publish_index(cfg: ServerSettings, engine, worker_id: str, incarnation: str):
    """Publish the engine's prefix-cache events and load to the Redis prefix index (if
    ``--redis-url``), with the registry's TTL; returns the running IndexPublisher."""
    if not cfg.redis_url or engine.kv_events is None:
        return None
    import redis
    from baton.control.prefix_index import IndexPublisher

    client = redis.Redis.from_url(cfg.redis_url, socket_timeout=2, socket_connect_timeout=2)
    def load() -> tuple[int, int, int, int]:  # plain counter reads, safe off the engine thread
        s = engine.stats()
        return s.waiting, s.running, s.free_blocks, s.total_blocks

    return IndexPublisher(client, worker_id, incarnation, engine.kv_events, load,
                          ttl_s=cfg.registry_ttl).start()


def add_standard_services(server: grpc.Server, service_names: list[str]):
    """The standard gRPC health-checking (overall and per service: SERVING) and reflection
    services. Returns the health servicer; ``serve_forever`` flips it to NOT_SERVING on drain."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    hs = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    for name in ("", *service_names):
        hs.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return hs


def serve_forever(server: grpc.Server, on_stop, registration=None,
                  drain_timeout: float = 30.0, health=None,
                  busy: Callable[[], bool] | None = None,
                  died: threading.Event | None = None,
                  drain: threading.Event | None = None) -> None:
    """Block until SIGTERM/SIGINT (``drain``, from :func:`announce`), then drain: deregister
    (routers stop sending work), wait while ``busy()`` (work that still needs RPCs in: a
    prefill worker's leased blocks wait for their readers' release calls), refuse new RPCs,
    let the ones in flight finish, run ``on_stop``, return. All of it within ``drain_timeout``.

    ``died`` set (the engine thread stopped on an error) does the same at once, without
    waiting for ``busy``, and then exits 1: the worker cannot serve any more, and its
    supervisor (``baton up``, Kubernetes, Ray) replaces it. Its calls in flight ended
    UNAVAILABLE, which the router retries (or migrates) elsewhere."""
    done = drain or threading.Event()
    if drain is None:
        set_on_signals(done)
    if died is not None:
        threading.Thread(target=lambda: (died.wait(), done.set()), name="engine-watch",
                         daemon=True).start()
    done.wait()
    crashed = died is not None and died.is_set()
    if crashed:
        log.error("the engine thread died: deregistering, NOT_SERVING, exiting 1 so that "
                  "this worker is replaced")
    else:
        log.info("draining: deregistering, finishing in-flight requests (up to %.0fs)",
                 drain_timeout)
    if registration is not None:
        registration.withdraw()
    if health is not None:
        health.enter_graceful_shutdown()  # NOT_SERVING for every service
    deadline = time.monotonic() + drain_timeout
    while not crashed and busy is not None and busy() and time.monotonic() < deadline:
        time.sleep(0.05)
    server.stop(grace=max(0.0, deadline - time.monotonic())).wait()
    on_stop()
    if crashed:
        raise SystemExit(1)
    log.info("drained; exiting")


def announce(address: str, worker_id: str, incarnation: str) -> threading.Event:
    """The line a parent process (``baton up``, tests) waits for; returns the event SIGTERM and
    SIGINT set from then on (a drain). The handlers go in first: a parent that stops the
    process as soon as it reads the line must get a drain, not the default action (exit -15)."""
    drain = threading.Event()
    set_on_signals(drain)
    print(f"BATON_READY {address} {worker_id} {incarnation}", flush=True)
    return drain


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def process_stats() -> tuple[int, int]:
    """(resident bytes, open file descriptors) of this process."""
    rss = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return rss, len(os.listdir("/proc/self/fd"))


def params_from_proto(m) -> SamplingParams:
    return SamplingParams(
        max_tokens=m.max_tokens if m.HasField("max_tokens") else 16,
        temperature=m.temperature, top_k=m.top_k,
        top_p=m.top_p if m.HasField("top_p") else 1.0,
        seed=m.seed if m.HasField("seed") else None, stop=tuple(m.stop),
        stop_token_ids=tuple(m.stop_token_ids), ignore_eos=m.ignore_eos,
        cache_salt=m.cache_salt if m.HasField("cache_salt") else None,
        logprobs=m.logprobs if m.HasField("logprobs") else None)


def params_to_proto(p: SamplingParams):
    return worker_pb2.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
        seed=p.seed, stop=p.stop, stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos,
        cache_salt=p.cache_salt, logprobs=p.logprobs)


def logprob_to_proto(lp):
    """baton.engine.sampler.TokenLogprobs -> baton.v1.TokenLogprob."""
    return worker_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob,
        top=[worker_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


class NoRoomError(Exception):
    """This worker cannot take the request now (KV blocks, a slot in its running batch) within
    the call's time: RESOURCE_EXHAUSTED. Raised, not ``context.abort``-ed, by code inside a
    ``try`` that maps exceptions to statuses: an abort there raises a bare ``Exception`` that
    such a handler would turn into INTERNAL."""


_STATUS = [  # most specific first
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (FingerprintMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (LeaseLostError, grpc.StatusCode.ABORTED),
    (ChecksumMismatchError, grpc.StatusCode.DATA_LOSS),
    (TransferDeadlineError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (PeerUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (EngineDied, grpc.StatusCode.UNAVAILABLE),  # this worker is going away: try another
    (NoRoomError, grpc.StatusCode.RESOURCE_EXHAUSTED),
]


def status_for(e: BaseException) -> grpc.StatusCode:
    for cls, code in _STATUS:
        if isinstance(e, cls):
            return code
    return grpc.StatusCode.INTERNAL


FIELD_METADATA = "baton-field"
# a decode worker's failed hand-off: the address of the prefill worker (the holder) it failed
# on, so the router retries without that worker rather than without this one
PEER_METADATA = "baton-failed-peer"


def engine_guard(context: grpc.ServicerContext, stream):
    """Relay a server stream; an :class:`EngineDied` raised anywhere in it (a call to the dead
    engine) ends the call UNAVAILABLE, which the router retries, instead of escaping as
    UNKNOWN."""
    try:
        yield from stream
    except EngineDied as e:
        abort_with(context, e)


def abort_with(context: grpc.ServicerContext, e: BaseException, peer: str | None = None):
    """End the RPC with the typed status for ``e`` and its message (raises). An invalid field is
    named in the ``baton-field`` trailing metadata too, so the router reports it as it is;
    ``peer``: the worker the failure came from (``baton-failed-peer``), when not this one."""
    field = getattr(e, "field", None)
    meta = [(FIELD_METADATA, field)] if isinstance(field, str) else []
    if peer:
        meta.append((PEER_METADATA, peer))
    if meta:
        context.set_trailing_metadata(tuple(meta))
    context.abort(status_for(e), f"{type(e).__name__}: {e}")
