# SPDX-License-Identifier: Apache-2.0
"""The generated tiny checkpoints: presets and their config.json (official field names). The
tensor layout itself is the model's (``model/layout.py``, re-exported here for the generator)."""

from __future__ import annotations

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


def hf_config(preset: str, dtype: str = "fp8") -> dict:
    """The config.json of a preset (official field names; sorted keys)."""
    if preset not in PRESETS:
        raise CheckpointError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if dtype not in DTYPES:
        raise CheckpointError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
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
        **PRESETS[preset],
    }
    cfg["rope_scaling"] = dict(cfg["rope_scaling"])
    cfg["compress_ratios"] = list(cfg["compress_ratios"])
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
