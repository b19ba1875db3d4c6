"""Redis is not a single point of failure, on real processes: `baton up` restarts its
redis-server, every process serves through the outage and comes back into an empty Redis, a
worker starts while Redis is down, the router's health says what it can serve, and a Sentinel
failover is survived. No request is lost or wrong: every output equals the greedy reference."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from baton.control.redis_server import EmbeddedRedis, redis_server_binary
from baton.control.registry import WorkerRegistry
from baton.services.launch.local import WorkerProcess

from tests.support.api import generate_ids
from tests.support.processes import free_port
from tests.support.up import Up

pytestmark = pytest.mark.slow

PROMPTS = [[(7 * i + 13 * k) % 380 + 10 for i in range(60 + 3 * k)] for k in range(6)]
NEW = 12


def health(http_address: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://{http_address}/health", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def until(check, what: str, timeout: float = 60.0):
    """Poll ``check()`` until it returns something true; the bound is a hang detector."""
    end = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.1)


class Load:
    """Threads sending the PROMPTS round and round through ``router`` until stopped; every
    output is compared with ``want``."""

    def __init__(self, router, want: dict, threads: int = 4) -> None:
        self.router, self.want = router, want
        self.done, self.wrong, self.errors = 0, [], []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True)
                         for k in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self, k: int) -> None:
        i = k
        while not self._stop.is_set():
            p = PROMPTS[i % len(PROMPTS)]
            try:
                out, _ = generate_ids(self.router, p, NEW, timeout=120)
            except Exception as e:  # noqa: BLE001 - recorded: the test says which may be
                self.errors.append((time.monotonic(), e))
            else:
                if out != self.want[tuple(p)]:
                    self.wrong.append(tuple(p))
                self.done += 1
            i += 1

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(150)


def test_redis_then_the_decode_worker_killed_under_load(tiny_llama, tmp_path):
    # the scenario: redis-server SIGKILLed under streamed load, then the only decode
    # worker; baton up starts both again, the worker registers into the empty Redis, the
    # prefill worker republishes its prefix set, and nothing is lost or wrong
    up = Up(tmp_path, "--model", str(tiny_llama[0]), "--prefill", "1", "--decode", "1",
            "--num-blocks", "256", "--http-port", "0", "--local-prefill-max-tokens", "16")
    try:
        want = {tuple(p): generate_ids(up.router, p, NEW)[0] for p in PROMPTS}
        load = Load(up.router, want)
        until(lambda: load.done >= 4, "requests before the fault")
        # a Redis that hangs (SIGSTOP): the router serves on from its last view and says its
        # view is stale; `baton status` says Redis is down and what the router still sees
        pid = up.redis_pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            code, body = until(lambda: (lambda r: r if not r[1]["registry"]["reachable"]
                                        else None)(health(up.router.http_address)),
                               "the router noticing Redis is unreachable")
            assert code == 200 and "warnings" in body  # workers answer: still serving
            status = subprocess.run(["baton", "status", "--redis-url", up.redis_url],
                                    capture_output=True, text=True, timeout=60)
            assert status.returncode == 1 and ": DOWN" in status.stdout, status
            assert "without Redis for" in status.stdout
        finally:
            os.kill(pid, signal.SIGCONT)
        mark = len(up.lines)
        os.kill(up.redis_pid(), signal.SIGKILL)
        up.wait_line(r"redis-server exited", "baton up noticing Redis died", mark)
        up.wait_line(r"redis-server back on", "baton up restarting Redis", mark)
        registry = WorkerRegistry.from_url(up.redis_url)
        until(lambda: len(registry.workers()) == 2, "both workers in the new Redis")
        served = load.done
        until(lambda: load.done >= served + 4, "requests served with Redis restarted")
        assert not load.errors and not load.wrong, (load.errors[:3], load.wrong[:3])
        mark = len(up.lines)
        os.kill(up.pid_of("decode"), signal.SIGKILL)
        up.wait_line(r"decode worker back", "baton up restarting the decode worker", mark)
        until(lambda: health(up.router.http_address)[0] == 200, "the router healthy again")
        back, served = time.monotonic(), load.done
        until(lambda: load.done >= served + 6, "requests after the decode worker is back")
        load.stop()
        # while the only decode worker was dead, a new request ended at once with a typed
        # error (the one in flight was migrated or retried); none was wrong, none hung, and
        # none failed once it was back
        assert not load.wrong, load.wrong[:3]
        for at, e in load.errors:
            assert isinstance(e, grpc.RpcError), e
            assert e.code() == grpc.StatusCode.UNAVAILABLE and "no decode worker" in e.details()
            assert at < back + 5, (at - back, e.details())
        # the index is whole again: the prefill worker's blocks for a prompt it served
        # before the outage are found (the router's index says so on the final message)
        _, final = generate_ids(up.router, PROMPTS[0], NEW)
        assert final.index_cached_tokens > 0 and final.usage.cached_tokens > 0
        status = subprocess.run(["baton", "status", "--redis-url", up.redis_url, "--json"],
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        restarts = {r["what"]: r["restarts"] for r in json.loads(status.stdout)["restarts"]}
        assert restarts["redis-server"] == 1 and restarts["decode worker"] == 1
        up.assert_quiet(workers=2)
    finally:
        assert up.stop() == 0


def test_a_worker_started_while_redis_is_down_serves_once_it_is_up(tiny_llama):
    # a worker and a router of a Redis that is not there yet: the worker starts and serves
    # (no traceback, a log line); when Redis comes up the worker registers itself and the
    # router, which learns workers only from the registry, routes to it
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    worker = WorkerProcess("decode", ["--redis-url", url, "--num-blocks", "128",
                                      "--threads", "1", "--model", str(tiny_llama[0])])
    redis = None
    try:
        assert worker.info().num_blocks == 128  # it serves its own API meanwhile
        redis = EmbeddedRedis(port=port).start()
        registry = WorkerRegistry.from_url(url)
        until(lambda: registry.workers(), "the worker registering itself", timeout=30)
        router = WorkerProcess("router", ["--redis-url", url, "--http-port", "0"])
        try:
            out, final = generate_ids(router, PROMPTS[1], NEW)
            assert len(out) == NEW and final.finish_reason == "length"
        finally:
            router.stop()
        assert "Traceback" not in worker.log_tail(10000)
        assert "Redis unreachable" in worker.log_tail(10000)
    finally:
        worker.stop()
        if redis is not None:
            redis.stop()


def test_health_says_degraded_while_no_decode_worker_answers(start_cluster, tiny_llama):
    c = start_cluster(prefill=1, decode=1, worker_args=["--model", str(tiny_llama[0])],
                      routers=[["--http-port", "0"]])
    http = c.router.http_address
    until(lambda: health(http)[0] == 200, "healthy at start")
    c.decode[0].kill()  # its registry entry lives on for the TTL: the probes see it is gone
    code, body = until(lambda: (lambda r: r if r[0] == 503 else None)(health(http)),
                       "degraded with the decode worker dead", timeout=20)
    assert body["status"] == "degraded" and "no decode worker answered" in body["reasons"][0]
    assert body["workers"].get("decode", 0) == 0
    until(lambda: _grpc_health(c.router) == "NOT_SERVING", "the gRPC health not serving")
    c.decode[0] = c.start_worker("decode")
    until(lambda: health(http)[0] == 200, "healthy again with a new decode worker")
    until(lambda: _grpc_health(c.router) == "SERVING", "the gRPC health serving again")


def _grpc_health(router) -> str:
    """The router's gRPC health (a plain generated stub, as a load balancer asks)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(router.address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="baton.v1.Baton"), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def test_an_empty_redis_is_repopulated(start_cluster, tiny_llama):
    # Redis comes back empty (FLUSHALL: a restart without persistence, a failover to a replica
    # that had not caught up): registry entries, prefix sets and the load come back
    import redis as redis_py

    c = start_cluster(prefill=1, decode=1, worker_args=["--model", str(tiny_llama[0])],
                      routers=[["--http-port", "0", "--local-prefill-max-tokens", "16"]])
    out, _ = generate_ids(c.router, PROMPTS[2], NEW)
    client = redis_py.Redis.from_url(c.redis.url)
    client.flushall()
    registry = WorkerRegistry(client)
    until(lambda: len(registry.workers()) == 2, "the workers registered again", timeout=30)
    until(lambda: any(client.scard(k) for k in client.scan_iter(match="baton:pc:*")),
          "a prefix set published again", timeout=30)
    again, final = generate_ids(c.router, PROMPTS[2], NEW)
    assert again == out and final.index_cached_tokens > 0


def test_a_sentinel_failover_is_survived(tiny_llama, tmp_path):
    # a master, a replica and a sentinel on loopback; the cluster is given the sentinel URL.
    # The master dies; the sentinel promotes the replica; workers re-register there, the
    # router reads it, requests keep being served with the same tokens
    binary = redis_server_binary()
    master = EmbeddedRedis().start()
    replica = subprocess.Popen([binary, "--port", str(rport := free_port()), "--bind",
                                "127.0.0.1", "--save", "", "--appendonly", "no",
                                "--replicaof", "127.0.0.1", str(master.port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sport = free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(f"port {sport}\nbind 127.0.0.1\nsentinel monitor baton 127.0.0.1 "
                    f"{master.port} 1\nsentinel down-after-milliseconds baton 1000\n"
                    "sentinel failover-timeout baton 5000\n")
    sentinel = subprocess.Popen([binary, str(conf), "--sentinel"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    url = f"redis+sentinel://127.0.0.1:{sport}/baton"
    procs = []
    try:
        import redis as redis_py

        until(lambda: _replica_synced(redis_py, rport), "the replica in sync")
        # the sentinel learns of replicas from the master's INFO (every 10 s): it can only
        # promote one it knows
        watcher = redis_py.Redis(port=sport)
        until(lambda: any("disconnected" not in r.get("flags", "")
                          for r in watcher.sentinel_slaves("baton")),
              "the sentinel knowing the replica", timeout=60)
        args = ["--redis-url", url, "--model", str(tiny_llama[0]), "--threads", "1",
                "--num-blocks", "128"]
        procs += [WorkerProcess("prefill", args), WorkerProcess("decode", args)]
        router = WorkerProcess("router", ["--redis-url", url, "--http-port", "0",
                                          "--local-prefill-max-tokens", "16"])
        procs.append(router)
        want, _ = generate_ids(router, PROMPTS[3], NEW)
        master.proc.kill()
        promoted = redis_py.Redis(port=rport)
        until(lambda: promoted.info("replication")["role"] == "master",
              "the sentinel promoting the replica", timeout=60)
        until(lambda: len(WorkerRegistry(promoted).workers()) == 2,
              "the workers registered on the new master", timeout=30)
        for p in PROMPTS[3:5]:
            out, final = generate_ids(router, p, NEW, timeout=120)
            assert final.finish_reason == "length" and len(out) == NEW
        assert generate_ids(router, PROMPTS[3], NEW)[0] == want
    finally:
        for p in reversed(procs):
            p.stop()
        sentinel.kill()
        replica.kill()
        master.stop()


def _replica_synced(redis_py, port: int) -> bool:
    try:
        return redis_py.Redis(port=port).info("replication").get("master_link_status") == "up"
    except redis_py.RedisError:
        return False
