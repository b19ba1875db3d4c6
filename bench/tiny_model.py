"""Tiny random models of every family Baton serves, built with transformers' config classes
(no download): a byte-level BPE tokenizer trained on a small corpus and random weights, saved
as a Hugging Face directory. Benchmarks use them where a real model's compute would drown what
they measure; the tests use them everywhere. Needs ``transformers`` (the ``dev`` extra).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "Baton splits prefill from decode and ships the KV cache between workers.",
    "def add(a, b):\n    return a + b\n",
    "Ünïcödé tëxt, 日本語, emoji 🙂 and symbols: <>{}[]!?",
] * 20


def write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(CORPUS, trainer)
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False,
        "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                         "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
                         "assistant\n{% endif %}"}))


# transformers' (config class, model class) for each family Baton serves
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


# tiny shapes every TP size of 2 splits (and Qwen2's 4): a windowed GQA dense family, one KV
# head replicated over the ranks, two mixtures of experts (tests/unit/test_tensor_parallel.py,
# bench/gpu_tp.py)
TP_SHAPES = {
    "qwen2": dict(hidden_size=96, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=136, vocab_size=397, use_sliding_window=True,
                  sliding_window=11, max_window_layers=1),
    "qwen3": dict(hidden_size=72, num_attention_heads=6, num_key_value_heads=1, head_dim=20,
                  intermediate_size=100, tie_word_embeddings=True),
    "mixtral": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=60, num_local_experts=5, num_experts_per_tok=2),
    "qwen3_moe": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, moe_intermediate_size=36, num_experts=7,
                      num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1),
}


def make_hf_model(path: Path, kind: str = "llama", **overrides):
    """A tiny random model of family ``kind`` (see FAMILIES) saved as a Hugging Face directory;
    returns the HF model."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    write_tokenizer(path)
    common = dict(vocab_size=400, hidden_size=96, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=0, eos_token_id=1, initializer_range=0.2, rms_norm_eps=1e-5)
    if kind in ("mistral", "qwen3", "gemma3_text", "mixtral", "qwen3_moe"):
        common["head_dim"] = common["hidden_size"] // common["num_attention_heads"]
    if kind in ("mistral", "mixtral"):
        common["sliding_window"] = None  # windowed only where a test asks
    common.update(overrides)
    config_cls, model_cls = (getattr(transformers, n) for n in FAMILIES[kind])
    torch.manual_seed(0)
    model = model_cls(config_cls(**common))
    if kind == "gemma3_text":  # its norms start at 0 (a multiplier of 1): make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.3)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    return model
