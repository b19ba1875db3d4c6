"""An engine at tensor-parallel size 2 and 4 (follower rank processes over gloo, one torch thread
each) gives the greedy tokens of size 1 in float32, on tiny random checkpoints of a GQA dense
family with a sliding window, one whose single KV head is replicated, and two mixtures of
experts; a follower that dies takes the group down at the next step or idle check; a model that
does not split is refused before any rank starts."""

from __future__ import annotations

import os
import signal

import pytest
from baton.bench.tiny_model import TP_SHAPES
from baton.engine.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.engine.errors import UnsupportedModelError
from baton.engine.params import SamplingParams
from baton.engine.tp import TPGroupError

from ..conftest import make_hf_model

pytestmark = pytest.mark.slow

PROMPT = [(7 * i + 3) % 380 + 10 for i in range(37)]


def greedy(path, size: int, n: int = 12) -> list[int]:
    engine = LLMEngine.from_path(str(path), EngineConfig(tensor_parallel_size=size,
                                                         block_size=4, num_kv_blocks=64))
    try:
        req = engine.add_request(prompt_token_ids=PROMPT,
                                 params=SamplingParams(max_tokens=n, temperature=0,
                                                       ignore_eos=True))
        out: list[int] = []
        while engine.has_unfinished():
            for o in engine.step():
                if o.request_id == req.request_id:
                    out += o.new_token_ids
        engine.check_integrity()
        assert engine.stats().free_blocks == engine.num_blocks
        return out
    finally:
        engine.close()


@pytest.mark.parametrize("kind", sorted(TP_SHAPES))
def test_greedy_tokens_at_tp2_equal_tp1(kind, tmp_path):
    make_hf_model(tmp_path, kind, **TP_SHAPES[kind])
    one = greedy(tmp_path, 1)
    assert greedy(tmp_path, 2) == one
    if kind == "qwen2":  # 4 KV heads over 4 ranks, 2 query heads each
        assert greedy(tmp_path, 4) == one


def test_a_dead_follower_takes_the_group_down(tmp_path):
    make_hf_model(tmp_path, "qwen3", **TP_SHAPES["qwen3"])
    engine = LLMEngine.from_path(str(tmp_path), EngineConfig(tensor_parallel_size=2,
                                                             block_size=4, num_kv_blocks=64))
    try:
        assert engine.ranks.startswith("2 ranks on cpu (pids ")
        engine.add_request(prompt_token_ids=PROMPT, params=SamplingParams(max_tokens=50))
        engine.step()
        follower = engine.tp_group.procs[0]
        os.kill(follower.pid, signal.SIGKILL)
        follower.wait(timeout=10)
        with pytest.raises(TPGroupError, match="rank 1 .* exited"):
            engine.tp_group.check()  # what the worker's engine loop runs while idle
        with pytest.raises(TPGroupError):
            engine.step()
    finally:
        engine.close()


def test_a_model_that_does_not_split_is_refused_before_any_rank_starts(tmp_path):
    make_hf_model(tmp_path, "llama", hidden_size=80, num_attention_heads=5,
                  num_key_value_heads=1)
    with pytest.raises(UnsupportedModelError, match="num_attention_heads=5"):
        LLMEngine.from_path(str(tmp_path), EngineConfig(tensor_parallel_size=2))
