# SPDX-License-Identifier: Apache-2.0
import json

import pytest

from vllm_dsv4_hw.config import V4_FLASH, V4_PRO, ConfigError, DSV4Config, load_config


def test_presets_match_the_spec_layer_pattern():
    assert V4_FLASH.num_layers == 43
    assert (
        V4_FLASH.layers_with_ratio(0),
        V4_FLASH.layers_with_ratio(4),
        V4_FLASH.layers_with_ratio(128),
    ) == (2, 21, 20)
    assert V4_PRO.num_layers == 61
    assert (
        V4_PRO.layers_with_ratio(0),
        V4_PRO.layers_with_ratio(4),
        V4_PRO.layers_with_ratio(128),
    ) == (0, 30, 31)
    assert V4_FLASH.compress_ratios[2:6] == (4, 128, 4, 128)
    assert V4_PRO.compress_ratios[:3] == (128, 128, 4)


def _official(**over):
    cfg = {
        "num_hidden_layers": 3,
        "hidden_size": 256,
        "num_attention_heads": 8,
        "q_lora_rank": 64,
        "o_groups": 2,
        "o_lora_rank": 32,
        "index_topk": 16,
        "compress_ratios": [0, 4, 128, 0],  # trailing MTP layer
        "qk_rope_head_dim": 64,
        "head_dim": 512,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    }
    cfg.update(over)
    return cfg


def test_official_fields_load_and_drop_the_mtp_ratio(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(_official()))
    cfg = load_config(str(p))
    assert cfg.compress_ratios == (0, 4, 128)
    assert cfg.yarn.factor == 16 and cfg.yarn.original_max_position_embeddings == 65536
    assert load_config(str(tmp_path)).compress_ratios == (0, 4, 128)  # directory works too


def test_transformers_layer_types_load():
    d = _official()
    del d["compress_ratios"]
    d["layer_types"] = [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ]
    assert DSV4Config.from_hf_dict(d).compress_ratios == (0, 4, 128)


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (lambda d: d.update(compress_ratios=[0, 8, 128, 0]), "unsupported value(s) [8]"),
        (lambda d: d.pop("o_groups"), "'o_groups' is missing"),
        (lambda d: d.update(num_attention_heads=7), "not divisible by o_groups"),
        (lambda d: d.update(compress_ratios=[0]), "fewer than num_hidden_layers"),
    ],
)
def test_bad_configs_name_the_field(mutate, needle):
    d = _official()
    mutate(d)
    with pytest.raises(ConfigError) as exc:
        DSV4Config.from_hf_dict(d)
    assert needle in str(exc.value)


def test_unknown_model_and_unreadable_file(tmp_path):
    with pytest.raises(ConfigError, match="unknown model 'v5'"):
        load_config("v5")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(str(bad))
