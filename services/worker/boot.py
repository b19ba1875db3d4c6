"""What every worker process sets up before it serves: logging, UCX, the engine from its
flags, the gRPC server (bound, not started), the NIXL agent and the metrics; and the serve loop
around them (register, publish, announce, drain)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from baton.engine.errors import InvalidRequestError, ModelLoadError
from baton.services.common import tracing
from baton.services.common.config import EngineSettings, ServerSettings, WorkerConfig
from baton.services.common.process import (
    add_standard_services,
    advertised_host,
    announce,
    is_loopback,
    make_server,
    new_incarnation,
    serve_forever,
    setup_logging,
)
from baton.services.worker.publisher import publish_index, register
from baton.transfer import cluster_secret

log = logging.getLogger("baton.services")

# Short calls that run on threads of their own (make_server's ``control``), never behind the
# streams and prefill calls that hold the others: a liveness probe, a role switch, the hand-off's
# handshake and lease release, a router's Info and Tokenizer reads
CONTROL_METHODS = (
    "/grpc.health.v1.Health/Check",
    "/baton.v1.WorkerAdmin/SetRole",
    "/baton.v1.KVSource/Handshake",
    "/baton.v1.KVSource/ReleaseLease",
    *(f"/baton.v1.{s}/{m}" for s in ("PrefillWorker", "DecodeWorker")
      for m in ("Info", "Tokenizer")),
)
# prefill calls a worker holds a thread for while its engine queues them: more prompts than
# any prefill batch takes, so a call past them waits for a thread as it would in the queue
PREFILL_CALL_THREADS = 64


def data_threads(max_num_seqs: int) -> int:
    """The gRPC threads for a worker's work: every stream its batch admits (a Decode or
    Generate call holds its thread for its whole output, so fewer threads than --max-num-seqs
    would cap the batch below it) and PREFILL_CALL_THREADS prefill calls."""
    return max_num_seqs + PREFILL_CALL_THREADS


def cpu_threads(device: str) -> int:
    """The torch threads this worker's engine computes with on a CPU (its registry entry, which
    the live tuner checks against its profile's); 0 on a GPU, where they do not set its pace."""
    import torch
    from baton.engine.config import device_kind

    if device_kind(device) != "cpu":
        return 0

    return torch.get_num_threads()


def build_engine(settings: EngineSettings, record_kv_events: bool,
                 worker_name: str | None = None):
    from baton.engine.engine import LLMEngine

    try:
        cfg = settings.engine_config(record_kv_events, worker_name)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    engine = LLMEngine.from_path(settings.model, cfg)
    # structured output's tokenizer, off the engine thread, before a request needs it
    threading.Thread(target=engine.warm_grammars, name="grammar-tokenizer",
                     daemon=True).start()
    return engine


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
    registration: object = None  # its Registration, once serving with --redis-url

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
        from baton.engine.config import processor

        registration = self.registration = register(cfg, self.role, self.worker_id, self.address,
                                self.engine.fingerprint, self.incarnation,
                                self.engine.model_info.name, self.engine.cfg.block_size,
                                metrics_address, self.engine.cfg.max_num_seqs,
                                self.engine.ranks, self.engine.cfg.dtype,
                                self.engine.num_blocks, cpu_threads(self.engine.cfg.device),
                                processor(self.engine.cfg.device))
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
    from baton.engine.model import huge_pages
    from baton.transfer.agent import KVAgent, configure_ucx

    net, role = cfg.server, cfg.role
    setup_logging(net.log_level)
    try:  # refused by name on any device, not only where a CPU pool or weight reads it
        huge_pages()
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    # before the agent: UCX reads its environment once
    configure_ucx(loopback_only=is_loopback(net.host))
    try:
        engine = build_engine(cfg.engine, record_kv_events=bool(net.redis_url),
                              worker_name=net.worker_id or (f"{role}-{net.port}" if net.port
                                                            else None))
    except (InvalidRequestError, ModelLoadError) as e:  # a bad --model, --device...: one line
        raise SystemExit(f"error: {e}") from None
    report_memory(engine)
    incarnation = new_incarnation()
    try:
        gate = cluster_secret.interceptors()
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    server = make_server(max_workers=data_threads(cfg.engine.max_num_seqs), interceptors=gate,
                         control=CONTROL_METHODS)
    port = server.add_insecure_port(f"{net.host}:{net.port}")
    port = net.advertise_port or port  # a proxy or port mapping in front of this one
    host = advertised_host(net)
    worker_id = net.worker_id or f"{role}-{host}-{port}"
    tracing.setup(role, worker_id)
    agent = KVAgent(f"{worker_id}/{incarnation}", engine.kv_storage,
                    staging=cfg.engine.kv_staging, layout=engine.kv_layout)
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
        log.info("KV pool on %s: %d blocks of %d KiB (%.2f GiB), %s", engine.cfg.device,
                 engine.num_blocks, engine.block_nbytes // 1024,
                 engine.num_blocks * engine.block_nbytes / (1 << 30),
                 engine.kv_layout.describe())
    for tier in engine.tiers.tiers if engine.tiers is not None else ():
        where = f" ({tier.startup})" if getattr(tier, "startup", "") else ""
        log.info("KV %s tier: %d blocks (%.2f GiB)%s", tier.name, tier.stats.capacity,
                 tier.stats.capacity * engine.block_nbytes / (1 << 30), where)
