"""Every model family (mixtures of experts included) through a real cluster (redis-server,
prefill and decode workers and a router as processes on loopback, KV over NIXL): greedy tokens
equal transformers' on the remote path, the local path and with prefix-cache hits, one cluster
start per family, on prompts longer than the sliding windows; and, for Mistral, Mixtral and
Qwen3-MoE, on the migrated path too: a decode worker dies mid-stream and another finishes the
request from the tokens already sent."""

from __future__ import annotations

import pytest

from tests.support.api import generate_ids
from tests.support.families import PROMPT, SHAPES, hf_greedy

from ..conftest import make_hf_model

pytestmark = pytest.mark.slow

NEW = 10
LONG = PROMPT + [(5 * i + 1) % 380 + 10 for i in range(50)]  # 120 tokens: a prefill worker's
SHORT = PROMPT[5:45]  # 40 tokens, past every window: few enough for the decode worker itself
ARGS = ["--block-size", "4", "--num-blocks", "256"]


def generate(router, ids, max_tokens=NEW):
    out, final = generate_ids(router, ids, max_tokens, timeout=120)
    assert final is not None and final.finish_reason == "length", final
    return out, final


@pytest.fixture(scope="module", params=sorted(SHAPES))
def family(request, start_cluster, tmp_path_factory):
    kind = request.param
    path = tmp_path_factory.mktemp(kind)
    hf = make_hf_model(path, kind, **SHAPES[kind])
    c = start_cluster(prefill=1, decode=1, worker_args=["--model", str(path), *ARGS],
                      routers=[["--local-prefill-max-tokens", "48"]])
    yield kind, path, hf, c
    c.stop()


def test_remote_local_and_cached_paths_give_transformers_tokens(family):
    kind, _, hf, c = family
    shared = LONG[:80] + [(11 * i) % 380 + 10 for i in range(40)]
    want = {tuple(p): hf_greedy(hf, p, NEW) for p in (LONG, shared, SHORT)}
    out, final = generate(c.router, LONG)
    assert final.path == "remote" and out == want[tuple(LONG)], (kind, final.path)
    out, final = generate(c.router, LONG)  # its blocks are cached now
    assert final.usage.cached_tokens > 0 and out == want[tuple(LONG)], (kind, final)
    out, final = generate(c.router, shared)  # 80 tokens shared with it
    assert final.usage.cached_tokens >= 64 and out == want[tuple(shared)], (kind, final)
    out, final = generate(c.router, SHORT)
    assert final.path == "local" and out == want[tuple(SHORT)], (kind, final.path)
    c.assert_quiet()


@pytest.mark.parametrize("kind", ["mistral", "mixtral", "qwen3_moe"])
def test_the_migrated_path(start_cluster, tmp_path, kind):
    # decode worker 0's engine fails after 6 steps: the request streaming there moves to decode
    # worker 1, which recomputes the prompt and the tokens sent so far (past the window, for
    # Mistral and Mixtral; through the experts, for the mixtures) and finishes it
    hf = make_hf_model(tmp_path, kind, **SHAPES[kind])
    crash = ["--faults", "crash_engine_after=6"]
    c = start_cluster(prefill=1, decode=2, worker_args=["--model", str(tmp_path), *ARGS],
                      decode_args=lambda c, i: crash if i == 0 else [],
                      routers=[["--local-prefill-max-tokens", "0"]])
    migrated = 0
    for k in range(4):
        prompt = [(t + 31 * k) % 380 + 10 for t in LONG]
        out, final = generate(c.router, prompt, max_tokens=16)
        assert out == hf_greedy(hf, prompt, 16), (k, final.path)
        migrated += final.path == "migrated"
        if migrated:
            break
    assert migrated, "no request was streaming on the worker that failed"
    c.stop()
