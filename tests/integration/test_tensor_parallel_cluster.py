"""Tensor-parallel workers in a real cluster (redis-server, prefill and decode workers whose
follower ranks are processes too, a router; KV over NIXL): a prefill group of TP size p hands
off to a decode group of size d for (1, 2), (2, 1) and (2, 2), remote path and prefix hits,
tokens equal to transformers'; a request migrated off a TP group; a follower rank killed
mid-stream ends its group and every request completes elsewhere; a pair of pools whose layouts
cannot map is refused with FAILED_PRECONDITION naming both, before any byte moves."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
from baton.bench.tiny_model import TP_SHAPES

from tests.support.api import generate_ids
from tests.support.families import hf_greedy
from tests.support.processes import descendants

from ..conftest import make_hf_model

pytestmark = pytest.mark.slow

ARGS = ["--block-size", "4", "--num-blocks", "256"]
LONG = [(7 * i + 3) % 380 + 10 for i in range(90)]
SHARED = LONG[:72] + [(11 * i) % 380 + 10 for i in range(30)]
REMOTE = [["--local-prefill-max-tokens", "0"]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2-tp")
    hf = make_hf_model(path, "qwen2", **TP_SHAPES["qwen2"])
    return str(path), hf


def tp(n: int) -> list[str]:
    return ["--tensor-parallel-size", str(n)]


@pytest.mark.parametrize("p, d", [(1, 2), (2, 1), (2, 2)])
def test_a_prefill_group_hands_off_to_a_decode_group_of_another_size(p, d, model,
                                                                     start_cluster):
    path, hf = model
    c = start_cluster(prefill=1, decode=1, worker_args=["--model", path, *ARGS],
                      role_args={"prefill": tp(p), "decode": tp(d)}, routers=REMOTE)
    out, final = generate_ids(c.router, LONG, 10, timeout=120)
    assert final.path == "remote" and out == hf_greedy(hf, LONG, 10), final
    out, final = generate_ids(c.router, SHARED, 10, timeout=120)  # 72 tokens cached
    assert final.usage.cached_tokens >= 64 and out == hf_greedy(hf, SHARED, 10), final
    c.assert_quiet()
    c.stop()


def test_a_request_migrates_off_a_tensor_parallel_group(model, start_cluster):
    path, hf = model
    crash = ["--faults", "crash_engine_after=6"]
    c = start_cluster(prefill=1, decode=2, worker_args=["--model", path, *ARGS],
                      role_args={"prefill": tp(2)},
                      decode_args=lambda c, i: [*tp(2), *crash] if i == 0 else [],
                      routers=REMOTE)
    migrated = 0
    for k in range(4):
        prompt = [(t + 31 * k) % 380 + 10 for t in LONG]
        out, final = generate_ids(c.router, prompt, 16, timeout=120)
        assert out == hf_greedy(hf, prompt, 16), (k, final.path)
        migrated += final.path == "migrated"
        if migrated:
            break
    assert migrated, "no request was streaming on the group that failed"
    assert c.decode[0].proc.wait(timeout=30) == 1  # the failed group exits to be replaced
    c.assert_quiet()
    c.stop()


def _follower(worker) -> int:
    pids = [p for p in descendants(worker.pid)
            if b"baton.engine.tp" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert pids, "no follower rank under the worker"
    return pids[0]


def test_a_killed_rank_ends_its_group_and_every_request_completes_elsewhere(model,
                                                                          start_cluster):
    path, hf = model
    slow = ["--faults", "step_delay=0.05"]  # the group's requests are still streaming
    c = start_cluster(prefill=1, decode=2, worker_args=["--model", path, *ARGS],
                      decode_args=lambda c, i: [*tp(2), *slow] if i == 0 else [],
                      routers=REMOTE)
    group = c.decode[0]
    follower = _follower(group)
    prompts = [[(t + 17 * k) % 380 + 10 for t in LONG] for k in range(4)]
    results: dict[int, object] = {}
    deadline = 60.0

    def run(k: int) -> None:
        t0 = time.monotonic()
        try:
            results[k] = (generate_ids(c.router, prompts[k], 40, timeout=deadline),
                          time.monotonic() - t0)
        except grpc.RpcError as e:  # a typed error is allowed, within the deadline + 3 s
            results[k] = (e, time.monotonic() - t0)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    _wait_until_streaming(group)
    os.kill(follower, signal.SIGKILL)
    for t in threads:
        t.join(deadline + 10)
    assert group.proc.wait(timeout=30) != 0  # the group went down with its rank
    for k, (res, took) in results.items():
        assert took <= deadline + 3, (k, took)
        if isinstance(res, grpc.RpcError):
            assert res.code() != grpc.StatusCode.UNKNOWN, (k, res)
            continue
        out, final = res
        assert out == hf_greedy(hf, prompts[k], 40), (k, final.path)
    assert any(not isinstance(r, grpc.RpcError) and r[1].path == "migrated"
               for r, _ in results.values()), "no request was on the group when it failed"
    c.assert_quiet()
    c.stop()


def _wait_until_streaming(worker, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while worker.info().running_requests == 0:
        assert time.monotonic() < end, "nothing ever ran on the group"
        time.sleep(0.02)


def test_pools_whose_layouts_cannot_map_are_refused_fast(model, start_cluster):
    path, _ = model
    c = start_cluster(prefill=1, decode=1, worker_args=["--model", path, *ARGS],
                      role_args={"prefill": ["--kv-layout", "block"], "decode": tp(2)},
                      routers=REMOTE)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        generate_ids(c.router, LONG, 10, timeout=60)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value
    assert "block-major" in e.value.details() and "head-major" in e.value.details()
    assert time.monotonic() - t0 < 10
    c.assert_quiet()
    c.stop()
