# SPDX-License-Identifier: Apache-2.0
"""The DeepSeek V4 attention configuration, typed, from presets or a checkpoint's config.json.

Reads the official field names (``compress_ratios`` per layer, ``rope_scaling``, ``num_hash_layers``)
and transformers' newer ones (``layer_types``, ``compress_rates``, ``rope_parameters``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from vllm_dsv4_hw.kinds import SUPPORTED_RATIOS
from vllm_dsv4_hw.quant.scheme import DENSE, WeightScheme, WeightSchemeError

_LAYER_TYPE_TO_RATIO_KEY = {
    "sliding_attention": None,
    "compressed_sparse_attention": 4,
    "heavily_compressed_attention": 128,
}


class ConfigError(ValueError):
    """A config.json (or preset override) that this plugin cannot serve."""


@dataclass(frozen=True)
class YarnParams:
    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class DSV4Config:
    name: str
    hidden_size: int
    num_heads: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    index_topk: int
    # One ratio per main layer (the MTP layer is not part of the attention stack's KV).
    compress_ratios: tuple[int, ...]
    head_dim: int = 512
    rope_dim: int = 64
    index_n_heads: int = 64
    index_head_dim: int = 128
    sliding_window: int = 128
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: YarnParams = field(default_factory=YarnParams)
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    vocab_size: int = 129280
    num_mtp_layers: int = 1
    # Fields the full model needs (issue 3); kept here so one object describes the checkpoint.
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    routed_scaling_factor: float = 1.5
    num_hash_layers: int = 3
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # Router: renormalize the selected experts' scores to sum 1 (the official checkpoints: true).
    norm_topk_prob: bool = True
    # Weight formats as shipped (FP8 block linears, FP4 experts, or all dense).
    weights: WeightScheme = DENSE

    def __post_init__(self) -> None:
        bad = sorted({r for r in self.compress_ratios if r not in SUPPORTED_RATIOS})
        if bad:
            raise ConfigError(
                f"compress_ratios contains unsupported value(s) {bad}; DeepSeek V4 layers use "
                f"{SUPPORTED_RATIOS} (0 = window only, 4 = c4a with indexer, 128 = c128a)"
            )
        if self.num_heads % self.o_groups:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not divisible by o_groups={self.o_groups}"
            )
        if self.rope_dim % 2 or self.rope_dim > self.head_dim:
            raise ConfigError(
                f"rope dim {self.rope_dim} must be even and <= head_dim {self.head_dim}"
            )

    # -- derived ------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.compress_ratios)

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    def layers_with_ratio(self, ratio: int) -> int:
        return sum(1 for r in self.compress_ratios if r == ratio)

    def with_layers(self, compress_ratios: tuple[int, ...]) -> "DSV4Config":
        return replace(self, compress_ratios=tuple(compress_ratios))

    # -- loading ------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, cfg: dict, name: str = "config.json") -> "DSV4Config":
        try:
            n_layers = int(cfg["num_hidden_layers"])
            ratios = _ratios_from_dict(cfg, n_layers)
            rope = _yarn_from_dict(cfg)
            head_dim = int(cfg.get("head_dim", 512))
            rope_dim = int(cfg.get("qk_rope_head_dim", 64))
            if "qk_rope_head_dim" not in cfg and cfg.get("partial_rotary_factor"):
                rope_dim = round(head_dim * float(cfg["partial_rotary_factor"]))
            return cls(
                name=name,
                hidden_size=int(cfg["hidden_size"]),
                num_heads=int(cfg["num_attention_heads"]),
                q_lora_rank=int(cfg["q_lora_rank"]),
                o_groups=int(cfg["o_groups"]),
                o_lora_rank=int(cfg["o_lora_rank"]),
                index_topk=int(cfg["index_topk"]),
                compress_ratios=ratios,
                head_dim=head_dim,
                rope_dim=rope_dim,
                index_n_heads=int(cfg.get("index_n_heads", 64)),
                index_head_dim=int(cfg.get("index_head_dim", 128)),
                sliding_window=int(cfg.get("sliding_window", 128)),
                rope_theta=float(cfg.get("rope_theta", 10000.0)),
                compress_rope_theta=float(cfg.get("compress_rope_theta", 160000.0)),
                yarn=rope,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 1048576)),
                vocab_size=int(cfg.get("vocab_size", 129280)),
                num_mtp_layers=int(cfg.get("num_nextn_predict_layers", 1)),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size", 2048)),
                n_routed_experts=int(cfg.get("n_routed_experts", 256)),
                n_shared_experts=int(cfg.get("n_shared_experts", 1)),
                num_experts_per_tok=int(cfg.get("num_experts_per_tok", 6)),
                routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.5)),
                num_hash_layers=_num_hash_layers_from_dict(cfg, n_layers),
                swiglu_limit=float(cfg.get("swiglu_limit", 10.0)),
                hc_mult=int(cfg.get("hc_mult", 4)),
                hc_sinkhorn_iters=int(cfg.get("hc_sinkhorn_iters", 20)),
                hc_eps=float(cfg.get("hc_eps", 1e-6)),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                weights=WeightScheme.from_hf_config(cfg, name),
            )
        except KeyError as exc:
            raise ConfigError(f"{name}: required field {exc.args[0]!r} is missing") from None
        except WeightSchemeError as exc:
            raise ConfigError(str(exc)) from None
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{name}: malformed field value ({exc})") from None

    @classmethod
    def from_json(cls, path: str | Path) -> "DSV4Config":
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            text = p.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read {p}: {exc.strerror or exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{p} is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{p} does not hold a JSON object")
        return cls.from_hf_dict(data, name=str(p))


# Values of the model-level fields the full network (``vllm_dsv4_hw.model``) implements.
_SUPPORTED_CHOICES = {
    "scoring_func": ("sqrtsoftplus",),
    "topk_method": ("noaux_tc",),
    "hidden_act": ("silu",),
}


def validate_hf_config(cfg: dict, name: str = "config.json") -> DSV4Config:
    """Strict checks of a checkpoint's config.json dict for serving the whole network; returns its
    :class:`DSV4Config`. Beyond ``DSV4Config.from_hf_dict``: every ``compress_ratios`` entry must be
    one of (0, 4, 128) (the error names the layer index), the list must hold one entry per layer
    plus one per MTP layer (the official layout) or exactly one per layer, and the MoE / activation
    choices must be the ones the network implements. Raises :class:`ConfigError`."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{name}: expected a JSON object, got {type(cfg).__name__}")
    try:
        n_layers = int(cfg["num_hidden_layers"])
    except KeyError:
        raise ConfigError(f"{name}: required field 'num_hidden_layers' is missing") from None
    except (TypeError, ValueError):
        raise ConfigError(
            f"{name}: num_hidden_layers={cfg['num_hidden_layers']!r} is not an integer"
        ) from None
    n_mtp = cfg.get("num_nextn_predict_layers", 0)
    if not isinstance(n_mtp, int) or isinstance(n_mtp, bool) or n_mtp < 0:
        raise ConfigError(
            f"{name}: num_nextn_predict_layers={n_mtp!r} is not a non-negative integer"
        )
    allowed = ", ".join(str(r) for r in SUPPORTED_RATIOS)
    if "compress_ratios" in cfg:
        ratios = cfg["compress_ratios"]
        if not isinstance(ratios, (list, tuple)):
            raise ConfigError(
                f"{name}: compress_ratios must be a list of integers, got {type(ratios).__name__}"
            )
        for i, r in enumerate(ratios):
            if isinstance(r, bool) or not isinstance(r, int) or r not in SUPPORTED_RATIOS:
                where = f"layer {i}" if i < n_layers else f"MTP layer {i - n_layers}"
                raise ConfigError(
                    f"{name}: compress_ratios[{i}] = {r!r} ({where}) is not "
                    f"supported; allowed values: {allowed}"
                )
        want = {n_layers, n_layers + n_mtp}
        if len(ratios) not in want:
            raise ConfigError(
                f"{name}: compress_ratios has {len(ratios)} entries; expected "
                f"{n_layers + n_mtp} (num_hidden_layers={n_layers} + num_nextn_predict_layers="
                f"{n_mtp})" + (f" or {n_layers}" if n_mtp else "")
            )
    for key, choices in _SUPPORTED_CHOICES.items():
        value = cfg.get(key, choices[0])
        if value not in choices:
            raise ConfigError(
                f"{name}: {key}={value!r} is not supported; allowed: "
                f"{', '.join(map(repr, choices))}"
            )
    out = DSV4Config.from_hf_dict(cfg, name=name)
    checks = (
        (
            out.num_experts_per_tok <= out.n_routed_experts,
            f"num_experts_per_tok={out.num_experts_per_tok} > n_routed_experts={out.n_routed_experts}",
        ),
        (0 <= out.num_hash_layers, f"num_hash_layers={out.num_hash_layers} is negative"),
        (out.n_shared_experts >= 0, f"n_shared_experts={out.n_shared_experts} is negative"),
        (out.hc_mult >= 1, f"hc_mult={out.hc_mult} must be >= 1"),
        (out.hc_sinkhorn_iters >= 1, f"hc_sinkhorn_iters={out.hc_sinkhorn_iters} must be >= 1"),
    )
    for ok, msg in checks:
        if not ok:
            raise ConfigError(f"{name}: {msg}")
    return out


def _ratios_from_dict(cfg: dict, n_layers: int) -> tuple[int, ...]:
    if "compress_ratios" in cfg:
        ratios = [int(r) for r in cfg["compress_ratios"]]
        # The official list has one entry per main layer plus the MTP layer(s).
        if len(ratios) < n_layers:
            raise ConfigError(
                f"compress_ratios has {len(ratios)} entries, fewer than num_hidden_layers={n_layers}"
            )
        return tuple(ratios[:n_layers])
    if cfg.get("layer_types"):
        if len(cfg["layer_types"]) < n_layers:
            raise ConfigError(
                f"layer_types has {len(cfg['layer_types'])} entries, fewer than "
                f"num_hidden_layers={n_layers}"
            )
        rates = {4: 4, 128: 128}
        custom = cfg.get("compress_rates") or {}
        out = []
        for t in cfg["layer_types"]:
            if t not in _LAYER_TYPE_TO_RATIO_KEY:
                raise ConfigError(f"layer_types entry {t!r} is not a DeepSeek V4 layer type")
            key = _LAYER_TYPE_TO_RATIO_KEY[t]
            out.append(0 if key is None else int(custom.get(t, rates[key])))
        return tuple(out[:n_layers])
    raise ConfigError("neither compress_ratios nor layer_types is present")


def _num_hash_layers_from_dict(cfg: dict, n_layers: int) -> int:
    """The official ``num_hash_layers``, else transformers' ``mlp_layer_types`` (its config
    ``to_dict()`` keeps only that: ``hash_moe`` for the first layers, then ``moe``), else 3."""
    if "num_hash_layers" in cfg:
        return int(cfg["num_hash_layers"])
    types = cfg.get("mlp_layer_types")
    if not types:
        return 3
    types = list(types)[:n_layers]
    for i, t in enumerate(types):
        if t not in ("hash_moe", "moe"):
            raise ConfigError(
                f"mlp_layer_types[{i}] = {t!r} is not a DeepSeek V4 MLP type ('hash_moe', 'moe')"
            )
    n = 0
    while n < len(types) and types[n] == "hash_moe":
        n += 1
    if "hash_moe" in types[n:]:
        raise ConfigError(
            f"mlp_layer_types: the hash_moe layers must be the first ones, got {types}"
        )
    return n


def _yarn_from_dict(cfg: dict) -> YarnParams:
    rs = cfg.get("rope_scaling")
    if rs is None and isinstance(cfg.get("rope_parameters"), dict):
        rs = cfg["rope_parameters"].get("compress")
    if not rs:
        return YarnParams()
    return YarnParams(
        factor=float(rs.get("factor", 16.0)),
        original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 65536)),
        beta_fast=float(rs.get("beta_fast", 32.0)),
        beta_slow=float(rs.get("beta_slow", 1.0)),
    )


def _flash_ratios() -> tuple[int, ...]:
    # 43 layers: 0, 0, then 4 on even layers 2..42 and 128 on odd layers 3..41.
    return (0, 0) + tuple(4 if i % 2 == 0 else 128 for i in range(2, 43))


def _pro_ratios() -> tuple[int, ...]:
    # 61 layers: 128, 128, then 4 on even layers 2..60 and 128 on odd layers 3..59.
    return (128, 128) + tuple(4 if i % 2 == 0 else 128 for i in range(2, 61))


V4_FLASH = DSV4Config(
    name="v4-flash",
    hidden_size=4096,
    num_heads=64,
    q_lora_rank=1024,
    o_groups=8,
    o_lora_rank=1024,
    index_topk=512,
    compress_ratios=_flash_ratios(),
    moe_intermediate_size=2048,
    n_routed_experts=256,
    routed_scaling_factor=1.5,
)
V4_PRO = DSV4Config(
    name="v4-pro",
    hidden_size=7168,
    num_heads=128,
    q_lora_rank=1536,
    o_groups=16,
    o_lora_rank=1024,
    index_topk=1024,
    compress_ratios=_pro_ratios(),
    moe_intermediate_size=3072,
    n_routed_experts=384,
    routed_scaling_factor=2.5,
)
PRESETS = {"v4-flash": V4_FLASH, "v4-pro": V4_PRO}


def load_config(model: str) -> DSV4Config:
    """A preset name or a path to a config.json (or a directory holding one)."""
    if model in PRESETS:
        return PRESETS[model]
    p = Path(model)
    if p.suffix == ".json" or p.is_dir() or p.exists():
        return DSV4Config.from_json(p)
    raise ConfigError(
        f"unknown model {model!r}: use one of {', '.join(PRESETS)} or a path to a config.json"
    )
