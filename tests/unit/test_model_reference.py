"""Baton's model against Hugging Face transformers on tiny random models (all features)."""

import pytest
import torch
from baton.engine.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.engine.loader import load_model
from baton.engine.params import SamplingParams

from tests.support.families import REFERENCE_PROMPT, assert_matches_hf, hf_logprobs

from ..conftest import make_hf_model

PROMPT = REFERENCE_PROMPT


def assert_fused_path_matches(engine, flag: str, tol: float) -> None:
    """The engine's forward with its native fused kernels on (``engine.model.<flag>``) and off
    gives the same tokens and top-3 logprobs within ``tol`` on mixed batches: chunked prefills
    beside decode steps (with a 12-token budget), prefix-cache hits, a pure decode tail. Leaves
    the kernels on."""
    prompts = [PROMPT, PROMPT[:9] + [77, 78], list(range(30, 61)), [399]]
    got = {}
    for fused in (True, False):
        setattr(engine.model, flag, fused)
        params = SamplingParams(max_tokens=6, logprobs=3, ignore_eos=True,
                                cache_salt=f"fused={fused}")
        got[fused] = engine.generate(prompts, params)
        engine.check_integrity()
    for a, b in zip(got[True], got[False], strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert [t for t, _ in la.top] == [t for t, _ in lb.top]
            for (_, va), (_, vb) in zip(la.top, lb.top, strict=True):
                assert abs(va - vb) < tol, (va, vb)
    setattr(engine.model, flag, True)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_llama_untied(tiny_llama, backend):
    path, hf = tiny_llama
    engine = LLMEngine(load_model(path), EngineConfig(block_size=4, num_kv_blocks=64,
                                                      attention_backend=backend))
    assert engine.attention_backend == ("native-cpu" if backend == "native" else "torch")
    assert_matches_hf(engine, hf, PROMPT)


def test_qwen2_bias_tied(tmp_path):
    hf = make_hf_model(tmp_path / "q", "qwen2", tie_word_embeddings=True)
    model = load_model(tmp_path / "q")
    assert model.config.qkv_bias and model.config.tie_embeddings
    assert_matches_hf(LLMEngine(model, EngineConfig(block_size=4, num_kv_blocks=64)), hf, PROMPT)


def test_llama3_rope_scaling(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    hf = make_hf_model(tmp_path / "l3", rope_scaling=scaling, rope_theta=500000.0)
    model = load_model(tmp_path / "l3")
    assert model.config.rope_scaling.kind == "llama3"
    prompt = list(range(20, 120))  # past original_max_position: the scaling matters
    assert_matches_hf(LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=64)), hf, prompt)


def test_bfloat16_stays_close(tiny_llama):
    path, hf = tiny_llama
    engine = LLMEngine(load_model(path), EngineConfig(dtype="bfloat16", block_size=4,
                                                      num_kv_blocks=64))
    assert engine.kv_cache.dtype == torch.bfloat16
    c = engine.generate([PROMPT], SamplingParams(max_tokens=4, logprobs=3, ignore_eos=True))[0]
    ref = hf_logprobs(hf, PROMPT + c.token_ids)
    for i, lp in enumerate(c.logprobs):
        assert abs(float(ref[len(PROMPT) - 1 + i][lp.token_id]) - lp.logprob) < 0.1


def test_float32_gemms_run_on_prepacked_weights(tmp_path):
    # a float32 engine multiplies batches above SMALL_M_PACKED rows on weights prepacked for
    # oneDNN (faster than CPU BLAS on the same matrix), in float32: the same products as
    # F.linear to float32 rounding, bias included (Qwen2's qkv), and the same tokens as HF
    from baton.engine.model import SMALL_M_PACKED, make_linear

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this PyTorch has no oneDNN")
    hf = make_hf_model(tmp_path / "q", "qwen2", tie_word_embeddings=True)
    engine = LLMEngine(load_model(tmp_path / "q"), EngineConfig(block_size=4, num_kv_blocks=64))
    for lin in (engine.model.layers[0].qkv, engine.model.layers[0].down, engine.model.lm_head):
        assert lin.packed is not None and lin.packed.dtype == torch.float32
        x = torch.randn(SMALL_M_PACKED + 5, lin.w.shape[1], dtype=torch.float64).float()
        ref = x.double() @ lin.w.double().t() + (0 if lin.bias is None else lin.bias.double())
        for y in (lin(x), torch.cat([lin(x[i : i + 1]) for i in range(len(x))])):
            torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    assert engine.model.layers[0].qkv.bias is not None
    assert_matches_hf(engine, hf, PROMPT)
    # a weight that cannot be packed (this build, or a CUDA one) keeps the plain GEMM
    w = torch.randn(16, 32)
    assert make_linear(w, None, None, torch.float32, pack=False).packed is None
    assert torch.equal(make_linear(w, None, None, torch.float32, pack=False).w, w)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_attention_in_the_native_kernel(tmp_path, dtype):
    # head_dim 64 (3 query heads on one KV head): prefills attend in the native flash kernel,
    # which gives what PyTorch's attention gives on mixed batches (chunked prefills over cached
    # keys, prefix-cache hits) and, in float32, HF's logprobs. In bf16 this random model (weights
    # drawn 10x wider than a trained one's) moves logprobs by up to 0.1 for PyTorch's own bf16
    # attention against exact attention on the same inputs, and by 0.13 for the kernel's (whose
    # outputs are as close to exact as PyTorch's: test_native_kernels), hence 0.25 there
    from baton.kernels import cpu_attention

    hf = make_hf_model(tmp_path / "m", hidden_size=192, num_attention_heads=3,
                       num_key_value_heads=1, tie_word_embeddings=False)
    engine = LLMEngine(load_model(tmp_path / "m"), EngineConfig(
        dtype=dtype, block_size=4, num_kv_blocks=64, max_num_batched_tokens=12))
    if not cpu_attention.prefill_supported(engine.model.gemm_dtype, 64):
        pytest.skip(f"this CPU cannot run the native prefill kernel for {engine.model.gemm_dtype}")
    assert engine.model.prefill_native
    assert_fused_path_matches(engine, "prefill_native",
                              tol=1e-5 if engine.model.gemm_dtype == torch.float32 else 0.25)
    if dtype == "float32":
        assert_matches_hf(engine, hf, PROMPT)
    torch_engine = LLMEngine(load_model(tmp_path / "m"), EngineConfig(
        dtype=dtype, block_size=4, num_kv_blocks=64, attention_backend="torch"))
    assert not torch_engine.model.prefill_native


@pytest.mark.parametrize("native_bf16", [False, True])
def test_bfloat16_gemms_where_the_cpu_has_them(tiny_llama, monkeypatch, native_bf16):
    # bf16 weights: activations stay float32; large products run in bf16 only where the CPU has
    # bf16 arithmetic (forced both ways here: torch's bf16 GEMM runs on any CPU, slowly). With
    # bf16 GEMMs, a weight prepacked for oneDNN serves every batch size; one that cannot be
    # packed shares its bf16 copy with the native small-batch kernel
    from baton.engine import config as config_mod
    from baton.engine.model import SMALL_M_HALF

    monkeypatch.setattr(config_mod, "cpu_has_native_half", lambda: native_bf16)
    path, hf = tiny_llama
    cfg = EngineConfig(dtype="bfloat16", block_size=4, num_kv_blocks=64)
    assert cfg.compute_dtype == torch.float32
    assert cfg.gemm_dtype == (torch.bfloat16 if native_bf16 else torch.float32)
    engine = LLMEngine(load_model(path), cfg)
    lin = engine.model.layers[0].qkv
    assert lin.w.dtype == cfg.gemm_dtype
    x = torch.randn(SMALL_M_HALF + 3, lin.w.shape[-1])
    big = lin(x)  # BLAS
    one_by_one = torch.cat([lin(x[i : i + 1]) for i in range(len(x))])  # native kernel, if any
    assert big.dtype == one_by_one.dtype == torch.float32
    tol = 0.05 if native_bf16 else 1e-4  # x rounded to bf16 for the GEMM
    torch.testing.assert_close(big, one_by_one, atol=tol, rtol=tol)
    from baton.engine.model import _packing_works

    if native_bf16 and _packing_works(torch.bfloat16):
        assert lin.packed is not None and lin.small is None  # prepacked: every batch size
        plain = torch.nn.functional.linear(x.bfloat16(), lin.w).float()
        torch.testing.assert_close(big - (0 if lin.bias is None else lin.bias), plain,
                                   atol=1e-2, rtol=1e-2)
    elif lin.small is not None:
        assert lin.small.dtype == torch.bfloat16
        assert (lin.w is lin.small) == native_bf16  # one copy when both are bf16 [N, K]
    c = engine.generate([PROMPT], SamplingParams(max_tokens=4, logprobs=3, ignore_eos=True))[0]
    ref = hf_logprobs(hf, PROMPT + c.token_ids)
    for i, lp in enumerate(c.logprobs):
        assert abs(float(ref[len(PROMPT) - 1 + i][lp.token_id]) - lp.logprob) < 0.1


def test_the_fused_float32_path_computes_what_the_torch_ops_do(tiny_llama):
    # RMSNorm, RoPE and SiLU-and-multiply in native kernels against the torch ops, on mixed
    # batches (chunked prefills beside decode steps, prefix-cache hits, a pure decode tail)
    from baton.kernels import cpu_fused

    if cpu_fused.load_f32() is None:
        pytest.skip("no C compiler: the fused path is off")
    path, hf = tiny_llama
    engine = LLMEngine(load_model(path), EngineConfig(block_size=4, num_kv_blocks=64,
                                                      max_num_batched_tokens=12))
    assert engine.model.fused_f32
    assert_fused_path_matches(engine, "fused_f32", tol=1e-5)
    assert_matches_hf(engine, hf, PROMPT)


def test_the_fused_bf16_path_computes_what_the_unfused_one_does(tiny_llama, monkeypatch):
    # bf16 GEMMs with native kernels in between (rounding each GEMM input once, as the float32
    # path with bf16 GEMMs does) against that float32 path, on mixed batches: chunked prefills
    # beside decode steps (a 12-token budget), prefix-cache hits, and a pure decode tail
    from baton.engine import config as config_mod
    from baton.engine.model import _packing_works
    from baton.kernels import cpu_fused

    if cpu_fused.load() is None or not _packing_works(torch.bfloat16):
        pytest.skip("no C compiler, or no oneDNN bf16 prepacking on this CPU (AVX2 only): "
                    "the fused path is off")
    monkeypatch.setattr(config_mod, "cpu_has_native_half", lambda: True)
    path, _ = tiny_llama
    engine = LLMEngine(load_model(path), EngineConfig(dtype="bfloat16", block_size=4,
                                                      num_kv_blocks=64,
                                                      max_num_batched_tokens=12))
    assert engine.model.fused_bf16
    assert_fused_path_matches(engine, "fused_bf16", tol=2e-3)
