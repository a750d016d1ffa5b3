# SPDX-License-Identifier: Apache-2.0
"""The generated checkpoints: presets and their config.json (official field names). The tensor
layout itself is the model's (``model/layout.py``, re-exported here for the generator).

Two kinds of preset: the tiny ones (``PRESETS``: small hidden size, experts and vocabulary, the real
head geometry; a few layers, seconds to write) and the real-dimension ones (``REAL_PRESETS``:
``v4-flash`` / ``v4-pro``, every dimension from ``config.load_config``, of which a checkpoint holds
the model's first ``layers`` layers in its own order plus the MTP block).
"""

from __future__ import annotations

from vllm_dsv4_hw.config import DSV4Config, load_config
from vllm_dsv4_hw.model.layout import (  # noqa: F401  (the generator's names)
    APE_STD,
    GATE_BIAS_STD,
    HC_MIX_STD,
    HEAD_LOGIT_STD,
    NORM_SPREAD,
    SINK_STD,
    SPECIAL_HEAD_SCALE,
    TensorSpec,
    attention_specs,
    hf_dict_of,
    layer_specs,
    stored_layout,
    tensor_specs,
)
from vllm_dsv4_hw.numerics import FP8_WEIGHT_BLOCK
from vllm_dsv4_hw.tools import tokenizer_gen

DTYPES = ("fp8", "bf16")
DEFAULT_SHARD_BYTES = 8 << 20
REAL_SHARD_BYTES = 4 << 30  # the real-dimension presets' shards (about the official ones' size)
GENERATOR = "vllm-dsv4-hw make-checkpoint"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """Bad arguments or an output directory that cannot be written."""


# -- presets --------------------------------------------------------------------------------------
# Real head geometry (head 512 = 448 + rope 64, indexer 64 heads x 128, window 128); small hidden
# size, heads, experts, vocab and layer count; each preset follows its model's ratio pattern as far
# as a few layers allow (Flash: 0, 0, then 4 / 128 alternating; Pro: 128, 128, then 4 / 128), with
# the trailing 0 of the MTP layer. num_hash_layers is 3 in both real models; 2 here so that each
# preset has hash-routed and top-k-routed layers.
_COMMON = {
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 16,
    "sliding_window": 128,
    "num_key_value_heads": 1,
    "n_shared_experts": 1,
    "num_hash_layers": 2,
    "num_nextn_predict_layers": 1,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "swiglu_limit": 10.0,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "type": "yarn",
    },
    "max_position_embeddings": 1048576,
}

PRESETS: dict[str, dict] = {
    "tiny-flash": {
        **_COMMON,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "q_lora_rank": 128,
        "o_groups": 2,
        "o_lora_rank": 128,
        "num_hidden_layers": 5,
        "compress_ratios": [0, 0, 4, 128, 4, 0],
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 256,
        "routed_scaling_factor": 1.5,
        "vocab_size": 1024,
    },
    "tiny-pro": {
        **_COMMON,
        "hidden_size": 384,
        "num_attention_heads": 8,
        "q_lora_rank": 256,
        "o_groups": 4,
        "o_lora_rank": 128,
        "num_hidden_layers": 4,
        "compress_ratios": [128, 128, 4, 128, 0],
        "n_routed_experts": 12,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 384,
        "routed_scaling_factor": 2.5,
        "vocab_size": 2048,
    },
}

# The official quantization_config (FP8 linears, block 128x128, ue8m0 scales); the FP4 experts are
# declared by the top-level "expert_dtype": "fp4", as in the official config.json.
QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [FP8_WEIGHT_BLOCK, FP8_WEIGHT_BLOCK],
}


# The real models (config.PRESETS): every dimension from ``load_config``; the fields it does not
# hold (router and activation choices, the KV head count) are the ones the tiny presets share.
REAL_PRESETS = ("v4-flash", "v4-pro")
ALL_PRESETS = (*PRESETS, *REAL_PRESETS)


def _integral(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def _real_fields(c: DSV4Config) -> dict:
    """The config.json fields of a real model (all its layers, then the MTP layers' ratio 0)."""
    return {
        **_COMMON,
        "hidden_size": c.hidden_size,
        "num_attention_heads": c.num_heads,
        "head_dim": c.head_dim,
        "qk_rope_head_dim": c.rope_dim,
        "q_lora_rank": c.q_lora_rank,
        "o_groups": c.o_groups,
        "o_lora_rank": c.o_lora_rank,
        "index_n_heads": c.index_n_heads,
        "index_head_dim": c.index_head_dim,
        "index_topk": c.index_topk,
        "sliding_window": c.sliding_window,
        "num_hidden_layers": c.num_layers,
        "compress_ratios": [*c.compress_ratios, *([0] * c.num_mtp_layers)],
        "num_nextn_predict_layers": c.num_mtp_layers,
        "num_hash_layers": c.num_hash_layers,
        "n_routed_experts": c.n_routed_experts,
        "n_shared_experts": c.n_shared_experts,
        "num_experts_per_tok": c.num_experts_per_tok,
        "moe_intermediate_size": c.moe_intermediate_size,
        "routed_scaling_factor": c.routed_scaling_factor,
        "swiglu_limit": c.swiglu_limit,
        "hc_mult": c.hc_mult,
        "hc_sinkhorn_iters": c.hc_sinkhorn_iters,
        "hc_eps": c.hc_eps,
        "norm_topk_prob": c.norm_topk_prob,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": _integral(c.rope_theta),
        "compress_rope_theta": _integral(c.compress_rope_theta),
        "rope_scaling": {
            "beta_fast": _integral(c.yarn.beta_fast),
            "beta_slow": _integral(c.yarn.beta_slow),
            "factor": _integral(c.yarn.factor),
            "original_max_position_embeddings": c.yarn.original_max_position_embeddings,
            "type": "yarn",
        },
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
    }


def preset_fields(preset: str) -> dict:
    """The model fields of a preset at its full layer count (a copy)."""
    if preset in PRESETS:
        fields = dict(PRESETS[preset])
    elif preset in REAL_PRESETS:
        fields = _real_fields(load_config(preset))
    else:
        raise CheckpointError(f"unknown preset {preset!r}; choose one of {', '.join(ALL_PRESETS)}")
    fields["rope_scaling"] = dict(fields["rope_scaling"])
    fields["compress_ratios"] = list(fields["compress_ratios"])
    return fields


def check_layers(preset: str, layers: int | None) -> int:
    """The layer count a checkpoint of ``preset`` gets: ``layers`` (the model's first ones), or
    the tiny preset's own count; a real preset needs one (its full size is hundreds of GB)."""
    full = preset_fields(preset)["num_hidden_layers"]
    if layers is None:
        if preset in REAL_PRESETS:
            raise CheckpointError(
                f"--preset {preset} needs --layers N (1-{full}: the model's first N layers "
                f"and its MTP block; about {_gib_per_layer(preset):.1f} GiB per layer in fp8)"
            )
        return full
    if isinstance(layers, bool) or not isinstance(layers, int):
        raise CheckpointError(f"--layers must be an integer, got {layers!r}")
    if not 1 <= layers <= full:
        raise CheckpointError(f"--layers {layers}: {preset} has {full} layers (choose 1-{full})")
    return layers


def _gib_per_layer(preset: str) -> float:
    f = preset_fields(preset)
    d, inter, e = f["hidden_size"], f["moe_intermediate_size"], f["n_routed_experts"]
    return 3 * e * inter * d * (0.5 + 1 / 32) / 2**30  # the FP4 experts dominate


def hf_config(preset: str, dtype: str = "fp8", layers: int | None = None) -> dict:
    """The config.json of a preset (official field names; sorted keys) with its first ``layers``
    layers (tiny presets: default all; real presets: required) and the MTP layer(s)."""
    fields = preset_fields(preset)
    if dtype not in DTYPES:
        raise CheckpointError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    n = check_layers(preset, layers)
    full = fields["num_hidden_layers"]
    ratios = fields["compress_ratios"]
    fields["num_hidden_layers"] = n
    fields["compress_ratios"] = ratios[:n] + ratios[full:]
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": tokenizer_gen.BOS_ID,
        "eos_token_id": tokenizer_gen.EOS_ID,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        **fields,
    }
    if dtype == "fp8":
        cfg["expert_dtype"] = "fp4"
        cfg["quantization_config"] = dict(QUANTIZATION_CONFIG)
    _check_geometry(cfg)
    return dict(sorted(cfg.items()))


def _check_geometry(cfg: dict) -> None:
    n = cfg["num_hidden_layers"]
    ratios = cfg["compress_ratios"]
    if len(ratios) != n + cfg["num_nextn_predict_layers"]:
        raise CheckpointError(f"compress_ratios needs {n} + MTP entries, got {len(ratios)}")
    if cfg["num_attention_heads"] % cfg["o_groups"]:
        raise CheckpointError("num_attention_heads must be divisible by o_groups")
    for key in ("hidden_size", "q_lora_rank", "moe_intermediate_size", "o_lora_rank"):
        if cfg[key] % FP8_WEIGHT_BLOCK:
            raise CheckpointError(
                f"{key}={cfg[key]} must be a multiple of {FP8_WEIGHT_BLOCK} (fp8 blocks)"
            )


# -- the official tensor layout ---------------------------------------------------------------------
