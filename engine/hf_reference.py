"""Hugging Face transformers built from the very weights Baton loaded: the reference that tests and
benchmarks compare Baton against.

transformers can read GGUF itself, but keeps quantized layers packed and dequantizes on the fly;
building a dense ``LlamaForCausalLM`` from Baton's dequantized weights makes both sides compute with
identical numbers, so a difference can only come from the computation. Needs ``transformers``
(a test/bench dependency, not a runtime one).
"""

from __future__ import annotations

import torch
from baton.engine.errors import UnsupportedModelError
from baton.engine.loader import LoadedModel


def hf_config(model: LoadedModel):
    from transformers import LlamaConfig

    c = model.config
    if c.arch not in ("llama", "mistral") or c.qkv_bias:
        raise UnsupportedModelError(f"no HF reference builder for arch {c.arch!r}")
    rope = None
    if c.rope_scaling.kind == "linear":
        rope = {"rope_type": "linear", "factor": c.rope_scaling.factor}
    elif c.rope_scaling.kind == "llama3":
        s = c.rope_scaling
        rope = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position}
    return LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_position, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, rope_scaling=rope, tie_word_embeddings=c.tie_embeddings,
        bos_token_id=c.bos_token_id,
        eos_token_id=list(c.eos_token_ids) if c.eos_token_ids else None)


def to_hf(model: LoadedModel, dtype: torch.dtype = torch.float32):
    """A ``LlamaForCausalLM`` (eval mode, ``dtype``) holding ``model``'s weights."""
    from transformers import LlamaForCausalLM

    c = model.config
    if "rope_freqs" in model.weights:
        raise UnsupportedModelError("no HF reference for GGUF rope_freqs tensors")
    w = model.weights
    sd = {"model.embed_tokens.weight": w["embed"], "model.norm.weight": w["norm"]}
    if not c.tie_embeddings:
        sd["lm_head.weight"] = w["lm_head"]
    for i in range(c.num_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = w[p + "qkv"].split([c.q_size, c.kv_size, c.kv_size])
        gate, up = w[p + "gate_up"].chunk(2)
        sd.update({
            h + "input_layernorm.weight": w[p + "attn_norm"],
            h + "self_attn.q_proj.weight": q, h + "self_attn.k_proj.weight": k,
            h + "self_attn.v_proj.weight": v, h + "self_attn.o_proj.weight": w[p + "o"],
            h + "post_attention_layernorm.weight": w[p + "mlp_norm"],
            h + "mlp.gate_proj.weight": gate, h + "mlp.up_proj.weight": up,
            h + "mlp.down_proj.weight": w[p + "down"],
        })
    try:  # skip the random initialisation the weights are about to replace
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers < 5
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        hf = LlamaForCausalLM(hf_config(model))
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if c.tie_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return hf.to(dtype).eval()
