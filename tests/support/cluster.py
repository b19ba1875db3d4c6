"""A cluster of real processes on loopback for tests: a redis-server, N prefill workers, M decode
workers and K routers, started tier by tier (each tier in parallel), always stopped.

    c = Cluster(prefill=1, decode=2, routers=[["--http-port", "0"]])
    c.router                  # the first router (c.routers[k] for the others)
    c.prefill[0], c.decode[1] # WorkerProcess: .address, .worker_id, .info(), .kill(), .stop()
    c.assert_quiet()          # free == total blocks, no leases, nothing running, integrity ok
    c.stop()                  # every process it started, in reverse order; then Redis

Test modules take the ``start_cluster`` fixture (tests/conftest.py), which stops every cluster a
module started when the module ends. A start that fails stops whatever had started before the
error propagates, so a broken worker never leaves processes behind.

Workers run one torch thread each unless ``worker_args`` says otherwise: several processes with
torch's default (every core each) spin against each other on a small CI machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
from baton.control.redis_server import EmbeddedRedis
from baton.services.launch.local import WorkerProcess
from baton.v1 import worker_pb2, worker_pb2_grpc

PerWorker = Callable[["Cluster", int], Sequence[str]]


def info(w: WorkerProcess, timeout: float = 30.0) -> worker_pb2.InfoResponse:
    """A worker's Info with an integrity check, waiting for its channel (which may be
    reconnecting after a network fault) rather than failing at once."""
    stub = (worker_pb2_grpc.PrefillWorkerStub(w.channel) if w.role == "prefill"
            else worker_pb2_grpc.DecodeWorkerStub(w.channel))
    end = time.monotonic() + timeout
    while True:
        try:
            return stub.Info(worker_pb2.InfoRequest(check_integrity=True), timeout=timeout,
                             wait_for_ready=True)
        except grpc.RpcError as e:  # a connection the fault broke, seen once
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > end:
                raise
            time.sleep(0.2)


class Cluster:
    """``worker_args``: for every worker; ``role_args``: per role ("prefill", "decode");
    ``prefill_args(cluster, i)``, ``decode_args(cluster, i)``: for the i-th worker of that role
    (decode workers start after the prefill workers, so theirs may name those addresses);
    ``routers``: one argument list per router (each gets ``--redis-url``; ``--http-port -1``
    unless it names one); ``env``: added to every process's environment."""

    def __init__(self, *, prefill: int = 1, decode: int = 1,
                 routers: Sequence[Sequence[str]] = ((),), worker_args: Sequence[str] = (),
                 role_args: dict[str, Sequence[str]] | None = None,
                 decode_args: PerWorker | None = None, prefill_args: PerWorker | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.prefill: list[WorkerProcess] = []
        self.decode: list[WorkerProcess] = []
        self.routers: list[WorkerProcess] = []
        self._started: list[WorkerProcess] = []  # everything, for stop()
        self._extra: list[WorkerProcess] = []  # workers one test added for itself
        self._after_test: list[Callable[[], None]] = []
        self.env = env
        self.redis = EmbeddedRedis().start()
        threads = [] if "--threads" in worker_args else ["--threads", "1"]
        self.worker_args = ["--redis-url", self.redis.url, *threads, *worker_args]
        self.role_args = {k: list(v) for k, v in (role_args or {}).items()}
        self.router_args = [self._router_args(r) for r in routers]
        try:
            self.prefill += self._start_all(
                [("prefill", list(prefill_args(self, i)) if prefill_args else [])
                 for i in range(prefill)])
            self.decode += self._start_all(
                [("decode", list(decode_args(self, i)) if decode_args else [])
                 for i in range(decode)])
            self.routers += self._start_all([("router", a) for a in self.router_args], raw=True)
        except BaseException:
            self.stop()
            raise

    def _router_args(self, args: Sequence[str]) -> list[str]:
        http = [] if "--http-port" in args else ["--http-port", "-1"]
        return ["--redis-url", self.redis.url, *http, *args]

    def _start_all(self, specs: list[tuple[str, list[str]]],
                   raw: bool = False) -> list[WorkerProcess]:
        """Start these in parallel; every one that started is kept for stop() even when
        another fails."""
        if not specs:
            return []
        with ThreadPoolExecutor(len(specs)) as ex:
            futures = [ex.submit(self._start, role, args, raw) for role, args in specs]
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise errors[0]
        return [f.result() for f in futures]

    def _start(self, role: str, args: Sequence[str], raw: bool = False) -> WorkerProcess:
        full = list(args) if raw else [*self.worker_args, *self.role_args.get(role, ()), *args]
        w = WorkerProcess(role, full, env=self.env)
        self._started.append(w)
        return w

    # ---- changing the cluster ---------------------------------------------------------------

    @property
    def router(self) -> WorkerProcess:
        return self.routers[0]

    def start_worker(self, role: str, *args: str) -> WorkerProcess:
        """A new worker of ``role`` with the cluster's arguments: it joins through the
        registry, nothing else restarts (the caller puts it where it belongs)."""
        return self._start(role, args)

    def start_extra(self, role: str, *args: str) -> WorkerProcess:
        """A worker for one test: :meth:`after_test` kills it if the test did not."""
        w = self.start_worker(role, *args)
        self._extra.append(w)
        return w

    def start_router(self, *args: str) -> WorkerProcess:
        """Another router on this cluster's Redis (``--http-port -1`` unless ``args`` name one);
        stopped with the cluster if the caller does not stop it first."""
        return self._start("router", self._router_args(args), raw=True)

    @staticmethod
    def wait_router_sees(router: WorkerProcess, timeout: float = 60.0, **roles: int) -> None:
        """Until ``router``'s view of the registry (re-read at most every second) counts
        ``roles`` workers (``decode=2``...), read from its ``/health`` (it needs its HTTP
        front). Instead of sleeping through a refresh: the bound is a hang detector."""
        import json
        import urllib.error
        import urllib.request

        assert router.http_address, "the router needs --http-port to be asked"
        end = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://{router.http_address}/health",
                                            timeout=30) as r:
                    body = json.loads(r.read())
            except urllib.error.HTTPError as e:  # 503: no decode worker (yet)
                body = json.loads(e.read())
            seen = body.get("workers", {})
            if all(seen.get(role, 0) == n for role, n in roles.items()):
                return
            assert time.monotonic() < end, f"the router sees {seen}, not {roles}"
            time.sleep(0.05)

    def restart_router(self, k: int = 0, graceful: bool = False) -> WorkerProcess:
        """Router ``k`` SIGKILLed (or drained with ``graceful``), then a new one with the same
        arguments on a new port."""
        old = self.routers[k]
        old.stop() if graceful else old.kill()
        self.routers[k] = self._start("router", self.router_args[k], raw=True)
        return self.routers[k]

    def on_after_test(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` at the next :meth:`after_test` (a load's clients halting, say)."""
        self._after_test.append(fn)

    def after_test(self) -> None:
        """Leave nothing of a test (passed or failed) to the next in a module-scoped cluster:
        its hooks run and the workers it added for itself are killed."""
        hooks, self._after_test = self._after_test, []
        for fn in hooks:
            fn()
        for w in self._extra:
            if w.proc.poll() is None:
                w.kill()
        self._extra.clear()

    # ---- checks ---------------------------------------------------------------------------------

    def workers(self) -> list[WorkerProcess]:
        """The prefill and decode workers still running."""
        return [w for w in (*self.prefill, *self.decode) if w.proc.poll() is None]

    def blocks_held(self) -> list[tuple[str, int, int, int]]:
        """(worker, blocks in use, active leases, running requests) of each live worker that
        holds anything; every worker's integrity check must pass."""
        held = []
        for w in self.workers():
            i = info(w)
            assert i.integrity_ok, (w.worker_id, i.integrity_error)
            if i.num_free_blocks != i.num_blocks or i.active_leases or i.running_requests:
                held.append((w.worker_id, i.num_blocks - i.num_free_blocks, i.active_leases,
                             i.running_requests))
        return held

    def assert_quiet(self, timeout: float = 40.0) -> None:
        """free == total, no leases, nothing running, on every live worker, within ``timeout``
        (leases of requests whose reader died end at the lease TTL at the latest)."""
        end = time.monotonic() + timeout
        while (held := self.blocks_held()) and time.monotonic() < end:
            time.sleep(0.25)
        assert not held, held

    # ---- teardown ---------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every process this cluster started (the newest first), then Redis."""
        try:
            self.after_test()
        finally:
            for w in reversed(self._started):
                w.stop()
            self.redis.stop()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
