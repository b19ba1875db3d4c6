"""FP8 checkpoints made from tiny random models, for the tests: both layouts Baton reads
(block-wise ``quant_method: fp8``, per-channel / per-tensor ``compressed-tensors``)."""

from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import save_file

from tests.support.families import SHAPES

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


def make_fp8(tmp_path, kind, strategy, block=(128, 128), **overrides):
    """An FP8 checkpoint of a tiny random ``kind`` model (the Hub's layout, one module per
    expert), and transformers' model of the same checkpoint with the dequantized weights."""
    from baton.bench.tiny_model import make_hf_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    src = tmp_path / "src"
    make_hf_model(src, kind, **{**SHAPES[kind], **overrides})
    sd = load_file(src / "model.safetensors")
    quantized, dequantized = dict(sd), dict(sd)
    suffix = "weight_scale_inv" if strategy == "block" else "weight_scale"
    for name, w in sd.items():
        if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
            q, scale, deq = quantize(w, strategy, block)
            quantized[name], quantized[name[:-len("weight")] + suffix] = q, scale
            dequantized[name] = deq
    paths = {}
    for label, tensors in (("fp8", quantized), ("deq", dequantized)):
        dst = paths[label] = tmp_path / label
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file(tensors, dst / "model.safetensors")
    cfg = json.loads((paths["fp8"] / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(strategy, block)
    (paths["fp8"] / "config.json").write_text(json.dumps(cfg))
    hf = AutoModelForCausalLM.from_pretrained(paths["deq"], dtype=torch.float32).eval()
    return paths["fp8"], hf


def quantization_config(strategy: str, block=(128, 128)) -> dict:
    if strategy == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block)}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                            "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                      "dynamic": True}}},
            "ignore": ["lm_head"]}
