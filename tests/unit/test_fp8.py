"""FP8 checkpoints made here from a tiny random model, in both layouts Baton reads (block-wise
``quant_method: fp8`` and per-channel / per-tensor ``compressed-tensors``): loaded on CPU they
give exactly the tokens of the same model with the dequantized weights in transformers; kept FP8
for the Triton engine's FP8 matmuls (interpreted here, on the GPU in the ``gpu`` tests) they stay
within a stated distance of it; any other quantization is refused by name."""

import json
import os

import pytest
import torch

if not torch.cuda.is_available():  # the FP8 matmul kernels, interpreted on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")
from baton.engine.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.engine.errors import UnsupportedModelError
from baton.engine.loader import check_model, load_model
from baton.engine.params import SamplingParams

from tests.support.families import PROMPT, fp8_activations, hf_greedy, logprob_gap
from tests.support.fp8 import make_fp8

from ..conftest import make_hf_model


@pytest.mark.parametrize("kind, strategy", [("qwen3", "block"), ("llama", "channel"),
                                            ("mixtral", "tensor")])
def test_an_fp8_checkpoint_gives_the_dequantized_models_tokens(tmp_path, kind, strategy):
    # block scales over partial 128x128 blocks (the tiny shapes are not multiples of 128)
    path, hf = make_fp8(tmp_path, kind, strategy)
    model = load_model(path)
    q = hf.model.layers[0].self_attn.q_proj.weight  # the dequantized values, exactly
    assert torch.equal(model.weights["layers.0.qkv"][: q.shape[0]], q.detach())
    engine = LLMEngine(model, EngineConfig(block_size=4, num_kv_blocks=200))
    got = engine.generate([PROMPT], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert got.token_ids == hf_greedy(hf, PROMPT, 10)


@pytest.mark.parametrize("qc, field", [
    ({"quant_method": "awq", "bits": 4}, "quant_method"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {}}, "format"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int",
                                          "strategy": "group"}}}}, "config_groups.g.weights"),
])
def test_other_quantizations_are_refused_by_name(tmp_path, qc, field):
    make_hf_model(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = qc
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=f"quantization_config.{field}"):
        check_model(tmp_path)


@pytest.mark.slow  # 3-15 s each under the interpreter; the fast lane has the kernels' tests
@pytest.mark.parametrize("kind, strategy, block", [
    ("qwen3", "block", (32, 32)),     # 32-column groups: 72 = 2 whole groups and a part
    ("llama", "channel", None),
    ("mixtral", "tensor", None),      # FP8 experts in the grouped GEMM, per-tensor scales
    ("qwen3_moe", "block", (32, 32)),  # and column groups, a dense layer among them
])
def test_fp8_matmuls_compute_the_fp8_quantized_model(tmp_path, kind, strategy, block,
                                                     monkeypatch):
    # the Triton engine keeps the checkpoint's weights FP8 (the loader writes them so: their
    # values are the dequantized model's) and every linear layer is an FP8 matmul of its input
    # quantized per token (and column group): each such product during generation is the torch
    # reference's of the same input, and the tokens differ from the dequantized model's only by
    # that rounding
    from baton.engine import fp8
    from baton.engine.model import Fp8Linear
    from baton.kernels import triton_fp8

    path, hf = make_fp8(tmp_path, kind, strategy, block or (128, 128))
    engine = LLMEngine.from_path(str(path), EngineConfig(
        block_size=4, num_kv_blocks=200, attention_backend="triton", max_num_batched_tokens=16))
    group = block[1] if block else 0
    assert engine.fp8_group == group
    hf_layer, layer = hf.model.layers[0], engine.model.layers[0]
    attn = hf_layer.self_attn
    want_qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    assert isinstance(layer.qkv, Fp8Linear) and layer.qkv.w.dtype == torch.float8_e4m3fn
    assert torch.equal(fp8.dequantize_rows(layer.qkv.w, layer.qkv.scale, group), want_qkv)
    if layer.router is not None:
        assert layer.experts_gate_up.dtype == torch.float8_e4m3fn
        gate_up = fp8.dequantize_rows(layer.experts_gate_up, layer.experts_fp8[0], group)
        assert torch.equal(gate_up, hf_layer.mlp.experts.gate_up_proj)
    errors, call = [], Fp8Linear.__call__

    def checked(self, x):
        y = call(self, x)
        want = triton_fp8.reference(x, self.w, self.scale, self.group, self.bias)
        errors.append(float((y - want).abs().max() / want.abs().max()))
        return y

    monkeypatch.setattr(Fp8Linear, "__call__", checked)
    gap = logprob_gap(engine, hf, PROMPT[:30], 6)
    assert errors and max(errors) < 1e-5
    assert gap > 1e-3  # the activations are rounded: not the dequantized model's arithmetic
    engine.check_integrity()
    # the same checkpoint dequantized (CPU engine): another fingerprint, so the two engines
    # never exchange KV
    cpu = LLMEngine(load_model(path), EngineConfig(block_size=4, num_kv_blocks=200))
    assert cpu.fp8_group is None and cpu.fingerprint != engine.fingerprint


@pytest.mark.slow
@pytest.mark.parametrize("kind, strategy, block", [("qwen3", "block", (32, 32)),
                                                   ("llama", "channel", None)])
def test_fp8_engine_gives_transformers_logprobs_with_fp8_activations(tmp_path, kind, strategy,
                                                                     block):
    # end to end: transformers' model on the dequantized weights with every linear input
    # rounded as Baton's FP8 matmuls round it gives the engine's logprobs (an activation on a
    # rounding boundary, which float32 sums decide either way, would show as one position off;
    # these models and prompts have none)
    path, hf = make_fp8(tmp_path, kind, strategy, block or (128, 128))
    engine = LLMEngine.from_path(str(path), EngineConfig(
        block_size=4, num_kv_blocks=200, attention_backend="triton", max_num_batched_tokens=16))
    group = block[1] if block else 0
    assert logprob_gap(engine, hf, PROMPT[:30], 6, lambda: fp8_activations(hf, group)) < 1e-4


@pytest.mark.slow
def test_blocks_narrower_than_the_fp8_kernels_tiles_are_dequantized(tmp_path):
    # 16-column blocks: an FP8 tensor-core dot takes K tiles of 32, so a tile would straddle two
    # scales; the engine dequantizes instead (and says so) and gives transformers' tokens
    path, hf = make_fp8(tmp_path, "qwen3", "block", (16, 16))
    engine = LLMEngine.from_path(str(path), EngineConfig(
        block_size=4, num_kv_blocks=200, attention_backend="triton", max_num_batched_tokens=16))
    assert engine.fp8_group is None and engine.model_info.fp8_group is None
    assert engine.model.layers[0].qkv.w.dtype == torch.float32
    got = engine.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert got.token_ids == hf_greedy(hf, PROMPT, 6)
