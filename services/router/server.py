"""The router process: ``python -m baton.services.router --redis-url URL`` (``baton router``).

Startup only: flags -> a frozen :class:`RouterConfig`, the worker pool and tokenizer (fetched from
a registered worker; the router imports no torch), the :class:`Orchestrator` that runs every
request, and its two fronts, the gRPC API (``grpc_api``) and the OpenAI-compatible HTTP API
(``openai_http``). See ``docs/architecture.md`` for a request's path through these modules.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from baton.control.prefix_index import PrefixIndex
from baton.control.registry import Registration, RouterRecord, WorkerRegistry
from baton.engine.tokenizer import BatonTokenizer
from baton.services.common import tracing
from baton.services.common.process import (
    add_standard_services,
    advertised_host,
    announce,
    make_server,
    new_incarnation,
    serve_forever,
    setup_logging,
)
from baton.services.router.grpc_api import RouterServicer, TokenAuth
from baton.services.router.limits import ApiKeys, Limits
from baton.services.router.liveness import Liveness
from baton.services.router.orchestrator import Orchestrator, RouterSettings
from baton.services.router.routing import (
    DEFAULT_TIER_WEIGHTS,
    DEFAULT_WEIGHTS,
    MODES,
    RoutingPolicy,
    parse_tier_weights,
    parse_weights,
)
from baton.services.router.workers import WorkerPool
from baton_client.v1 import api_pb2_grpc

if TYPE_CHECKING:  # the HTTP front imports uvicorn; a router with --http-port -1 never does
    from baton.services.router.openai_http import HttpServer

log = logging.getLogger("baton.services.router")

# a paused client process or machine keeps its streams this long (gRPC's own default: 20 s;
# the machine of docs/routing.md stopped for over 20 s in its runs 34 and 36, ~31 s by the
# kernel's log in 36)
CLIENT_STALL_TIMEOUT_S = 60.0

# ---- flags ---------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m baton.services.router",
        description="Baton router: the public gRPC API (baton.v1.Baton) and the OpenAI-compatible "
                    "HTTP API in front of the prefill and decode workers registered in Redis.")
    ap.add_argument("--redis-url", default=os.environ.get("BATON_REDIS_URL"),
                    required="BATON_REDIS_URL" not in os.environ,
                    help="Redis: the worker registry, the prefix index, shared in-flight counts "
                         "(redis://:PASSWORD@host:port/0 for AUTH, rediss:// for TLS; default "
                         "$BATON_REDIS_URL, which keeps a password off the command line)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--advertise-host", default=os.environ.get("BATON_ADVERTISE_HOST"),
                    help="address this router registers in Redis for `baton status` (default "
                         "$BATON_ADVERTISE_HOST, else --host, else this host's IP when --host "
                         "is 0.0.0.0)")
    ap.add_argument("--port", type=int, default=50051, help="gRPC port (0: pick a free one)")
    ap.add_argument("--http-port", type=int, default=8000,
                    help="OpenAI-compatible HTTP port (0: pick a free one, -1: no HTTP)")
    _routing_flags(ap.add_argument_group("routing"))
    _request_flags(ap.add_argument_group("requests"))
    _limit_flags(ap.add_argument_group(
        "limits (over them: RESOURCE_EXHAUSTED / HTTP 429, or INVALID_ARGUMENT naming the "
        "field)"))
    ap.add_argument("--startup-timeout", type=float, default=300.0,
                    help="seconds to wait for a first worker to register")
    ap.add_argument("--drain-timeout", type=float, default=30.0)
    ap.add_argument("--client-stall-timeout", type=float, default=CLIENT_STALL_TIMEOUT_S,
                    help="seconds a gRPC client may leave the router's answers unread (its "
                         "process paused or too busy to read, or its machine stopped) before "
                         "the router cuts its connection and every stream on it; gRPC's own "
                         "default is 20 s, and the HTTP front never cuts a client for this "
                         f"(default {CLIENT_STALL_TIMEOUT_S:g})")
    ap.add_argument("--log-level", default="INFO")
    _security_flags(ap.add_argument_group("security"))
    return ap


def _routing_flags(g) -> None:
    g.add_argument("--routing", choices=MODES, default="cache-aware",
                   help="cache-aware: score workers on the Redis prefix index and load; "
                        "least-loaded: load only; round-robin: in turn, cache-blind "
                        "(default cache-aware)")
    g.add_argument("--scorers", default=DEFAULT_WEIGHTS,
                   help="scorer weights, name=weight,...: prefix (share of the prompt's blocks "
                        "the worker holds), inflight (requests in flight, all routers), queue "
                        "(the worker's waiting requests), kv (free KV blocks), prefill (prompt "
                        "tokens the worker has still to compute) "
                        f"(default {DEFAULT_WEIGHTS})")
    g.add_argument("--tier-weights", default="auto",
                   help="what the prefix scorer counts for a block a worker holds in a KV tier "
                        "instead of its pool, name=weight,... in [0, 1] (host, disk): the share "
                        "of the block's prefill time a load saves. auto: from `baton profile`'s "
                        "measured load bandwidth and prefill cost when its profile is there, "
                        "else host=0.95,disk=0.8 (logged at start-up)")
    g.add_argument("--local-prefill-max-tokens", type=int, default=64,
                   help="the chosen decode worker prefills the prompt itself when it lacks at "
                        "most this many of its tokens (prefix-cache hits excluded); more go "
                        "to a prefill worker (default 64; 0: always a prefill worker if any)")
    g.add_argument("--prefill-saturation", type=int, default=8,
                   help="a prefill worker with this many requests in flight plus queued is "
                        "saturated; when all are, decode workers prefill prompts up to "
                        "--saturated-local-max-tokens themselves (0: never saturated) "
                        "(default 8)")
    g.add_argument("--saturated-local-max-tokens", type=int, default=256,
                   help="when every prefill worker is saturated, the decode worker prefills a "
                        "prompt itself only if it lacks at most this many of its tokens; a "
                        "longer one waits for a prefill worker, as a long local prefill would "
                        "stall every stream the decode worker runs (default 256; -1: any)")
    g.add_argument("--inflight-ttl", type=float, default=30.0,
                   help="seconds a router's in-flight entries in Redis outlive the router "
                        "(re-armed while it runs) (default 30)")


def _request_flags(g) -> None:
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="deadline of a request whose client set none (most gRPC clients and "
                        "every OpenAI request), and the longest one honoured; every worker call "
                        "gets what is left of it (default 600 s)")
    g.add_argument("--max-retries", type=int, default=2,
                   help="other workers to try when one is unavailable before the first token")
    g.add_argument("--max-migrations", type=int, default=2,
                   help="times a request resumes on another decode worker when its own fails "
                        "after tokens were streamed (from the prompt plus those tokens; "
                        "0: end such requests UNAVAILABLE) (default 2)")
    g.add_argument("--stall-timeout", type=float, default=30.0,
                   help="seconds a decode worker may stay silent in the middle of a stream "
                        "before the router takes the request elsewhere (migrates it): a hung "
                        "worker costs this, not the whole deadline (0: wait for the deadline) "
                        "(default 30)")
    g.add_argument("--workload-window", type=float, default=900.0,
                   help="seconds of requests (by arrival; running ones too) the router keeps "
                        "as the live workload (lengths, counts and phase times; no prompt text "
                        "or token ids), served "
                        "at /v1/baton/workload as a trace `baton tune --format baton` reads "
                        "(0: keep none) (default 900)")


def _limit_flags(g) -> None:
    g.add_argument("--max-concurrent", type=int, default=256,
                   help="requests this router runs at once (0: no limit) (default 256)")
    g.add_argument("--max-queued", type=int, default=1024,
                   help="requests that may wait for one of those slots, first come first "
                        "served, within their deadlines; more are refused at once "
                        "(RESOURCE_EXHAUSTED, HTTP 429). As many again may wait for a decode "
                        "worker when every one runs its --max-num-seqs requests "
                        "(default 1024)")
    g.add_argument("--max-concurrent-per-key", type=int, default=0,
                   help="requests one API key (else one client host) may have running or "
                        "waiting (0: no limit) (default 0)")
    g.add_argument("--max-prompt-tokens", type=int, default=0,
                   help="longest prompt accepted (0: the model's context length)")
    g.add_argument("--max-tokens", type=int, default=0,
                   help="largest max_tokens accepted (0: no limit beyond the context)")
    g.add_argument("--unknown-fields", default="refuse", choices=["refuse", "ignore"],
                   help="an OpenAI request field the router does not know: refuse (400 naming "
                        "it, as OpenAI does), or ignore (logged once per field and counted in "
                        "baton_http_unknown_fields_total), for clients written against other "
                        "servers' extensions (default refuse)")


def _security_flags(g) -> None:
    g.add_argument("--auth-token", default=os.environ.get("BATON_AUTH_TOKEN"),
                   help="require 'authorization: Bearer TOKEN' on gRPC calls and "
                        "'Authorization: Bearer TOKEN' (the OpenAI api_key) on /v1/*; health "
                        "checks and /metrics stay open (default $BATON_AUTH_TOKEN)")
    g.add_argument("--api-keys-file", default=os.environ.get("BATON_API_KEYS_FILE"),
                   help="more accepted keys, one per line ('#' comments), like --auth-token; "
                        "--max-concurrent-per-key counts each key separately "
                        "(default $BATON_API_KEYS_FILE)")
    g.add_argument("--tls-cert", default=None, help="PEM certificate: serve gRPC and HTTP "
                                                    "over TLS (with --tls-key)")
    g.add_argument("--tls-key", default=None, help="PEM private key for --tls-cert")


# ---- config --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router process is told, checked once; nothing below :func:`main` sees
    the command line."""

    redis_url: str
    host: str
    advertise_host: str | None
    port: int
    http_port: int  # -1: no HTTP front
    routing: str
    weights: dict
    local_prefill_max_tokens: int
    prefill_saturation: int
    saturated_local_max_tokens: int
    inflight_ttl: float
    request_timeout: float
    max_retries: int
    max_migrations: int
    stall_timeout: float
    workload_window: float
    limits: Limits
    max_prompt_tokens: int
    max_tokens: int
    startup_timeout: float
    drain_timeout: float
    log_level: str
    keys: ApiKeys
    tls: tuple[str, str] | None  # (certificate file, key file)
    tier_weights: dict | None = None  # None: DEFAULT_TIER_WEIGHTS
    unknown_fields: str = "refuse"  # refuse | ignore (the OpenAI front)
    client_stall_timeout: float = CLIENT_STALL_TIMEOUT_S  # make_server's stall_timeout_s

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> RouterConfig:
        """Raises ValueError naming the flag that is wrong."""
        if bool(a.tls_cert) != bool(a.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if a.request_timeout <= 0:
            raise ValueError(f"--request-timeout {a.request_timeout}: must be > 0")
        if a.client_stall_timeout <= 0:
            raise ValueError(f"--client-stall-timeout {a.client_stall_timeout}: must be > 0")
        try:
            weights = parse_weights(a.scorers)
        except ValueError as e:
            raise ValueError(f"--scorers: {e}") from None
        try:
            tier_weights = resolve_tier_weights(a.tier_weights)
        except ValueError as e:
            raise ValueError(f"--tier-weights: {e}") from None
        try:
            keys = ApiKeys.load(a.auth_token, a.api_keys_file)
        except OSError as e:
            raise ValueError(f"--api-keys-file: {e}") from None
        # the flags named as the fields are, taken by name; the rest are parsed above
        same = {f.name: getattr(a, f.name) for f in dataclasses.fields(cls)
                if f.name not in ("weights", "tier_weights", "keys", "limits", "tls")}
        return cls(**same, weights=weights, tier_weights=tier_weights, keys=keys,
                   limits=Limits(a.max_concurrent, a.max_queued, a.max_concurrent_per_key),
                   tls=(a.tls_cert, a.tls_key) if a.tls_cert else None)

    @property
    def threads(self) -> int:
        """A thread per running or waiting request, and a few for health and listing; past that
        the gRPC server itself refuses (RESOURCE_EXHAUSTED) rather than queueing without
        bound."""
        lim = self.limits
        return lim.max_concurrent + lim.max_queued + 16 if lim.max_concurrent else 1024


def resolve_tier_weights(spec: str) -> dict[str, float]:
    """``--tier-weights``: given, or (auto) from the local `baton profile`, or the defaults;
    logged with where they came from."""
    if spec != "auto":
        w = parse_tier_weights(spec)
        log.info("KV tier weights %s (--tier-weights)", w)
        return w
    from baton.control.profile import Profile, ProfileError, default_path, tier_weights

    path = default_path()
    try:
        measured = tier_weights(Profile.load(path)) if path.exists() else {}
    except ProfileError as e:
        log.warning("KV tier weights: %s; using the defaults", e)
        measured = {}
    w = {**DEFAULT_TIER_WEIGHTS, **measured}
    log.info("KV tier weights %s (%s)", w, f"measured in {path}" if measured else
             "defaults: no profile with tier loads; `baton profile` measures them")
    return w


# ---- start-up ------------------------------------------------------------------------------------


def build_orchestrator(cfg: RouterConfig, client, pool: WorkerPool,
                       router_id: str) -> Orchestrator:
    """The orchestrator, with the tokenizer and model identity of the first worker that
    answers (waits up to ``--startup-timeout`` for one)."""
    tok, worker = pool.tokenizer(cfg.startup_timeout)
    pool.pin_fingerprint(worker.fingerprint)
    index = (PrefixIndex(client, router_id, cfg.inflight_ttl)
             if cfg.routing == "cache-aware" else None)
    policy = RoutingPolicy(pool, index, mode=cfg.routing, weights=cfg.weights,
                           local_max_new_tokens=cfg.local_prefill_max_tokens,
                           prefill_saturation=cfg.prefill_saturation,
                           saturated_local_max_tokens=cfg.saturated_local_max_tokens,
                           tier_weights=cfg.tier_weights)
    policy.prompt_hashes([0] * 256, worker.fingerprint, None, 16)  # builds the native hasher
    settings = RouterSettings(
        model=tok.model, max_model_len=tok.max_model_len, fingerprint=worker.fingerprint,
        max_retries=cfg.max_retries, max_migrations=cfg.max_migrations,
        max_prompt_tokens=cfg.max_prompt_tokens, max_tokens=cfg.max_tokens,
        stall_timeout_s=cfg.stall_timeout, request_timeout_s=cfg.request_timeout,
        limits=cfg.limits, workload_window_s=cfg.workload_window)
    tokenizer = BatonTokenizer.from_json(json.loads(tok.tokenizer_json))
    return Orchestrator(pool, tokenizer, settings, policy)


def grpc_server(cfg: RouterConfig):
    """The gRPC server (not started) and its bound port."""
    import grpc

    server = make_server(max_workers=cfg.threads,
                         interceptors=[TokenAuth(cfg.keys)] if cfg.keys else [],
                         max_concurrent_rpcs=cfg.threads,
                         stall_timeout_s=cfg.client_stall_timeout)
    if cfg.tls:
        with open(cfg.tls[0], "rb") as c, open(cfg.tls[1], "rb") as k:
            creds = grpc.ssl_server_credentials([(k.read(), c.read())])
        return server, server.add_secure_port(f"{cfg.host}:{cfg.port}", creds)
    return server, server.add_insecure_port(f"{cfg.host}:{cfg.port}")


def http_front(cfg: RouterConfig, orchestrator: Orchestrator) -> tuple[HttpServer | None, str]:
    """Start the OpenAI front (unless ``--http-port -1``): (its server, its address), or
    (None, "")."""
    if cfg.http_port < 0:
        return None, ""
    from baton.services.router.openai_http import serve_http

    http = serve_http(orchestrator, cfg.host, cfg.http_port, keys=cfg.keys, tls=cfg.tls,
                      threads=cfg.threads, unknown_fields=cfg.unknown_fields)
    address = f"{cfg.host}:{http.port}"
    log.info("OpenAI-compatible HTTP on %s://%s/v1", "https" if cfg.tls else "http", address)
    print(f"BATON_HTTP {address}", flush=True)
    return http, address


def main(argv: list[str] | None = None) -> None:
    ap = parser()
    try:
        cfg = RouterConfig.from_args(ap.parse_args(argv))
    except ValueError as e:
        ap.error(str(e))
    setup_logging(cfg.log_level)
    from baton.control.redis_client import connect

    # short timeouts: a Redis that hangs must not stall routing (the index degrades instead)
    client = connect(cfg.redis_url, socket_timeout=0.5)
    pool = WorkerPool(WorkerRegistry(client))
    server, port = grpc_server(cfg)
    router_id = f"router-{cfg.host}-{port}-{new_incarnation()}"
    tracing.setup("router", router_id)
    orchestrator = build_orchestrator(cfg, client, pool, router_id)
    api_pb2_grpc.add_BatonServicer_to_server(RouterServicer(orchestrator), server)
    health = add_standard_services(server, ["baton.v1.Baton"])
    # NOT_SERVING (and /health 503) while no worker of a role answers its probes
    orchestrator.liveness = Liveness(pool, health=health, services=("", "baton.v1.Baton")).start()
    pool.still_answering = orchestrator.liveness.answers
    server.start()
    address = f"{cfg.host}:{port}"
    log.info("router serving %s on %s", orchestrator.model, address)
    http, http_address = http_front(cfg, orchestrator)
    # in the registry for `baton status` (routers do not route to each other)
    host = advertised_host(cfg)
    registration = Registration(WorkerRegistry(client), RouterRecord(
        router_id, f"{host}:{port}",
        f"{host}:{http_address.rsplit(':', 1)[1]}" if http_address else "",
        orchestrator.model, tls=bool(cfg.tls))).start()
    drain = announce(address, f"router-{cfg.host}-{port}", new_incarnation())

    def on_stop() -> None:
        if orchestrator.policy.index is not None:
            orchestrator.policy.index.retire()  # its in-flight counts leave with it
        tracing.shutdown()

    # a drain finishes the HTTP front's streams as it does the gRPC server's
    serve_forever(server, on_stop, registration, cfg.drain_timeout, health=health,
                  drain=drain, also=[http.stop] if http is not None else [])


if __name__ == "__main__":
    main()
