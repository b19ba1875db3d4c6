"""What every Baton server process (a worker, a router) does around its gRPC server: build it,
add health and reflection, announce readiness, drain on SIGTERM, log. Torch-free."""

from __future__ import annotations

import logging
import secrets
import sys
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent import futures

import grpc

from baton import set_on_signals

log = logging.getLogger("baton.services")


def make_server(max_workers: int = 32, interceptors=(),
                max_concurrent_rpcs: int | None = None,
                control: Collection[str] = (), control_threads: int = 4,
                stall_timeout_s: float | None = None) -> grpc.Server:
    """A gRPC server on ``max_workers`` threads; with ``max_concurrent_rpcs``, calls past that
    many at once end RESOURCE_EXHAUSTED instead of queueing for a thread without bound.

    ``stall_timeout_s``: how long a peer may leave what the server sent it unread (its
    receive window full: a client process paused or too busy to read, or the machine stopped)
    before its connection, and every call on it, is cut. gRPC cuts at 20 s by default: it sets
    TCP_USER_TIMEOUT on a server's connections to the keepalive timeout (gRPC proposal A18),
    which is what this sets. The server's own keepalive pings (every 2 hours by default) wait
    as long for their answer.

    ``control``: full method names ("/baton.v1.WorkerAdmin/SetRole") that run on
    ``control_threads`` threads of their own. Every call holds a thread for as long as it runs
    (a decode stream for its whole output), so with every thread taken by such calls a short
    one (a health check, a role switch) would wait for one of them to end."""
    interceptors = list(interceptors)
    if control:
        pool = futures.ThreadPoolExecutor(max_workers=control_threads,
                                          thread_name_prefix="grpc-control")
        interceptors.append(_OnOwnThreads(frozenset(control), pool))
    options: list[tuple[str, int]] = [("grpc.so_reuseport", 0)]
    if stall_timeout_s is not None:
        options.append(("grpc.keepalive_timeout_ms", max(1, round(stall_timeout_s * 1000))))
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                       interceptors=interceptors, options=options,
                       maximum_concurrent_rpcs=max_concurrent_rpcs)


class _OnOwnThreads(grpc.ServerInterceptor):
    """Runs the named methods on ``pool``: gRPC runs a handler on the pool its behaviour names
    in ``experimental_thread_pool``, else on the server's."""

    KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")

    def __init__(self, methods: frozenset[str], pool: futures.ThreadPoolExecutor) -> None:
        self.methods, self.pool = methods, pool

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self.methods:
            return handler
        kind = next(k for k in self.KINDS if getattr(handler, k) is not None)
        inner = getattr(handler, kind)

        def behaviour(request, context):
            return inner(request, context)

        behaviour.experimental_thread_pool = self.pool
        return getattr(grpc, f"{kind}_rpc_method_handler")(
            behaviour, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


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
                  drain: threading.Event | None = None,
                  also: Sequence[Callable[[float], None]] = ()) -> None:
    """Block until SIGTERM/SIGINT (``drain``, from :func:`announce`), then drain: deregister
    (routers stop sending work), wait while ``busy()`` (work that still needs RPCs in: a
    prefill worker's leased blocks wait for their readers' release calls), refuse new RPCs,
    let the ones in flight finish, run ``on_stop``, return. All of it within ``drain_timeout``.
    ``also``: the process's other servers (the router's HTTP front), each called with the
    seconds left when the gRPC server starts its grace, in a thread of its own: it stops
    accepting, finishes what it serves and returns within that time.

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
    # a timed wait: a process-directed signal can land on another thread (the kernel picks the
    # main thread only when nothing is pending on it); its C handler then only flags it, and the
    # Python handler runs on the main thread's next bytecode, which a bare wait() never reaches
    while not done.wait(0.25):
        pass
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
    grace = max(0.0, deadline - time.monotonic())
    others = [threading.Thread(target=stop, args=(grace,), name="drain-other", daemon=True)
              for stop in also]
    for t in others:
        t.start()
    server.stop(grace=grace).wait()
    for t in others:
        t.join(max(0.0, deadline - time.monotonic()))
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


def advertised_host(args) -> str:
    """The host part of the address this process registers (see ``--advertise-host``); ``args``
    has ``host`` and ``advertise_host`` (the command line, or a role's config)."""
    if getattr(args, "advertise_host", None):
        return args.advertise_host
    if args.host in ("0.0.0.0", "", "::"):
        return _own_address()
    return args.host


def _own_address() -> str:
    """This machine's address as others reach it: its hostname's, else the source address of
    its route to the outside (a container or namespace whose hostname resolves nowhere)."""
    import socket

    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: picks the route, sends nothing
            return s.getsockname()[0]
    except OSError:
        raise SystemExit(f"error: this machine's hostname {name!r} resolves nowhere and no "
                         "route tells its address: set --advertise-host (or "
                         "$BATON_ADVERTISE_HOST) to the address others reach it at") from None


def is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def new_incarnation() -> str:
    return secrets.token_hex(6)
