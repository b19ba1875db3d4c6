"""GGUF loading: dequantization per type, llama.cpp's Q/K permutation, tokenizer, refusals."""

import json

import gguf
import numpy as np
import pytest
import torch
from baton.engine.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.engine.errors import ModelLoadError, UnsupportedModelError
from baton.engine.loader import load_model
from baton.engine.params import SamplingParams
from gguf import GGMLQuantizationType as Q
from gguf import quants

from tests.support.families import REFERENCE_PROMPT as PROMPT
from tests.support.families import assert_matches_hf


def permute(w, n_head):  # what llama.cpp's convert_hf_to_gguf does to q/k rows
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def write_gguf(path, hf_dir, hf, qtype=Q.F32, arch="llama", raw_override=None, fields=None):
    cfg = hf.config
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["content"] for t in tok["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w = gguf.GGUFWriter(str(path), arch)
    if f"{arch}.block_count" not in (fields or {}):
        w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float((getattr(cfg, "rope_parameters", None) or {}).get(
        "rope_theta", 10000.0)))
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in specials else 1 for t, _ in vocab])
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    for key, value in (fields or {}).items():  # extra metadata: (key, int or str)
        (w.add_uint32 if isinstance(value, int) else w.add_string)(key, value)
    sd = {k: v.float().numpy() for k, v in hf.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
             "output_norm.weight", "lm_head.weight": "output.weight"}
    parts = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj":
             "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "input_layernorm":
             "attn_norm", "post_attention_layernorm": "ffn_norm"}
    expected = {}
    experts = getattr(cfg, "num_local_experts", 0)
    if experts:  # Mixtral, as llama.cpp writes it: architecture llama, experts as 3-D tensors
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        sd = mixtral_as_gguf(sd, cfg.intermediate_size)
    for k, arr in sd.items():
        if k.startswith("blk."):
            w.add_tensor(k, arr.astype(np.float32))
            continue
        if k in names:
            name = names[k]
        else:
            i, rest = k.split(".")[2], ".".join(k.split(".")[3:-1])
            name = f"blk.{i}.{parts[rest]}.weight"
            if rest == "self_attn.q_proj":
                arr = permute(arr, cfg.num_attention_heads)
            elif rest == "self_attn.k_proj":
                arr = permute(arr, cfg.num_key_value_heads)
        if arr.ndim == 2 and qtype != Q.F32:
            data = quants.quantize(arr, qtype)
            w.add_tensor(name, data, raw_dtype=qtype)
            expected[name] = quants.dequantize(data, qtype)
        else:
            w.add_tensor(name, arr.astype(np.float32))
            expected[name] = arr
    for name, (data, dtype) in (raw_override or {}).items():
        w.add_tensor(name, data, raw_dtype=dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def mixtral_as_gguf(sd: dict, inter: int) -> dict:
    """transformers' in-memory Mixtral tensors renamed to llama.cpp's: the router as
    ``ffn_gate_inp``, the fused experts split into ``ffn_{gate,up,down}_exps`` [E, I, H] /
    [E, H, I]."""
    out = {}
    for k, arr in sd.items():
        if ".mlp." not in k:
            out[k] = arr
            continue
        i = k.split(".")[2]
        if k.endswith("mlp.gate.weight"):
            out[f"blk.{i}.ffn_gate_inp.weight"] = arr
        elif k.endswith("gate_up_proj"):
            out[f"blk.{i}.ffn_gate_exps.weight"] = np.ascontiguousarray(arr[:, :inter])
            out[f"blk.{i}.ffn_up_exps.weight"] = np.ascontiguousarray(arr[:, inter:])
        else:
            out[f"blk.{i}.ffn_down_exps.weight"] = arr
    return out


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "cache"))


def test_f32_gguf_matches_hf_and_tokenizer(tiny_llama, tmp_path, cache):
    hf_dir, hf = tiny_llama
    write_gguf(tmp_path / "m.gguf", hf_dir, hf)
    model = load_model(tmp_path / "m.gguf")
    assert model.config.num_kv_heads == 2 and not model.config.tie_embeddings
    assert_matches_hf(LLMEngine(model, EngineConfig(block_size=4, num_kv_blocks=64)), hf, PROMPT)
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    for text in ["The quick brown fox", "def add(a, b):\n", "<|im_start|>user\nhi<|im_end|>"]:
        assert model.tokenizer.encode(text) == ref.encode(text).ids
        assert model.tokenizer.decode(model.tokenizer.encode(text), False) == text


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_quantized_types_dequantize_exactly(tiny_llama, tmp_path, cache, qtype):
    hf_dir, hf = tiny_llama
    exp = write_gguf(tmp_path / "m.gguf", hf_dir, hf, qtype)
    w = load_model(tmp_path / "m.gguf").weights
    assert torch.equal(w["embed"], torch.from_numpy(exp["token_embd.weight"]))
    assert torch.equal(w["layers.1.down"], torch.from_numpy(exp["blk.1.ffn_down.weight"]))
    # q rows come back un-permuted, i.e. in Hugging Face order
    q_hf = hf.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    err = (w["layers.0.qkv"][: q_hf.shape[0]] - q_hf).abs().max()
    assert err < {Q.F16: 1e-3, Q.Q8_0: 0.05, Q.Q4_0: 0.5, Q.Q4_1: 0.5}[qtype]


def test_second_load_comes_from_the_cache(tiny_llama, tmp_path, cache, capsys):
    hf_dir, hf = tiny_llama
    write_gguf(tmp_path / "m.gguf", hf_dir, hf, Q.Q8_0)
    a = load_model(tmp_path / "m.gguf")
    b = load_model(tmp_path / "m.gguf")
    assert "from cache" in capsys.readouterr().err
    assert a.weights_id == b.weights_id and a.config == b.config
    assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
    assert a.fingerprint("float32", 16) != a.fingerprint("bfloat16", 16)
    assert a.fingerprint("float32", 16) != a.fingerprint("float32", 32)


def test_unsupported_architecture(tiny_llama, tmp_path, cache):
    hf_dir, hf = tiny_llama
    write_gguf(tmp_path / "m.gguf", hf_dir, hf, arch="mamba")
    with pytest.raises(UnsupportedModelError, match="architecture 'mamba'"):
        load_model(tmp_path / "m.gguf")


@pytest.mark.parametrize("arch, field, value", [
    ("mistral", "mistral.attention.sliding_window", 8),  # a window a GGUF mistral would not get
    ("llama", "llama.rope.scaling.type", "yarn"),
    ("qwen2", "qwen2.expert_count", 8),  # experts of an architecture Baton reads dense only
    ("gemma3", "gemma3.block_count", 62),  # Gemma 3 27B: its attention scale is not in GGUF
])
def test_gguf_metadata_baton_would_not_compute_exactly_is_refused_by_name(
        tiny_llama, tmp_path, cache, arch, field, value):
    hf_dir, hf = tiny_llama
    write_gguf(tmp_path / "m.gguf", hf_dir, hf, arch=arch, fields={field: value})
    with pytest.raises(UnsupportedModelError, match=field.replace(".", r"\.")):
        load_model(tmp_path / "m.gguf")


def test_unsupported_quantization(tiny_llama, tmp_path, cache):
    hf_dir, hf = tiny_llama
    raw = np.zeros((4, 66), dtype=np.uint8)  # 4 rows of one IQ2_XXS super-block (256 values)
    write_gguf(tmp_path / "m.gguf", hf_dir, hf, raw_override={"extra.weight": (raw, Q.IQ2_XXS)})
    with pytest.raises(UnsupportedModelError, match="extra.weight uses GGUF type IQ2_XXS"):
        load_model(tmp_path / "m.gguf")


def test_bad_paths(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope.gguf")
    (tmp_path / "d").mkdir()
    with pytest.raises(ModelLoadError, match="without config.json"):
        load_model(tmp_path / "d")
    (tmp_path / "x.bin").write_bytes(b"junk")
    with pytest.raises(ModelLoadError, match="neither"):
        load_model(tmp_path / "x.bin")
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        load_model(tmp_path / "bad.gguf")


def assert_same_generations(a_engine, b_engine, tol: float, same_top: bool) -> None:
    """Both engines generate the same tokens for three prompts, each step's top-3 logprobs
    within ``tol`` (and, with ``same_top``, the same top-3 tokens in the same order)."""
    prompts = [PROMPT, PROMPT[:5], list(range(40, 75))]
    params = SamplingParams(max_tokens=8, logprobs=3, ignore_eos=True)
    for a, b in zip(a_engine.generate(prompts, params), b_engine.generate(prompts, params),
                    strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            if same_top:
                assert [t for t, _ in la.top] == [t for t, _ in lb.top]
            assert max(abs(x - y) for (_, x), (_, y) in zip(la.top, lb.top)) < tol


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_a_float32_engine_reads_the_gguf_blocks_in_small_batches(tiny_llama, tmp_path, cache,
                                                                  qtype, monkeypatch):
    # every fused linear weight keeps its source blocks (q/k rows un-permuted like the float32
    # rows), which dequantize to exactly the float32 weights; a float32 engine's small batches
    # read them, with the same tokens and logprobs as from the float32 copy (on a CPU without
    # AVX-512 the engine reads the float32 copy, faster there: forced here, so the block path
    # is checked on every CPU)
    from dataclasses import replace

    from baton.kernels import cpu_linear

    if cpu_linear.quant_load() is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(cpu_linear, "quant_in_registers", lambda: True)
    hf_dir, hf = tiny_llama
    write_gguf(tmp_path / "m.gguf", hf_dir, hf, qtype)
    model = load_model(tmp_path / "m.gguf")
    layer_mats = {f"layers.{i}.{n}" for i in range(hf.config.num_hidden_layers)
                  for n in ("qkv", "o", "gate_up", "down")}
    assert set(model.quantized) == layer_mats | {"embed", "lm_head"}
    for name, (q, blocks) in model.quantized.items():
        assert q == qtype.name
        w = cpu_linear.QuantWeight(q, blocks, model.weights[name].shape[1])
        assert torch.equal(cpu_linear.dequantize(w), model.weights[name]), name
    again = load_model(tmp_path / "m.gguf")  # from the cache
    assert again.quantized.keys() == model.quantized.keys()
    assert all(torch.equal(again.quantized[k][1], b) for k, (_, b) in model.quantized.items())

    cfg = EngineConfig(block_size=4, num_kv_blocks=64)
    engine = LLMEngine(model, cfg)
    assert isinstance(engine.model.layers[0].qkv.small, cpu_linear.QuantWeight)
    assert isinstance(engine.model.lm_head.small, cpu_linear.QuantWeight)
    plain = LLMEngine(replace(model, quantized={}), cfg)
    assert isinstance(plain.model.layers[0].qkv.small, torch.Tensor)
    assert_same_generations(engine, plain, tol=1e-4, same_top=True)


def test_the_engine_reads_the_blocks_only_where_the_kernel_dequantizes_in_registers(
        tiny_llama, tmp_path, cache, monkeypatch):
    # without AVX-512 the block kernel sums serially, an order of magnitude slower than the
    # float32 copy: the engine then multiplies by the float32 weights (the same values)
    from baton.kernels import cpu_linear

    if cpu_linear.quant_load() is None:
        pytest.skip("no C compiler")
    hf_dir, hf = tiny_llama
    write_gguf(tmp_path / "m.gguf", hf_dir, hf, Q.Q8_0)
    model = load_model(tmp_path / "m.gguf")
    cfg = EngineConfig(block_size=4, num_kv_blocks=64)
    for fast in (False, True):
        monkeypatch.setattr(cpu_linear, "quant_in_registers", lambda fast=fast: fast)
        small = LLMEngine(model, cfg).model.layers[0].qkv.small
        assert isinstance(small, cpu_linear.QuantWeight if fast else torch.Tensor), fast
    built = cpu_linear.quant_load().quant_in_registers()
    with open("/proc/cpuinfo") as f:
        assert built == int("avx512f" in f.read().split())


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_a_bf16_engine_reads_the_blocks_rounded_to_its_weights(tiny_llama, tmp_path, cache,
                                                               qtype, monkeypatch):
    # with bf16 GEMMs (forced here: torch's bf16 GEMM runs on any CPU), small batches read the
    # blocks with each weight rounded to bf16 as it is read: exactly the engine's bf16 weights,
    # multiplied as its bf16 GEMM does (x rounded to bf16, float32 sums, the result rounded once)
    from dataclasses import replace

    from baton.engine import config as config_mod
    from baton.engine.model import SMALL_M_HALF_BLOCKS, _packing_works
    from baton.kernels import cpu_linear

    if cpu_linear.quant_load() is None or not _packing_works(torch.bfloat16):
        pytest.skip("no C compiler, or no oneDNN bf16 prepacking on this CPU (AVX2 only)")
    monkeypatch.setattr(config_mod, "cpu_has_native_half", lambda: True)
    monkeypatch.setattr(cpu_linear, "quant_in_registers", lambda: True)
    hf_dir, hf = tiny_llama
    write_gguf(tmp_path / "m.gguf", hf_dir, hf, qtype)
    model = load_model(tmp_path / "m.gguf")
    cfg = EngineConfig(dtype="bfloat16", block_size=4, num_kv_blocks=64)
    half = LLMEngine(model, cfg)
    assert half.model.fused_bf16
    for lin in (half.model.lm_head, half.model.layers[0].qkv, half.model.layers[1].down):
        assert isinstance(lin.small, cpu_linear.QuantWeight) and lin.small.round_bf16
        assert lin.packed is not None and lin.small_m == SMALL_M_HALF_BLOCKS
        assert torch.equal(cpu_linear.dequantize(lin.small), lin.w.float())
        x = torch.randn(SMALL_M_HALF_BLOCKS, lin.w.shape[1]).bfloat16()
        gemm = torch.ops.mkldnn._linear_pointwise(x, lin.packed, None, "none", [], "")
        steps = (lin.product(x).view(torch.int16).int() - gemm.view(torch.int16).int()).abs()
        assert int(steps.max()) <= 1  # the sums' order: one rounding boundary at most
    plain = LLMEngine(replace(model, quantized={}), cfg)
    assert plain.model.layers[0].qkv.small is None
    assert_same_generations(half, plain, tol=5e-3, same_top=False)


def test_a_mixtral_gguf_is_served_as_a_mixture_of_experts(tmp_path, cache):
    # llama.cpp writes Mixtral as architecture llama with expert_count and *_exps tensors: read
    # as a mixture of experts (not a dense llama missing its MLP), HF's tokens
    from tests.support.families import SHAPES

    from ..conftest import make_hf_model

    hf = make_hf_model(tmp_path / "hf", "mixtral", **{**SHAPES["mixtral"], "sliding_window": None})
    write_gguf(tmp_path / "m.gguf", tmp_path / "hf", hf)
    model = load_model(tmp_path / "m.gguf")
    cfg = model.config
    assert cfg.arch == "mixtral" and cfg.num_experts == 9 and cfg.experts_per_token == 2
    assert cfg.moe_layers == (0, 1, 2)
    assert_matches_hf(LLMEngine(model, EngineConfig(block_size=4, num_kv_blocks=64)), hf, PROMPT)
