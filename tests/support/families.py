"""Model families for tests: one tiny random checkpoint shape per family (transformers' config
classes at irregular shapes), a prompt longer than their windows, and comparisons against
transformers in float32."""

from __future__ import annotations

import torch
from baton.engine.params import SamplingParams

# One tiny random checkpoint per family at irregular shapes: odd head counts, GQA ratios that
# are not powers of two, head sizes the native kernels take (16, 64) and do not (24), windows
# shorter than the prompt on some layers
SHAPES = {
    "llama": dict(hidden_size=80, num_attention_heads=5, num_key_value_heads=1),
    "qwen2": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                  use_sliding_window=True, sliding_window=21, max_window_layers=1),
    "qwen3": dict(hidden_size=72, num_attention_heads=9, num_key_value_heads=3, head_dim=24,
                  tie_word_embeddings=True),
    "mistral": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                    sliding_window=19),
    "gemma3_text": dict(hidden_size=96, num_attention_heads=3, num_key_value_heads=1,
                        head_dim=64, sliding_window=17, sliding_window_pattern=2,
                        query_pre_attn_scalar=48, final_logit_softcapping=3.0,
                        rope_theta=40000.0, rope_local_base_freq=5000.0),
    # mixtures of experts: odd expert counts, at least 4x top-k; a window under the prompt
    # (Mixtral), a dense layer among the MoE ones and unnormalised top-k weights (Qwen3-MoE)
    "mixtral": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                    num_local_experts=9, num_experts_per_tok=2, sliding_window=23),
    "qwen3_moe": dict(hidden_size=72, num_attention_heads=9, num_key_value_heads=3, head_dim=24,
                      num_experts=11, num_experts_per_tok=2, moe_intermediate_size=40,
                      mlp_only_layers=[1], norm_topk_prob=False),
}
PROMPT = [(7 * i + 3) % 380 + 10 for i in range(70)]  # several windows, many 4-token blocks
REFERENCE_PROMPT = [5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 311, 12, 13]  # a short one


def hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                          min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logprobs(hf, ids):
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def assert_matches_hf(engine, hf, prompt, n=10):
    """Teacher-forced: every step's top-3 logprobs equal HF's at the same position, and the
    greedy choice is HF's argmax wherever HF's top two are not a near-tie."""
    c = engine.generate([prompt], SamplingParams(max_tokens=n, logprobs=3, ignore_eos=True))[0]
    assert len(c.token_ids) == n
    ref = hf_logprobs(hf, prompt + c.token_ids)
    for i, lp in enumerate(c.logprobs):
        row = ref[len(prompt) - 1 + i]
        top2 = row.topk(2).values
        if top2[0] - top2[1] > 1e-4:
            assert lp.token_id == int(row.argmax()), f"step {i}"
        for tok, val in lp.top:
            assert abs(float(row[tok]) - val) < 1e-4, (i, tok, float(row[tok]), val)
