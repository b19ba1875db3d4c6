"""Hugging Face shards stream into fused weights: the same values as reading each file whole and
concatenating, in the placement asked for, with each file's SHA-256 as the weights id."""

import hashlib

import torch
from baton.engine.loader import Placement, load_model
from safetensors.torch import load_file

from ..conftest import make_hf_model


def test_sharded_checkpoint_streams_into_the_fused_weights(tmp_path):
    hf = make_hf_model(tmp_path, "qwen2", tie_word_embeddings=False)
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    for old in tmp_path.glob("model.safetensors"):
        old.unlink()  # the single-file save from make_hf_model
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) >= 3
    whole = {}
    for f in files:
        whole.update(load_file(f))
    model = load_model(tmp_path)
    w = model.weights
    layer = "model.layers.1."
    qkv = torch.cat([whole[layer + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(w["layers.1.qkv"], qkv)
    assert torch.equal(w["layers.1.qkv_bias"],
                       torch.cat([whole[layer + f"self_attn.{x}_proj.bias"] for x in "qkv"]))
    assert torch.equal(w["layers.1.gate_up"], torch.cat(
        [whole[layer + "mlp.gate_proj.weight"], whole[layer + "mlp.up_proj.weight"]]))
    assert torch.equal(w["lm_head"], whole["lm_head.weight"])
    h = hashlib.sha256()
    for f in files:
        h.update(hashlib.sha256(f.read_bytes()).hexdigest().encode())
    assert model.weights_id == h.hexdigest()
    # straight into another dtype, rounded through a third on the way
    half = load_model(tmp_path, place=Placement(torch.bfloat16))
    assert half.weights["layers.1.qkv"].dtype == torch.bfloat16
    assert torch.equal(half.weights["layers.1.qkv"], qkv.bfloat16())
    rounded = load_model(tmp_path, place=Placement(torch.float32, round_to=torch.bfloat16))
    assert torch.equal(rounded.weights["layers.1.qkv"], qkv.bfloat16().float())
    assert rounded.placement == Placement(torch.float32, "cpu", torch.bfloat16)
