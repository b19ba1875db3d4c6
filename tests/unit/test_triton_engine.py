"""The engine's Triton forward pass against its CPU forward pass, token for token.

Without CUDA, the Triton backend runs under the interpreter on CPU tensors (``TRITON_INTERPRET=1``,
set before Triton is imported): the same kernels, indices and masks as on a GPU, in float32. The
``gpu`` test runs the engine on CUDA with CUDA graphs for decode.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from baton.engine.params import SamplingParams  # noqa: E402

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Baton splits prefill from decode and ships the KV cache between workers. " * 3,
    "def add(a, b):",
    "The quick brown fox jumps over the lazy dog. And then",  # a cached prefix of the first
]


def run_all(engine, max_tokens=12):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in PROMPTS]
    out = {r.request_id: [] for r in reqs}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    engine.check_integrity()
    return [out[r.request_id] for r in reqs]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu test covers CUDA")
def test_interpreted_triton_forward_matches_cpu_engine(tiny_engine):
    # small token budget: chunked prefill, mixed prefill/decode batches, prefix-cache hits
    common = dict(max_num_batched_tokens=24, block_size=4)
    want = run_all(tiny_engine(attention_backend="torch", **common))
    tri = tiny_engine(attention_backend="triton", **common)
    assert tri.attention_backend == "triton"
    assert run_all(tri) == want


def test_triton_backend_on_cpu_needs_the_interpreter(tiny_engine, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        tiny_engine(attention_backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("budget", [24, 4])
def test_cuda_engine_matches_cpu_engine(tiny_engine, graphs, budget):
    """budget 4: while three sequences decode, the fourth prompt advances one token per step,
    so graph-replayed steps hold rows whose logits nobody samples."""
    torch.backends.cuda.matmul.allow_tf32 = False
    common = dict(max_num_batched_tokens=budget, block_size=4)
    want = run_all(tiny_engine(**common))
    gpu = tiny_engine(device="cuda", cuda_graphs=graphs, max_num_seqs=8, **common)
    assert (gpu.runner.graphs is not None) == graphs
    assert run_all(gpu) == want


def test_graph_batch_sizes_cover_every_batch_up_to_the_limit():
    from baton.engine.cuda_graphs import graph_batch_sizes

    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = graph_batch_sizes(64)
    assert sizes[-1] == 64 and all(any(s >= n for s in sizes) for n in range(1, 65))


@pytest.mark.slow  # ~11 s under the interpreter: the fast lane keeps the kernels' own tests
@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu test covers CUDA")
@pytest.mark.parametrize("kind", ["qwen3", "mistral", "gemma3_text", "mixtral", "qwen3_moe"])
def test_interpreted_triton_forward_serves_every_family(tmp_path, kind):
    # q/k norms (Qwen3), sliding windows shorter than the prompt (Mistral), and Gemma 3's
    # sandwich norms, GeLU, second RoPE base, attention scale and soft-capped logits, and the
    # mixtures of experts' grouped GEMMs (Mixtral, Qwen3-MoE) in the Triton forward: HF's
    # greedy tokens, with chunked prefills over cached keys
    from baton.engine.config import EngineConfig
    from baton.engine.engine import LLMEngine
    from baton.engine.loader import load_model

    from tests.support.families import PROMPT, SHAPES, hf_greedy

    from ..conftest import make_hf_model

    hf = make_hf_model(tmp_path, kind, **SHAPES[kind])
    engine = LLMEngine(load_model(tmp_path), EngineConfig(
        block_size=4, num_kv_blocks=200, attention_backend="triton", max_num_batched_tokens=16))
    assert engine.attention_backend == "triton"
    got = engine.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert got.token_ids == hf_greedy(hf, PROMPT, 8)
    engine.check_integrity()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "gemma3_text",
                                  "mixtral", "qwen3_moe"])
def test_every_family_on_cuda_gives_transformers_tokens(tmp_path, kind):
    # loaded straight onto the device (the loader's placement), float32, windows shorter than
    # the prompt: HF's greedy tokens
    from baton.engine.config import EngineConfig
    from baton.engine.engine import LLMEngine

    from tests.support.families import PROMPT, SHAPES, hf_greedy

    from ..conftest import make_hf_model

    hf = make_hf_model(tmp_path, kind, **SHAPES[kind])
    engine = LLMEngine.from_path(str(tmp_path), EngineConfig(
        device="cuda", block_size=16, num_kv_blocks=64, max_num_batched_tokens=32))
    assert engine.model_info.placement.device == "cuda"
    assert engine.model.embed.device.type == "cuda"
    got = engine.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert got.token_ids == hf_greedy(hf, PROMPT, 8)
