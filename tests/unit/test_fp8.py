"""FP8 checkpoints made here from a tiny random model, in both layouts Baton reads (block-wise
``quant_method: fp8`` and per-channel / per-tensor ``compressed-tensors``): loaded on CPU they
give exactly the tokens of the same model with the dequantized weights in transformers; any other
quantization is refused by name."""

import json
import shutil

import pytest
import torch
from baton.engine.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.engine.errors import UnsupportedModelError
from baton.engine.loader import check_model, load_model
from baton.engine.params import SamplingParams
from safetensors.torch import save_file

from tests.support.families import PROMPT, SHAPES, hf_greedy

from ..conftest import make_hf_model

FP8_MAX = 448.0
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "w1", "w2", "w3")  # the last three: Mixtral's experts


def quantize(w: torch.Tensor, strategy: str, block=(128, 128)):
    """(float8 weight, scale, dequantized float32) for ``w`` [N, K]."""
    if strategy == "block":
        n, k = w.shape
        bn, bk = block
        grid = (-(-n // bn), -(-k // bk))
        amax = torch.zeros(grid)
        for i in range(grid[0]):
            for j in range(grid[1]):
                amax[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().max()
        scale = amax.clamp_min(1e-12) / FP8_MAX
        full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    elif strategy == "channel":
        scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / FP8_MAX
        full = scale
    else:
        scale = (w.abs().max().clamp_min(1e-12) / FP8_MAX).reshape(1)
        full = scale
    q = (w / full).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full


def make_fp8(tmp_path, kind, strategy):
    """An FP8 checkpoint of a tiny random ``kind`` model (the Hub's layout, one module per
    expert), and transformers' model of the same checkpoint with the dequantized weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    src = tmp_path / "src"
    make_hf_model(src, kind, **SHAPES[kind])
    sd = load_file(src / "model.safetensors")
    quantized, dequantized = dict(sd), dict(sd)
    suffix = "weight_scale_inv" if strategy == "block" else "weight_scale"
    for name, w in sd.items():
        if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
            q, scale, deq = quantize(w, strategy)
            quantized[name], quantized[name[:-len("weight")] + suffix] = q, scale
            dequantized[name] = deq
    paths = {}
    for label, tensors in (("fp8", quantized), ("deq", dequantized)):
        dst = paths[label] = tmp_path / label
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file(tensors, dst / "model.safetensors")
    cfg = json.loads((paths["fp8"] / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(strategy)
    (paths["fp8"] / "config.json").write_text(json.dumps(cfg))
    hf = AutoModelForCausalLM.from_pretrained(paths["deq"], dtype=torch.float32).eval()
    return paths["fp8"], hf


def quantization_config(strategy: str) -> dict:
    if strategy == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128]}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                            "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                      "dynamic": True}}},
            "ignore": ["lm_head"]}


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
