"""FP8 on a GPU (``gpu``: skipped without CUDA; CI has none): an FP8 checkpoint's FP8 matmuls and
an FP8 KV cache, each within a stated tolerance of the bf16 engine's logits, and the hand-off
between a bf16 and an FP8 KV pool refused naming both.

The tolerance is the largest difference between the two engines' first-step top-5 logprobs over
a few prompts of tiny random models (weights at initializer_range 0.05). On CPU, under Triton's
interpreter in float32, the same FP8 arithmetic gives 0.033-0.042 against the unquantized model
(qwen3, llama, qwen3_moe; tests/unit/test_fp8.py and test_triton_fp8_kv.py check it exactly);
bf16 on both sides adds its own rounding.
"""

from __future__ import annotations

import time

import pytest
import torch
from baton.engine.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.engine.loader import load_model
from baton.engine.params import SamplingParams

from tests.support.families import PROMPT, SHAPES
from tests.support.fp8 import make_fp8

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

FP8_MATMUL_TOL = 0.1  # logprob, FP8 weights and activations against bf16
FP8_KV_TOL = 0.1  # logprob, FP8 keys and values against bf16 ones
ENGINE = dict(device="cuda", dtype="bfloat16", block_size=16, num_kv_blocks=64,
              max_num_batched_tokens=32)
PROMPTS = [PROMPT[:n] for n in (9, 23, 40, 70)]


def first_logprobs(engine, prompt) -> dict[int, float]:
    c = engine.generate([prompt], SamplingParams(max_tokens=1, logprobs=20))[0]
    return dict(c.logprobs[0].top)


def gap(engine, reference) -> float:
    """Over PROMPTS: the largest difference of ``engine``'s logprob of each of ``reference``'s
    top-5 first tokens (absent from engine's top 20: infinite)."""
    worst = 0.0
    for p in PROMPTS:
        got, want = first_logprobs(engine, p), first_logprobs(reference, p)
        for tok, lp in sorted(want.items(), key=lambda kv: -kv[1])[:5]:
            worst = max(worst, abs(got.get(tok, float("-inf")) - lp))
    return worst


@pytest.mark.parametrize("kind, strategy, block, shape", [
    ("qwen3", "block", (128, 128), {}),       # K 72: the Triton kernel, one group per row
    ("llama", "channel", None, dict(hidden_size=128, num_attention_heads=4,
                                    num_key_value_heads=2)),  # multiples of 16: _scaled_mm
    ("qwen3_moe", "block", (128, 128), {}),   # FP8 experts in the grouped GEMM
    ("qwen3", "block", (32, 32), {}),          # column groups
])
def test_fp8_matmuls_are_within_tolerance_of_bf16(tmp_path, kind, strategy, block, shape):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 matmuls need sm_89 or newer")
    path, _ = make_fp8(tmp_path, kind, strategy, block or (128, 128), **shape,
                       initializer_range=0.05)
    fp8 = LLMEngine.from_path(str(path), EngineConfig(**ENGINE))
    assert fp8.fp8_group == (block[1] if block else 0)
    assert fp8.model.layers[0].qkv.w.dtype == torch.float8_e4m3fn
    bf16 = LLMEngine.from_path(str(tmp_path / "deq"), EngineConfig(**ENGINE))
    assert 0 < gap(fp8, bf16) < FP8_MATMUL_TOL


@pytest.mark.parametrize("kind", ["qwen3", "mistral"])
def test_an_fp8_kv_cache_is_within_tolerance_of_bf16(tmp_path, kind):
    from ..conftest import make_hf_model

    make_hf_model(tmp_path, kind, **SHAPES[kind], initializer_range=0.05)
    model = load_model(tmp_path)
    fp8 = LLMEngine(model, EngineConfig(kv_cache_dtype="fp8", **ENGINE))
    bf16 = LLMEngine(model, EngineConfig(**ENGINE))
    assert fp8.kv_cache.dtype == torch.float8_e4m3fn and fp8.fingerprint != bf16.fingerprint
    assert 0 < gap(fp8, bf16) < FP8_KV_TOL
    fp8.check_integrity()


def test_a_bf16_and_an_fp8_pool_refuse_each_others_blocks(tmp_path):
    # the two engines' own KV pools behind real NIXL agents (staged through host memory, which
    # needs no VRAM registration) and a real KVSource: the handshake fails naming both dtypes
    from baton.services.common.process import make_server
    from baton.transfer.agent import KVAgent, configure_ucx
    from baton.transfer.errors import FingerprintMismatchError
    from baton.transfer.holder import KVHolder
    from baton.transfer.lease import LeaseTable
    from baton.transfer.reader import KVReader
    from baton.v1 import worker_pb2_grpc

    from ..conftest import make_hf_model

    make_hf_model(tmp_path)
    model = load_model(tmp_path)
    held = LLMEngine(model, EngineConfig(**ENGINE))
    reading = LLMEngine(model, EngineConfig(kv_cache_dtype="fp8", **ENGINE))
    configure_ucx()
    agents = [KVAgent(f"gpu-{n}", e.kv_storage, staging="always", layout=e.kv_layout)
              for n, e in (("holder", held), ("reader", reading))]
    server = make_server(max_workers=4)
    port = server.add_insecure_port("127.0.0.1:0")
    holder = KVHolder(worker_id="h", incarnation="i", address=f"127.0.0.1:{port}",
                      fingerprint=held.fingerprint, agent=agents[0],
                      leases=LeaseTable(ttl_s=60), free=lambda r: None)
    worker_pb2_grpc.add_KVSourceServicer_to_server(holder, server)
    server.start()
    reader = KVReader(agents[1], reading.fingerprint, "r")
    try:
        with pytest.raises(FingerprintMismatchError, match="bfloat16.*float8_e4m3fn"):
            reader.connect(holder.address, time.monotonic() + 30)
    finally:
        reader.close()
        server.stop(None)
        for a in agents:
            a.close()
