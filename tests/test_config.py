import json

import pytest

from gpt2_port.config import PRESETS, GPT2Config, from_hf_dict, infer_from_shapes, preset, read_config_json
from gpt2_port.errors import ConfigError


@pytest.mark.parametrize(
    "name,layers,width,heads",
    [("gpt2", 12, 768, 12), ("gpt2-medium", 24, 1024, 16), ("gpt2-large", 36, 1280, 20), ("gpt2-xl", 48, 1600, 25)],
)
def test_presets(name, layers, width, heads):
    c = preset(name)
    assert (c.n_layer, c.n_embd, c.n_head) == (layers, width, heads)
    assert (c.vocab_size, c.n_positions, c.layer_norm_epsilon) == (50257, 1024, 1e-5)


def test_param_counts_match_published_sizes():
    # 124M / 355M / 774M / 1.5B (head tied, counted once)
    counts = {k: c.num_params() for k, c in PRESETS.items()}
    assert counts["gpt2"] == 124_439_808
    assert counts["gpt2-medium"] == 354_823_168
    assert counts["gpt2-large"] == 774_030_080
    assert counts["gpt2-xl"] == 1_557_611_200


def test_preset_exact_name_only():
    with pytest.raises(ConfigError, match="unknown preset 'GPT2'"):
        preset("GPT2")


def test_config_is_frozen():
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["gpt2"].n_layer = 3  # type: ignore[misc]


def test_roundtrip_hf_dict():
    for c in PRESETS.values():
        assert from_hf_dict(c.to_hf_dict()) == c


@pytest.mark.parametrize(
    "key,value",
    [
        ("activation_function", "gelu"),
        ("activation_function", "relu"),
        ("scale_attn_by_inverse_layer_idx", True),
        ("reorder_and_upcast_attn", True),
        ("scale_attn_weights", False),
        ("add_cross_attention", True),
    ],
)
def test_unsupported_settings_are_errors(key, value):
    d = PRESETS["gpt2"].to_hf_dict() | {key: value}
    with pytest.raises(ConfigError, match=key):
        from_hf_dict(d)


def test_bad_values_named(tmp_path):
    d = PRESETS["gpt2"].to_hf_dict() | {"n_head": 7}
    with pytest.raises(ConfigError, match="divisible by n_head"):
        from_hf_dict(d)
    with pytest.raises(ConfigError, match="model_type is 'llama'"):
        from_hf_dict({"model_type": "llama"})
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        read_config_json(p)
    p.write_text(json.dumps(PRESETS["gpt2"].to_hf_dict() | {"n_ctx": 512}))
    with pytest.raises(ConfigError, match="n_ctx=512 contradicts n_positions=1024"):
        read_config_json(p)


def test_infer_from_shapes_both_layouts():
    from gpt2_port.io.adapter import hf_shapes

    for name, c in PRESETS.items():
        shapes = hf_shapes(c)
        assert infer_from_shapes(shapes) == c, name
        assert infer_from_shapes({"transformer." + k: v for k, v in shapes.items()}) == c
    untied = GPT2Config(n_layer=2, n_embd=128, n_head=2, tie_word_embeddings=False)
    assert infer_from_shapes(hf_shapes(untied)).tie_word_embeddings is False
