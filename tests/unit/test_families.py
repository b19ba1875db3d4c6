"""Model families: what each config asks for is computed exactly, or refused naming the field.

Configs are transformers' own (its config classes, saved by ``save_pretrained``), at irregular
shapes; the references are transformers' models in float32."""

import json

import pytest
from baton.engine.errors import UnsupportedModelError
from baton.engine.loader import FAMILY_DEFAULTS, _hf_windows, check_model, load_model

from tests.support.families import PROMPT, SHAPES, assert_matches_hf, hf_greedy

from ..conftest import make_hf_model


def saved_config(tmp_path, kind="llama", **overrides) -> dict:
    make_hf_model(tmp_path, kind, **overrides)
    return json.loads((tmp_path / "config.json").read_text())


def refused(tmp_path, field: str, edit) -> str:
    """Edit a saved tiny model's config.json; loading it (and the launcher's check) must refuse
    it with an error naming ``field``."""
    cfg = json.loads((tmp_path / "config.json").read_text())
    edit(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError) as e:
        check_model(tmp_path)
    assert field in str(e.value), str(e.value)
    with pytest.raises(UnsupportedModelError):
        load_model(tmp_path)
    return str(e.value)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_hf_model(path)
    return path


REFUSED = {
    "quantization_config": lambda c: c.update(quantization_config={
        "quant_method": "awq", "bits": 4, "group_size": 128}),
    "rope_parameters.rope_type": lambda c: c.update(rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}),
    "rope_scaling.rope_type": lambda c: c.update(rope_scaling={"rope_type": "dynamic",
                                                               "factor": 2.0}),
    "attn_logit_softcapping": lambda c: c.update(attn_logit_softcapping=50.0),
    "partial_rotary_factor": lambda c: c.update(partial_rotary_factor=0.5),
    "attention_bias": lambda c: c.update(attention_bias=True),
    "mlp_bias": lambda c: c.update(mlp_bias=True),
    "hidden_act": lambda c: c.update(hidden_act="gelu"),
    "use_bidirectional_attention": lambda c: c.update(use_bidirectional_attention=True),
    "model_type": lambda c: c.update(model_type="gemma3"),
}


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_a_config_baton_would_not_compute_exactly_is_refused_by_name(tmp_path, field):
    make_hf_model(tmp_path)
    msg = refused(tmp_path, field, REFUSED[field])
    assert "refuse" in msg or "not served" in msg or "not supported" in msg


def test_layer_types_other_than_full_and_sliding_are_refused(tmp_path):
    make_hf_model(tmp_path, "qwen2")
    refused(tmp_path, "layer_types", lambda c: c.update(
        use_sliding_window=True, sliding_window=8,
        layer_types=["chunked_attention"] * c["num_hidden_layers"]))


def test_an_unknown_family_names_itself_and_the_supported_ones(tmp_path):
    make_hf_model(tmp_path)
    msg = refused(tmp_path, "model_type", lambda c: c.update(model_type="falcon"))
    assert "'falcon'" in msg and "llama" in msg


def test_qwen_windows_follow_use_sliding_window_and_max_window_layers(tmp_path):
    # transformers drops a Qwen window unless use_sliding_window is set, and then windows only
    # the layers from max_window_layers on
    off = saved_config(tmp_path / "off", "qwen2", sliding_window=8, use_sliding_window=False)
    assert _hf_windows(off, "qwen2") == ()
    on = saved_config(tmp_path / "on", "qwen2", sliding_window=8, use_sliding_window=True,
                      max_window_layers=1)
    assert _hf_windows(on, "qwen2") == (0, 8, 8)
    assert on["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]
    del on["layer_types"]  # a hub config without the list: derived the same way
    assert _hf_windows(on, "qwen2") == (0, 8, 8)


def test_family_defaults_are_transformers_defaults():
    # a hub config.json leaves fields out; Baton fills them as transformers' config classes do
    import transformers

    classes = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
               "qwen3": "Qwen3Config", "gemma3_text": "Gemma3TextConfig",
               "mixtral": "MixtralConfig", "qwen3_moe": "Qwen3MoeConfig"}
    for family, defaults in FAMILY_DEFAULTS.items():
        hf = getattr(transformers, classes[family])(num_hidden_layers=2, hidden_size=64,
                                                    num_attention_heads=4)
        for key, value in defaults.items():
            if key == "sliding_window_pattern":
                assert hf._sliding_window_pattern == value
            elif key == "rope_local_base_freq":
                assert hf.rope_parameters["sliding_attention"]["rope_theta"] == value
            else:
                assert getattr(hf, key) == value, (family, key)


@pytest.fixture(scope="module")
def family(request, tmp_path_factory):
    kind = request.param
    path = tmp_path_factory.mktemp(kind)
    hf = make_hf_model(path, kind, **SHAPES[kind])
    return kind, path, hf


@pytest.mark.parametrize("family", sorted(SHAPES), indirect=True)
@pytest.mark.parametrize("backend", ["native", "torch"])
def test_greedy_tokens_equal_transformers(family, backend):
    # float32, prompts longer than the window: the engine's greedy tokens are HF's, its
    # top-3 logprobs HF's at every step; chunked prefills (16-token budget) over cached keys and a
    # prefix-cache hit give the same tokens
    from baton.engine.config import EngineConfig
    from baton.engine.engine import LLMEngine
    from baton.engine.params import SamplingParams

    kind, path, hf = family
    model = load_model(path)
    cfg = model.config
    assert cfg.arch == kind
    if kind in ("mistral", "qwen2", "gemma3_text"):
        assert any(cfg.layer_windows) and max(cfg.layer_windows) < len(PROMPT)
    engine = LLMEngine(model, EngineConfig(block_size=4, num_kv_blocks=200,
                                           attention_backend=backend, max_num_batched_tokens=16))
    want = hf_greedy(hf, PROMPT, 12)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    first = engine.generate([PROMPT], params)[0]
    assert first.token_ids == want
    # the same prompt again: its blocks come from the prefix cache; and one sharing 40 tokens
    again = engine.generate([PROMPT, PROMPT[:40] + [11, 12, 13] * 10], params)
    assert again[0].token_ids == want
    assert again[0].num_cached_tokens > 0
    assert again[1].token_ids == hf_greedy(hf, PROMPT[:40] + [11, 12, 13] * 10, 12)
    assert_matches_hf(engine, hf, PROMPT, n=6)
    engine.check_integrity()


# A chat template with what Qwen3's uses: a namespace, a reversed walk of the messages, string
# tests and methods, tool calls, and ``enable_thinking`` from the caller's template arguments
THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_user=messages|length - 1) %}"
    "{%- for m in messages[::-1] %}{%- if m.role == 'user' and m.content is string"
    " and not m.content.startswith('<tool_response>') %}"
    "{%- set ns.last_user = (messages|length - 1) - loop.index0 %}{%- break %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'assistant' and '</think>' in m.content %}"
    "{{- m.content.split('</think>')[-1].lstrip('\\n') }}{%- else %}{{- m.content }}{%- endif %}"
    "{%- if m.tool_calls %}{%- for c in m.tool_calls %}"
    "{{- '\\n<tool_call>' + (c.function.arguments | tojson) + '</tool_call>' }}"
    "{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


def test_qwen3_style_chat_template_renders_as_transformers_does(tmp_path):
    from baton.engine.tokenizer import BatonTokenizer
    from transformers import PreTrainedTokenizerFast

    make_hf_model(tmp_path, "qwen3", **SHAPES["qwen3"])
    tok = BatonTokenizer.from_hf_dir(tmp_path, (1,))
    tok.chat_template = THINKING_TEMPLATE
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": "<think>\nsum\n</think>\n\ncalling",
         "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "content": "<tool_response>5</tool_response>"},
        {"role": "user", "content": "Thanks!"},
    ]
    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        want = hf.apply_chat_template(messages, chat_template=THINKING_TEMPLATE, tokenize=False,
                                      add_generation_prompt=True, **kwargs)
        assert tok.apply_chat_template(messages, **kwargs) == want, kwargs
    assert tok.apply_chat_template(messages, enable_thinking=False).endswith(
        "<think>\n\n</think>\n\n")
    assert "<think>" not in tok.apply_chat_template(messages, enable_thinking=True)


def test_the_fingerprint_names_what_changes_the_kv_cache():
    # peers exchange raw KV blocks only under one fingerprint: windows per layer, head layout,
    # q/k norms, RoPE bases and the KV dtype each change it
    import dataclasses

    from baton.engine.config import ModelConfig, model_fingerprint

    base = ModelConfig(arch="mistral", vocab_size=400, hidden_size=96, intermediate_size=128,
                       num_layers=3, num_heads=6, num_kv_heads=2, head_dim=16,
                       max_position=512, layer_windows=(19, 19, 19))
    variants = [dataclasses.replace(base, layer_windows=(19, 0, 19)),
                dataclasses.replace(base, layer_windows=()),
                dataclasses.replace(base, num_kv_heads=3),
                dataclasses.replace(base, head_dim=32),
                dataclasses.replace(base, qk_norm=True),
                dataclasses.replace(base, local_rope_theta=10000.0)]
    prints = {model_fingerprint(c, "w", "float32", 16) for c in [base, *variants]}
    prints.add(model_fingerprint(base, "w", "bfloat16", 16))
    assert len(prints) == len(variants) + 2
    assert ModelConfig.from_json(base.to_json()) == base


def test_help_names_every_family_the_loader_takes():
    from baton.engine.families import MODEL_HELP
    from baton.engine.loader import GGUF_ARCHS, HF_ARCHS

    assert all(arch in MODEL_HELP for arch in HF_ARCHS | GGUF_ARCHS)


@pytest.mark.parametrize("kind, expert_key, moe_layers", [
    ("mixtral", "model.layers.0.block_sparse_moe.experts.8.w3.weight", (0, 1, 2)),
    ("qwen3_moe", "model.layers.2.mlp.experts.10.gate_proj.weight", (0, 2)),
])
def test_moe_checkpoints_load_from_the_hub_layout(tmp_path, kind, expert_key, moe_layers):
    # transformers 5 holds experts fused in memory but saves one module per expert, as the Hub
    # has them; Baton stacks them at load. Qwen3-MoE's mlp_only_layers stay dense
    from safetensors import safe_open

    make_hf_model(tmp_path, kind, **SHAPES[kind])
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert expert_key in keys and not any("gate_up_proj" in k for k in keys)
    model = load_model(tmp_path)
    cfg = model.config
    assert cfg.moe_layers == moe_layers and cfg.num_experts in (9, 11)
    assert cfg.experts_per_token == 2 and cfg.norm_topk_prob == (kind == "mixtral")
    e, i = cfg.num_experts, cfg.moe_intermediate_size
    assert model.weights["layers.0.experts_gate_up"].shape == (e * 2 * i, cfg.hidden_size)
    assert model.weights["layers.0.router"].shape == (e, cfg.hidden_size)
    if kind == "qwen3_moe":
        assert "layers.1.gate_up" in model.weights and "layers.1.router" not in model.weights
