# SPDX-License-Identifier: Apache-2.0
"""The official DeepSeek V4 checkpoint layout: the name, shape and storage of every tensor of a
config.json (``TensorSpec``), as the official ``DeepSeek-V4-Flash`` / ``-Pro`` checkpoints ship them.

A fact of the model, used where it is served (``engine.serve_checks``: a checkpoint missing a tensor
is refused before start-up) and by the checkpoint generator (``tools/checkpoint*.py``, which also
reads each spec's ``init``: how its random values are drawn).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from vllm_dsv4_hw.kinds import INDEXER_COMPRESSOR, AttentionKind, kind_of
from vllm_dsv4_hw.numerics import FP4_BLOCK, FP8_WEIGHT_BLOCK

# Weight scales (see _init_tensor). The logit std is about HEAD_LOGIT_STD; special tokens' head rows
# are scaled by SPECIAL_HEAD_SCALE so that greedy decoding does not pick BOS / EOS / placeholders.
HEAD_LOGIT_STD = 3.0
SPECIAL_HEAD_SCALE = 0.25
NORM_SPREAD = 0.1
HC_MIX_STD = 0.5
APE_STD = 0.3
SINK_STD = 1.0
GATE_BIAS_STD = 0.1


@dataclass(frozen=True)
class TensorSpec:
    """One logical tensor of the checkpoint.

    kind: ``fp8`` (a linear: ``name.weight`` [+ ``name.scale`` when quantized]), ``fp4`` (a routed
    expert linear, likewise), ``bf16`` / ``f32`` / ``i64`` (stored under ``name`` as is).
    init: how its random values are drawn (see ``_init_tensor``).
    """

    name: str
    shape: tuple[int, ...]
    kind: str
    init: tuple = field(default=("normal", 1.0), compare=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def stored(self, dtype: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """On-disk tensors: name -> (torch dtype, shape) for checkpoint ``dtype``."""
        if self.kind == "fp8":
            if dtype == "bf16":
                return {self.name + ".weight": (torch.bfloat16, self.shape)}
            n, k = self.shape
            return {
                self.name + ".weight": (torch.float8_e4m3fn, self.shape),
                self.name + ".scale": (
                    torch.float8_e8m0fnu,
                    (-(-n // FP8_WEIGHT_BLOCK), -(-k // FP8_WEIGHT_BLOCK)),
                ),
            }
        if self.kind == "fp4":
            if dtype == "bf16":
                return {self.name + ".weight": (torch.bfloat16, self.shape)}
            n, k = self.shape
            return {
                self.name + ".weight": (torch.int8, (n, k // 2)),
                self.name + ".scale": (torch.float8_e8m0fnu, (n, k // FP4_BLOCK)),
            }
        return {
            self.name: (
                {"bf16": torch.bfloat16, "f32": torch.float32, "i64": torch.int64}[self.kind],
                self.shape,
            )
        }


def _linear(name: str, out_features: int, in_features: int, kind: str = "fp8") -> TensorSpec:
    return TensorSpec(name, (out_features, in_features), kind, ("normal", in_features**-0.5))


def _norm(name: str, dim: int) -> TensorSpec:
    return TensorSpec(name + ".weight", (dim,), "bf16", ("around_one", NORM_SPREAD))


def _hyper_connection(prefix: str, cfg: dict) -> list[TensorSpec]:
    hc, d = cfg["hc_mult"], cfg["hidden_size"]
    mix = (2 + hc) * hc
    return [
        TensorSpec(
            prefix + "_fn", (mix, hc * d), "f32", ("normal", HC_MIX_STD / math.sqrt(hc * d))
        ),
        TensorSpec(prefix + "_base", (mix,), "f32", ("normal", 0.5)),
        TensorSpec(prefix + "_scale", (3,), "f32", ("uniform", 0.5, 1.5)),
    ]


def _hc_head(prefix: str, cfg: dict) -> list[TensorSpec]:
    hc, d = cfg["hc_mult"], cfg["hidden_size"]
    return [
        TensorSpec(
            prefix + "hc_head_fn", (hc, hc * d), "f32", ("normal", HC_MIX_STD / math.sqrt(hc * d))
        ),
        TensorSpec(prefix + "hc_head_base", (hc,), "f32", ("normal", 0.5)),
        TensorSpec(prefix + "hc_head_scale", (1,), "f32", ("uniform", 0.5, 1.5)),
    ]


def _compressor(prefix: str, cfg: dict, kind: AttentionKind, head_dim: int) -> list[TensorSpec]:
    d = cfg["hidden_size"]
    width = kind.coff * head_dim
    return [
        _linear(prefix + ".wkv.weight", width, d, "bf16"),
        _linear(prefix + ".wgate.weight", width, d, "bf16"),
        TensorSpec(prefix + ".ape", (kind.ratio, width), "f32", ("normal", APE_STD)),
        _norm(prefix + ".norm", head_dim),
    ]


def _attention(prefix: str, cfg: dict, ratio: int) -> list[TensorSpec]:
    d, h, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    ql, g, ol = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    specs = [
        _linear(prefix + ".wq_a", ql, d),
        _norm(prefix + ".q_norm", ql),
        _linear(prefix + ".wq_b", h * hd, ql),
        _linear(prefix + ".wkv", hd, d),
        _norm(prefix + ".kv_norm", hd),
        _linear(prefix + ".wo_a", g * ol, h * hd // g),
        _linear(prefix + ".wo_b", d, g * ol),
        TensorSpec(prefix + ".attn_sink", (h,), "f32", ("normal", SINK_STD)),
    ]
    kind = kind_of(ratio)
    if kind.compressed:
        specs += _compressor(prefix + ".compressor", cfg, kind, hd)
    if kind.has_indexer:
        ih, ihd = cfg["index_n_heads"], cfg["index_head_dim"]
        specs += [
            _linear(prefix + ".indexer.wq_b", ih * ihd, ql),
            _linear(prefix + ".indexer.weights_proj.weight", ih, d, "bf16"),
        ]
        specs += _compressor(prefix + ".indexer.compressor", cfg, INDEXER_COMPRESSOR, ihd)
    return specs


def _moe(prefix: str, cfg: dict, hash_routed: bool) -> list[TensorSpec]:
    d, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    e, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    specs = [_linear(prefix + ".gate.weight", e, d, "bf16")]
    if hash_routed:
        specs.append(
            TensorSpec(prefix + ".gate.tid2eid", (cfg["vocab_size"], k), "i64", ("tid2eid", e))
        )
    else:
        specs.append(TensorSpec(prefix + ".gate.bias", (e,), "f32", ("normal", GATE_BIAS_STD)))
    for i in range(e):
        ep = f"{prefix}.experts.{i}"
        specs += [
            _linear(ep + ".w1", inter, d, "fp4"),
            _linear(ep + ".w2", d, inter, "fp4"),
            _linear(ep + ".w3", inter, d, "fp4"),
        ]
    shared = inter * cfg["n_shared_experts"]
    sp = prefix + ".shared_experts"
    specs += [
        _linear(sp + ".w1", shared, d),
        _linear(sp + ".w2", d, shared),
        _linear(sp + ".w3", shared, d),
    ]
    return specs


def _block(prefix: str, cfg: dict, ratio: int, hash_routed: bool) -> list[TensorSpec]:
    d = cfg["hidden_size"]
    return (
        _attention(prefix + ".attn", cfg, ratio)
        + [_norm(prefix + ".attn_norm", d)]
        + _moe(prefix + ".ffn", cfg, hash_routed)
        + [_norm(prefix + ".ffn_norm", d)]
        + _hyper_connection(prefix + ".hc_attn", cfg)
        + _hyper_connection(prefix + ".hc_ffn", cfg)
    )


def tensor_specs(cfg: dict, include_mtp: bool = True) -> list[TensorSpec]:
    """The official tensor layout of a DeepSeek V4 config.json dict, in checkpoint order."""
    d, v = cfg["hidden_size"], cfg["vocab_size"]
    n = cfg["num_hidden_layers"]
    ratios = cfg["compress_ratios"]
    n_hash = cfg.get("num_hash_layers", 3)
    specs = [TensorSpec("embed.weight", (v, d), "bf16", ("normal", 1.0))]
    for i in range(n):
        specs += _block(f"layers.{i}", cfg, ratios[i], i < n_hash)
    specs += [
        _norm("norm", d),
        TensorSpec("head.weight", (v, d), "bf16", ("head", HEAD_LOGIT_STD / math.sqrt(d))),
    ]
    specs += _hc_head("", cfg)
    if include_mtp:
        for j in range(cfg.get("num_nextn_predict_layers", 0)):
            p = f"mtp.{j}"
            ratio = ratios[n + j] if n + j < len(ratios) else 0
            specs += [
                _linear(p + ".e_proj", d, d),
                _linear(p + ".h_proj", d, d),
                _norm(p + ".enorm", d),
                _norm(p + ".hnorm", d),
                _norm(p + ".norm", d),
            ]
            specs += _block(p, cfg, ratio, hash_routed=False)
            specs += _hc_head(p + ".", cfg)
    return specs


def stored_layout(
    cfg: dict, dtype: str, include_mtp: bool = True
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor a checkpoint of ``cfg`` in ``dtype`` holds."""
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for spec in tensor_specs(cfg, include_mtp):
        out.update(spec.stored(dtype))
    return out


def attention_specs(prefix: str, cfg: dict, ratio: int) -> list[TensorSpec]:
    """The tensors of one attention layer (``prefix`` = ``layers.N.attn``)."""
    return _attention(prefix, cfg, ratio)


def layer_specs(cfg: dict, layer_id: int) -> list[TensorSpec]:
    """The tensors of ``layers.<layer_id>`` (attention, norms, MoE, mHC) of a config.json dict."""
    return _block(
        f"layers.{layer_id}",
        cfg,
        cfg["compress_ratios"][layer_id],
        layer_id < cfg.get("num_hash_layers", 3),
    )


def hf_dict_of(cfg) -> dict:
    """The config.json fields the tensor layout reads, from a ``DSV4Config`` (e.g. a preset at
    real dimensions, for benchmarks that load random weights through the product's loader)."""
    return {
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_heads,
        "head_dim": cfg.head_dim,
        "q_lora_rank": cfg.q_lora_rank,
        "o_groups": cfg.o_groups,
        "o_lora_rank": cfg.o_lora_rank,
        "index_n_heads": cfg.index_n_heads,
        "index_head_dim": cfg.index_head_dim,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "n_routed_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_shared_experts": cfg.n_shared_experts,
        "hc_mult": cfg.hc_mult,
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_layers,
        "compress_ratios": list(cfg.compress_ratios),
        "num_hash_layers": cfg.num_hash_layers,
    }
