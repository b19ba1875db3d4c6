"""Model families: what each config asks for is computed exactly, or refused naming the field.

Configs are transformers' own (its config classes, saved by ``save_pretrained``), at irregular
shapes; the references are transformers' models in float32."""

import json

import pytest
from baton.engine.errors import UnsupportedModelError
from baton.engine.loader import FAMILY_DEFAULTS, _hf_windows, check_model, load_model

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
        "quant_method": "fp8", "weight_block_size": [128, 128]}),
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
               "qwen3": "Qwen3Config", "gemma3_text": "Gemma3TextConfig"}
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
