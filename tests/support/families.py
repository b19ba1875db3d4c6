"""Model families for tests: one tiny random checkpoint shape per family (transformers' config
classes at irregular shapes), a prompt longer than their windows, and comparisons against
transformers in float32."""

from __future__ import annotations

import contextlib

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


def logprob_gap(engine, hf, prompt, n=8, reference=contextlib.nullcontext):
    """Teacher-forced on the engine's own greedy tokens: the largest difference between the
    engine's top-3 logprobs and HF's at the same positions, HF run inside ``reference()``."""
    c = engine.generate([prompt], SamplingParams(max_tokens=n, logprobs=3, ignore_eos=True))[0]
    with reference():
        ref = hf_logprobs(hf, prompt + c.token_ids)
    return max(abs(float(ref[len(prompt) - 1 + i][tok]) - val)
               for i, lp in enumerate(c.logprobs) for tok, val in lp.top)


def fp8_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` [..., K] rounded as an FP8 matmul quantizes its input: e4m3 per row and group of
    ``group`` columns (0: per row), scale amax / 448, back in x's dtype."""
    k = x.shape[-1]
    span = k if not group or group >= k else group
    rows = x.reshape(-1, k).float()
    cols = torch.arange(k) // span
    amax = torch.zeros(rows.shape[0], int(cols[-1]) + 1).scatter_reduce_(
        1, cols.expand(rows.shape[0], k), rows.abs(), "amax")
    s = (amax.clamp_min(1e-12) / 448.0)[:, cols]
    return ((rows / s).to(torch.float8_e4m3fn).float() * s).reshape(x.shape).to(x.dtype)


@contextlib.contextmanager
def fp8_activations(hf, group: int):
    """transformers' model with every linear input quantized as Baton's FP8 matmuls do (all
    but the head's and the routers', which Baton keeps in the compute dtype): the exact
    reference of an FP8 engine. Patches ``torch.nn.functional.linear`` (nn.Linear and
    transformers' fused experts both call it) while the block runs."""
    import torch.nn.functional as F

    exact = {id(p) for n, p in hf.named_parameters()
             if n.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight"))}
    exact.add(id(hf.get_output_embeddings().weight))  # tied: named as the embedding
    plain = F.linear

    def linear(x, w, bias=None):
        return plain(x if id(w) in exact else fp8_rows(x, group), w, bias)

    configs = {id(m.config): m.config for m in hf.modules() if hasattr(m, "config")}
    saved = {k: getattr(c, "_experts_implementation", None) for k, c in configs.items()}
    for c in configs.values():  # the experts' loop that calls F.linear, not a fused kernel
        c._experts_implementation = "eager"
    F.linear = linear
    try:
        yield hf
    finally:
        F.linear = plain
        for k, c in configs.items():
            c._experts_implementation = saved[k]
