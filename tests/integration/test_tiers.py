"""KV tiers on a real cluster: a prefill worker with a small pool and a disk tier, behind a real
router and Redis. A prompt evicted from the pool comes back from disk with the same greedy
tokens, the router's index sees the disk blocks before the worker loads them, the answer and
/metrics count them, and a restarted worker (same --worker-id and directory, new incarnation)
revalidates its file and serves from it again. Tiny random Llama, 4-token blocks."""

from __future__ import annotations

import random
import time

import pytest
import redis
from baton.control.prefix_index import index_key

from tests.support.api import generate_ids
from tests.support.observe import documented_metrics, scrape

pytestmark = pytest.mark.slow

BS = 4
POOL = 40  # blocks: one 96-token prompt (24 blocks + its answer) and a half


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 400) for _ in range(n)]


def generate(router, ids, max_tokens=6):
    return generate_ids(router, ids, max_tokens)


def wait_until(cond, what: str, timeout: float = 60.0) -> None:
    """Poll ``cond`` (the index publishes every ~20 ms); the bound is a hang detector."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def indexed(cluster, worker, tier: str) -> int:
    """Blocks the Redis index lists in ``worker``'s ``tier`` (its current incarnation)."""
    r = redis.Redis.from_url(cluster.redis.url)
    return r.scard(index_key(worker.worker_id, worker.incarnation, tier))


@pytest.fixture(scope="module")
def cluster(start_cluster, tiny_llama, tmp_path_factory):
    tier_dir = tmp_path_factory.mktemp("kv-tier")
    return start_cluster(
        prefill=1, decode=1,
        worker_args=["--model", str(tiny_llama[0]), "--block-size", str(BS)],
        role_args={"prefill": ["--num-blocks", str(POOL), "--kv-disk-tier-gb", "0.05",
                               "--kv-disk-tier-dir", str(tier_dir), "--worker-id", "tiered-p"],
                   "decode": ["--num-blocks", "512"]},
        routers=[["--local-prefill-max-tokens", "0", "--http-port", "0"]])


def test_an_evicted_prompt_comes_back_from_disk_and_after_a_restart(cluster):
    prompt = tokens(1, 97)  # 24 reusable blocks
    cold, f0 = generate(cluster.router, prompt)
    assert f0.path == "remote" and f0.usage.cached_tokens == 0
    for seed in (2, 3):  # two other prompts push the first one out of the 40-block pool
        generate(cluster.router, tokens(seed, 97))
    p = cluster.prefill[0]

    def disk_blocks() -> float:
        return scrape(p.metrics_address).get('baton_kv_tier_blocks{tier="disk"}', 0)

    wait_until(lambda: disk_blocks() >= 24, "the evicted blocks on disk")
    wait_until(lambda: indexed(cluster, p, "disk") >= 24, "the disk blocks in the index")
    again, f1 = generate(cluster.router, prompt)
    assert again == cold
    u = f1.usage
    assert u.cached_tokens == 96 and u.cached_tokens_disk > 0
    assert u.cached_tokens_host == 0
    assert f1.index_cached_tokens == 96  # the router knew: pool and disk runs from the index
    m = scrape(p.metrics_address)
    assert m['baton_kv_tier_hits_total{tier="disk"}'] * BS == u.cached_tokens_disk
    assert m['baton_worker_cached_tokens_total{tier="disk"}'] == u.cached_tokens_disk
    assert m['baton_kv_tier_enabled{tier="disk"}'] == 1
    assert m['baton_kv_tier_errors_total{tier="disk"}'] == 0
    cluster.assert_quiet()

    # a restart (same --worker-id, same directory): the new incarnation revalidates the file
    held = disk_blocks()
    p.stop()
    cluster.prefill[0] = p = cluster.start_worker("prefill")
    assert "revalidated" in p.log_tail(200)
    assert f"{held:.0f} blocks kept, 0 discarded" in p.log_tail(200)
    cluster.wait_router_sees(cluster.router, prefill=1, decode=1)
    wait_until(lambda: indexed(cluster, p, "disk") == held, "the revalidated blocks indexed")
    again2, f2 = generate(cluster.router, prompt)
    assert again2 == cold
    assert f2.usage.cached_tokens == 96 and f2.usage.cached_tokens_disk == 96
    assert f2.index_cached_tokens == 96
    cluster.assert_quiet()


def test_every_documented_tier_metric_is_served(cluster):
    import urllib.request

    names = [n for n in documented_metrics() if n.startswith("baton_kv_tier_")]
    assert len(names) >= 10
    body = urllib.request.urlopen(f"http://{cluster.prefill[0].metrics_address}/metrics",
                                  timeout=10).read().decode()
    families = {line.split()[2] for line in body.splitlines() if line.startswith("# TYPE ")}
    missing = [n for n in names if n not in families and n.removesuffix("_total") not in families]
    assert not missing, missing
