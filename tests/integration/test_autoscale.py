"""`baton up --autoscale` on a tiny model: a step up in load grows the decode pool, the step
down shrinks it (draining), and no request fails across either change. Real processes: redis,
workers, router, the autoscaler reading their /metrics through the Redis registry.

The decode pool's pressure here is its KV usage (a small pool, long prompts): deterministic on
any machine, where TPOT on a tiny model hardly depends on the load."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from baton.bench.loadgen import ClosedLoop, GrpcTarget, Req
from baton.control.registry import WorkerRegistry

from tests.support.up import own_cache

pytestmark = pytest.mark.slow


def closed_loop(address: str) -> ClosedLoop:
    """Back-to-back 200-token prompts, 48 tokens out each; failures: errors and short outputs."""
    return ClosedLoop(GrpcTarget(address, timeout=60), lambda rng: Req(
        [rng.randrange(5, 390) for _ in range(200)], 48))


def wait_for(pred, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, f"timed out after {timeout:.0f}s: {what}"
        time.sleep(0.5)
    return time.monotonic() - t0


def test_decode_pool_follows_a_step_in_load_without_failing_a_request(tiny_llama, tmp_path):
    up = subprocess.Popen(
        [sys.executable, "-m", "baton.cli.main", "up", "--model", str(tiny_llama[0]),
         "--num-blocks", "128", "--grpc-port", "0", "--http-port", "0",
         "--log-dir", str(tmp_path), "--autoscale", "--max-decode", "2",
         "--ttft-slo", "30", "--tpot-slo", "5", "--kv-target", "0.5",
         "--scale-interval", "1", "--scale-window", "4", "--scale-up-cooldown", "3",
         "--scale-down-cooldown", "6", "--scale-down-after", "6"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**__import__("os").environ, **own_cache(tmp_path)})
    lines: list[str] = []
    pump = threading.Thread(target=lambda: lines.extend(up.stdout), daemon=True)
    load = None
    try:
        for line in up.stdout:
            lines.append(line)
            if "ready: gRPC API" in line:
                break
        m = re.search(r"on (\S+:\d+);", lines[-1])
        assert m, "".join(lines)
        redis_url = re.search(r"redis-server on (\S+)", "".join(lines)).group(1)
        pump.start()
        registry = WorkerRegistry.from_url(redis_url)

        def decodes() -> int:
            return len(registry.workers("decode"))

        assert decodes() == 1
        load = closed_loop(m.group(1))
        load.set(8)  # the step up: 8 x 248 tokens want ~136 blocks of the pool's 128
        grew = wait_for(lambda: decodes() == 2, 90, "the decode pool to grow")
        ok_at_growth = load.ok
        time.sleep(5)
        load.set(1)  # the step down: one request in flight keeps the pool busy while it drains
        shrank = wait_for(lambda: decodes() == 1, 120, "the decode pool to shrink")
        time.sleep(3)
        load.set(0)
    finally:
        if load is not None:
            load.set(0)
        up.send_signal(signal.SIGINT)
        up.wait(120)
        pump.join(10)
    out = "".join(lines)
    assert up.returncode == 0, out
    assert re.search(r"autoscale: decode pool 1 -> 2", out), out
    assert re.search(r"autoscale: decode pool 2 -> 1", out), out
    assert "prefill pool" not in out  # its pressure (TTFT) stayed low: never changed
    assert load.errors == [], load.errors[:5]  # no status error, no short output
    assert ok_at_growth > 0 and load.ok > ok_at_growth
    print(f"grew after {grew:.0f}s, shrank {shrank:.0f}s after the load dropped; "
          f"{load.ok} requests, none failed")


def test_baton_autoscale_patches_kubernetes_deployments(tmp_path):
    """`baton autoscale --kubernetes` as its own process, with a kubeconfig pointing at the fake
    API server (none can run here) and a real Redis with no traffic: both pools are raised to
    their minimum at the first decision; /healthz and /decisions answer; SIGTERM ends it."""
    import json
    import os
    import urllib.request

    from baton.control.redis_server import EmbeddedRedis

    from tests.support.kube import FakeKube
    from tests.support.processes import free_port

    pytest.importorskip("kubernetes")
    kube = FakeKube({"rel-baton-prefill": 1, "rel-baton-decode": 1})
    (tmp_path / "kubeconfig").write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": kube.url}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}}]}))
    port = free_port()
    with EmbeddedRedis() as redis:
        proc = subprocess.Popen(
            [sys.executable, "-m", "baton.cli.main", "autoscale", "--kubernetes",
             "--redis-url", redis.url, "--namespace", "serving",
             "--prefill-deployment", "rel-baton-prefill",
             "--decode-deployment", "rel-baton-decode", "--min-prefill", "2",
             "--min-decode", "3", "--scale-interval", "0.5", "--health-port", str(port)],
            env={**os.environ, "KUBECONFIG": str(tmp_path / "kubeconfig")},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            wait_for(lambda: kube.replicas == {"rel-baton-prefill": 2, "rel-baton-decode": 3},
                     60, "the Deployments to be scaled to their minimums")
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
                assert r.status == 200
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/decisions", timeout=5) as r:
                changes = {(d["pool"], d["from"], d["to"]) for d in json.loads(r.read())}
            assert changes == {("prefill", 1, 2), ("decode", 1, 3)}
        finally:
            proc.send_signal(signal.SIGTERM)
            out = proc.communicate(timeout=30)[0]
            kube.close()
    assert proc.returncode == 0, out
    assert "decode pool 1 -> 3" in out, out
