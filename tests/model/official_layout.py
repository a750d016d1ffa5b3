# SPDX-License-Identifier: Apache-2.0
"""The official DeepSeek V4 checkpoint layout, written out independently of the generator
(``vllm_dsv4_hw.tools.checkpoint_layout``): the config.json fields the official checkpoints carry,
and every tensor's name, safetensors dtype and shape.
"""

from __future__ import annotations

import math

OFFICIAL_FIELDS = (
    "architectures",
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "qk_rope_head_dim",
    "q_lora_rank",
    "o_groups",
    "o_lora_rank",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "sliding_window",
    "compress_ratios",
    "compress_rope_theta",
    "rope_theta",
    "rope_scaling",
    "num_hash_layers",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "routed_scaling_factor",
    "scoring_func",
    "topk_method",
    "norm_topk_prob",
    "swiglu_limit",
    "hc_mult",
    "hc_sinkhorn_iters",
    "hc_eps",
    "hidden_act",
    "rms_norm_eps",
    "vocab_size",
    "max_position_embeddings",
    "num_nextn_predict_layers",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
    "torch_dtype",
)


# The official layout, written out here independently of the generator (DeepSeek-V4-Flash/-Pro
# safetensors: FP8 linears with [N/128, K/128] F8_E8M0 scales; routed experts I8 [N, K/2] with
# [N, K/32] F8_E8M0 scales; unquantized projections, norms and the router weight in BF16; sinks,
# ape, mHC parameters and the router bias in F32; tid2eid I64 on the hash-routed layers).
def official_layout(cfg: dict, quantized: bool) -> dict[str, tuple[str, tuple[int, ...]]]:
    d, v, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    h, ql = cfg["num_attention_heads"], cfg["q_lora_rank"]
    g, ol = cfg["o_groups"], cfg["o_lora_rank"]
    e, k, inter = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    ih, ihd, hc = cfg["index_n_heads"], cfg["index_head_dim"], cfg["hc_mult"]
    n = cfg["num_hidden_layers"]
    out: dict[str, tuple[str, tuple[int, ...]]] = {}

    def lin(name, rows, cols):
        if quantized:
            out[name + ".weight"] = ("F8_E4M3", (rows, cols))
            out[name + ".scale"] = ("F8_E8M0", (math.ceil(rows / 128), math.ceil(cols / 128)))
        else:
            out[name + ".weight"] = ("BF16", (rows, cols))

    def expert(name, rows, cols):
        if quantized:
            out[name + ".weight"] = ("I8", (rows, cols // 2))
            out[name + ".scale"] = ("F8_E8M0", (rows, cols // 32))
        else:
            out[name + ".weight"] = ("BF16", (rows, cols))

    def hyper(prefix):
        out[prefix + "_fn"] = ("F32", ((2 + hc) * hc, hc * d))
        out[prefix + "_base"] = ("F32", ((2 + hc) * hc,))
        out[prefix + "_scale"] = ("F32", (3,))

    def head_mix(prefix):
        out[prefix + "hc_head_fn"] = ("F32", (hc, hc * d))
        out[prefix + "hc_head_base"] = ("F32", (hc,))
        out[prefix + "hc_head_scale"] = ("F32", (1,))

    def compressor(prefix, ratio, dim):
        coff = 2 if ratio == 4 else 1
        out[prefix + ".wkv.weight"] = ("BF16", (coff * dim, d))
        out[prefix + ".wgate.weight"] = ("BF16", (coff * dim, d))
        out[prefix + ".ape"] = ("F32", (ratio, coff * dim))
        out[prefix + ".norm.weight"] = ("BF16", (dim,))

    def block(p, ratio, hashed):
        a = p + ".attn"
        lin(a + ".wq_a", ql, d)
        lin(a + ".wq_b", h * hd, ql)
        lin(a + ".wkv", hd, d)
        lin(a + ".wo_a", g * ol, h * hd // g)
        lin(a + ".wo_b", d, g * ol)
        out[a + ".q_norm.weight"] = ("BF16", (ql,))
        out[a + ".kv_norm.weight"] = ("BF16", (hd,))
        out[a + ".attn_sink"] = ("F32", (h,))
        if ratio:
            compressor(a + ".compressor", ratio, hd)
        if ratio == 4:
            lin(a + ".indexer.wq_b", ih * ihd, ql)
            out[a + ".indexer.weights_proj.weight"] = ("BF16", (ih, d))
            compressor(a + ".indexer.compressor", 4, ihd)
        out[p + ".attn_norm.weight"] = ("BF16", (d,))
        out[p + ".ffn_norm.weight"] = ("BF16", (d,))
        hyper(p + ".hc_attn")
        hyper(p + ".hc_ffn")
        f = p + ".ffn"
        out[f + ".gate.weight"] = ("BF16", (e, d))
        if hashed:
            out[f + ".gate.tid2eid"] = ("I64", (v, k))
        else:
            out[f + ".gate.bias"] = ("F32", (e,))
        for i in range(e):
            expert(f"{f}.experts.{i}.w1", inter, d)
            expert(f"{f}.experts.{i}.w2", d, inter)
            expert(f"{f}.experts.{i}.w3", inter, d)
        lin(f + ".shared_experts.w1", inter, d)
        lin(f + ".shared_experts.w2", d, inter)
        lin(f + ".shared_experts.w3", inter, d)

    out["embed.weight"] = ("BF16", (v, d))
    out["head.weight"] = ("BF16", (v, d))
    out["norm.weight"] = ("BF16", (d,))
    head_mix("")
    for i in range(n):
        block(f"layers.{i}", cfg["compress_ratios"][i], i < cfg["num_hash_layers"])
    block("mtp.0", cfg["compress_ratios"][n], False)
    for name in ("enorm", "hnorm", "norm"):
        out[f"mtp.0.{name}.weight"] = ("BF16", (d,))
    lin("mtp.0.e_proj", d, d)
    lin("mtp.0.h_proj", d, d)
    head_mix("mtp.0.")
    return out
