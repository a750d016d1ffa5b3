"""A DeepSeek V4 checkpoint the project makes itself: official layout, tiny sizes, random weights.

``make_checkpoint(out_dir, preset, dtype, seed)`` writes a directory that loads like the official
``DeepSeek-V4-Flash`` / ``-Pro`` checkpoints:

* ``config.json`` with the official field names (``compress_ratios`` with the trailing MTP 0,
  ``num_hash_layers``, ``rope_scaling`` (YaRN), ``index_*``, ``o_groups``, ``hc_*``,
  ``swiglu_limit``, ``scoring_func``, ``topk_method``, ``expert_dtype``, ``quantization_config``...);
* ``model-0000i-of-0000n.safetensors`` shards + ``model.safetensors.index.json`` with the official
  tensor names and dtypes (``embed.weight``, ``layers.N.attn.wq_a.weight`` + ``.scale``,
  ``layers.N.ffn.experts.E.w1.weight`` ..., ``hc_head_fn``, ``mtp.0.*``): with ``dtype="fp8"`` the
  linears are FP8 e4m3 with 128x128 ue8m0 ``.scale`` blocks and the routed experts FP4 e2m1 (two per
  byte, int8) with a ue8m0 scale per 32 along K; with ``dtype="bf16"`` every one of those is a plain
  bf16 ``.weight`` and there is no ``quantization_config``. Tensors that the official checkpoints keep
  unquantized keep their official dtype in both (norms, compressor / indexer-compressor projections,
  ``weights_proj``, router ``gate.weight``: bf16; ``attn_sink``, ``ape``, ``hc_*``, ``gate.bias``:
  fp32; ``tid2eid``: int64);
* a byte-level BPE tokenizer trained offline (``tokenizer_gen``), with a chat template and BOS/EOS;
* ``generation_config.json`` and ``checkpoint_info.json`` (how it was made).

The weights are random but deterministic in ``seed`` (each tensor draws from its own generator keyed
by the seed and its name), scaled so that activations stay O(1) and the logits vary with the context.
Quantized tensors are generated once in fp32 and rounded to their FP8 / FP4 grid; the bf16
checkpoint stores those very values (exactly representable in bf16), so the ``fp8`` and ``bf16``
checkpoints of one seed describe the same network: dequantizing one gives the other bit for bit.

The MTP layer (``mtp.0.*``, one layer with ratio 0) is included, as in the official checkpoints;
transformers ignores it (``_keys_to_ignore_on_load_unexpected``) and vLLM's main model drops it
(its weight mapper maps ``mtp.`` to None).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vllm_dsv4_hw.model import tokenizer_gen
from vllm_dsv4_hw.model.quant_formats import (
    FP4_BLOCK,
    FP8_BLOCK,
    dequantize_fp4_experts,
    dequantize_fp8_block,
    quantize_fp4_experts,
    quantize_fp8_block,
)

logger = logging.getLogger(__name__)

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
    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
}

# Weight scales (see _init_tensor). The logit std is about HEAD_LOGIT_STD; special tokens' head rows
# are scaled by SPECIAL_HEAD_SCALE so that greedy decoding does not pick BOS / EOS / placeholders.
HEAD_LOGIT_STD = 3.0
SPECIAL_HEAD_SCALE = 0.25
NORM_SPREAD = 0.1
HC_MIX_STD = 0.5
APE_STD = 0.3
SINK_STD = 1.0
GATE_BIAS_STD = 0.1


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
        if cfg[key] % FP8_BLOCK:
            raise CheckpointError(
                f"{key}={cfg[key]} must be a multiple of {FP8_BLOCK} (fp8 blocks)")


# -- the official tensor layout ---------------------------------------------------------------------
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
            return {self.name + ".weight": (torch.float8_e4m3fn, self.shape),
                    self.name + ".scale": (torch.float8_e8m0fnu,
                                           (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK)))}
        if self.kind == "fp4":
            if dtype == "bf16":
                return {self.name + ".weight": (torch.bfloat16, self.shape)}
            n, k = self.shape
            return {self.name + ".weight": (torch.int8, (n, k // 2)),
                    self.name + ".scale": (torch.float8_e8m0fnu, (n, k // FP4_BLOCK))}
        return {self.name: ({"bf16": torch.bfloat16, "f32": torch.float32,
                             "i64": torch.int64}[self.kind], self.shape)}


def _linear(name: str, out_features: int, in_features: int, kind: str = "fp8") -> TensorSpec:
    return TensorSpec(name, (out_features, in_features), kind, ("normal", in_features ** -0.5))


def _norm(name: str, dim: int) -> TensorSpec:
    return TensorSpec(name + ".weight", (dim,), "bf16", ("around_one", NORM_SPREAD))


def _hyper_connection(prefix: str, cfg: dict) -> list[TensorSpec]:
    hc, d = cfg["hc_mult"], cfg["hidden_size"]
    mix = (2 + hc) * hc
    return [
        TensorSpec(prefix + "_fn", (mix, hc * d), "f32",
                   ("normal", HC_MIX_STD / math.sqrt(hc * d))),
        TensorSpec(prefix + "_base", (mix,), "f32", ("normal", 0.5)),
        TensorSpec(prefix + "_scale", (3,), "f32", ("uniform", 0.5, 1.5)),
    ]


def _hc_head(prefix: str, cfg: dict) -> list[TensorSpec]:
    hc, d = cfg["hc_mult"], cfg["hidden_size"]
    return [
        TensorSpec(prefix + "hc_head_fn", (hc, hc * d), "f32",
                   ("normal", HC_MIX_STD / math.sqrt(hc * d))),
        TensorSpec(prefix + "hc_head_base", (hc,), "f32", ("normal", 0.5)),
        TensorSpec(prefix + "hc_head_scale", (1,), "f32", ("uniform", 0.5, 1.5)),
    ]


def _compressor(prefix: str, cfg: dict, ratio: int, head_dim: int) -> list[TensorSpec]:
    d = cfg["hidden_size"]
    coff = 2 if ratio == 4 else 1
    return [
        _linear(prefix + ".wkv.weight", coff * head_dim, d, "bf16"),
        _linear(prefix + ".wgate.weight", coff * head_dim, d, "bf16"),
        TensorSpec(prefix + ".ape", (ratio, coff * head_dim), "f32", ("normal", APE_STD)),
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
    if ratio:
        specs += _compressor(prefix + ".compressor", cfg, ratio, hd)
    if ratio == 4:
        ih, ihd = cfg["index_n_heads"], cfg["index_head_dim"]
        specs += [
            _linear(prefix + ".indexer.wq_b", ih * ihd, ql),
            _linear(prefix + ".indexer.weights_proj.weight", ih, d, "bf16"),
        ]
        specs += _compressor(prefix + ".indexer.compressor", cfg, 4, ihd)
    return specs


def _moe(prefix: str, cfg: dict, hash_routed: bool) -> list[TensorSpec]:
    d, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    e, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    specs = [_linear(prefix + ".gate.weight", e, d, "bf16")]
    if hash_routed:
        specs.append(TensorSpec(prefix + ".gate.tid2eid", (cfg["vocab_size"], k), "i64",
                                ("tid2eid", e)))
    else:
        specs.append(TensorSpec(prefix + ".gate.bias", (e,), "f32", ("normal", GATE_BIAS_STD)))
    for i in range(e):
        ep = f"{prefix}.experts.{i}"
        specs += [_linear(ep + ".w1", inter, d, "fp4"), _linear(ep + ".w2", d, inter, "fp4"),
                  _linear(ep + ".w3", inter, d, "fp4")]
    shared = inter * cfg["n_shared_experts"]
    sp = prefix + ".shared_experts"
    specs += [_linear(sp + ".w1", shared, d), _linear(sp + ".w2", d, shared),
              _linear(sp + ".w3", shared, d)]
    return specs


def _block(prefix: str, cfg: dict, ratio: int, hash_routed: bool) -> list[TensorSpec]:
    d = cfg["hidden_size"]
    return (_attention(prefix + ".attn", cfg, ratio) + [_norm(prefix + ".attn_norm", d)]
            + _moe(prefix + ".ffn", cfg, hash_routed) + [_norm(prefix + ".ffn_norm", d)]
            + _hyper_connection(prefix + ".hc_attn", cfg)
            + _hyper_connection(prefix + ".hc_ffn", cfg))


def tensor_specs(cfg: dict, include_mtp: bool = True) -> list[TensorSpec]:
    """The official tensor layout of a DeepSeek V4 config.json dict, in checkpoint order."""
    d, v = cfg["hidden_size"], cfg["vocab_size"]
    n = cfg["num_hidden_layers"]
    ratios = cfg["compress_ratios"]
    n_hash = cfg.get("num_hash_layers", 3)
    specs = [TensorSpec("embed.weight", (v, d), "bf16", ("normal", 1.0))]
    for i in range(n):
        specs += _block(f"layers.{i}", cfg, ratios[i], i < n_hash)
    specs += [_norm("norm", d),
              TensorSpec("head.weight", (v, d), "bf16", ("head", HEAD_LOGIT_STD / math.sqrt(d)))]
    specs += _hc_head("", cfg)
    if include_mtp:
        for j in range(cfg.get("num_nextn_predict_layers", 0)):
            p = f"mtp.{j}"
            ratio = ratios[n + j] if n + j < len(ratios) else 0
            specs += [_linear(p + ".e_proj", d, d), _linear(p + ".h_proj", d, d),
                      _norm(p + ".enorm", d), _norm(p + ".hnorm", d), _norm(p + ".norm", d)]
            specs += _block(p, cfg, ratio, hash_routed=False)
            specs += _hc_head(p + ".", cfg)
    return specs


def stored_layout(cfg: dict, dtype: str,
                  include_mtp: bool = True) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor a checkpoint of ``cfg`` in ``dtype`` holds."""
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for spec in tensor_specs(cfg, include_mtp):
        out.update(spec.stored(dtype))
    return out


# -- weights ----------------------------------------------------------------------------------------
def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(
        (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63))


def _init_tensor(spec: TensorSpec, seed: int, special_ids: list[int]) -> torch.Tensor:
    """The fp32 (or int64) master values of one tensor, deterministic in (seed, name)."""
    g = _generator(seed, spec.name)
    how = spec.init[0]
    if how == "normal":
        return torch.randn(spec.shape, generator=g) * spec.init[1]
    if how == "around_one":
        return (1.0 + torch.randn(spec.shape, generator=g) * spec.init[1]).clamp(0.5, 1.5)
    if how == "uniform":
        lo, hi = spec.init[1], spec.init[2]
        return lo + (hi - lo) * torch.rand(spec.shape, generator=g)
    if how == "head":
        w = torch.randn(spec.shape, generator=g) * spec.init[1]
        ids = [i for i in special_ids if i < spec.shape[0]]
        w[ids] *= SPECIAL_HEAD_SCALE
        return w
    if how == "tid2eid":
        # Each token goes to k distinct experts.
        n_experts = spec.init[1]
        rows, k = spec.shape
        return torch.rand(rows, n_experts, generator=g).argsort(dim=1)[:, :k].to(torch.int64)
    raise AssertionError(f"unknown init {spec.init!r} for {spec.name}")


def master_weights(cfg: dict, seed: int,
                   include_mtp: bool = True) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    """(spec, fp32 master values) for every logical tensor, before any quantization."""
    special = tokenizer_gen.special_token_ids(cfg["vocab_size"])
    for spec in tensor_specs(cfg, include_mtp):
        yield spec, _init_tensor(spec, seed, special)


def encode_tensor(spec: TensorSpec, master: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """The on-disk tensors of one logical tensor in checkpoint ``dtype``."""
    if spec.kind in ("fp8", "fp4"):
        fp8 = spec.kind == "fp8"
        q, s = (quantize_fp8_block if fp8 else quantize_fp4_experts)(master)
        if dtype == "fp8":
            return {spec.name + ".weight": q, spec.name + ".scale": s}
        # bf16 checkpoint: the very values the quantized one encodes (exact in bf16).
        deq = (dequantize_fp8_block if fp8 else dequantize_fp4_experts)(q, s)
        w = deq.to(torch.bfloat16)
        if not torch.equal(w.float(), deq):
            raise AssertionError(f"{spec.name}: dequantized weight is not exact in bf16")
        return {spec.name + ".weight": w}
    if spec.kind == "bf16":
        return {spec.name: master.to(torch.bfloat16)}
    if spec.kind == "f32":
        return {spec.name: master.float().contiguous()}
    return {spec.name: master.to(torch.int64)}


def checkpoint_tensors(cfg: dict, dtype: str, seed: int,
                       include_mtp: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(official name, on-disk tensor) of a checkpoint, in order."""
    for spec, master in master_weights(cfg, seed, include_mtp):
        yield from encode_tensor(spec, master, dtype).items()


# -- writing ----------------------------------------------------------------------------------------
@dataclass
class CheckpointSummary:
    path: Path
    preset: str
    dtype: str
    seed: int
    num_params: int        # logical parameters (elements), including the MTP layer
    num_params_main: int   # without the MTP layer
    num_tensors: int       # on-disk tensors (weights + scales)
    size_bytes: int        # bytes of all files written
    files: list[str]
    seconds: float

    def as_dict(self) -> dict:
        return {"path": str(self.path), "preset": self.preset, "dtype": self.dtype,
                "seed": self.seed, "num_params": self.num_params,
                "num_params_main": self.num_params_main, "num_tensors": self.num_tensors,
                "size_bytes": self.size_bytes, "files": self.files,
                "seconds": round(self.seconds, 3)}


def _check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise CheckpointError(f"seed must be an integer, got {seed!r}")
    if not 0 <= seed < (1 << 63):
        raise CheckpointError(f"seed must be in [0, 2^63), got {seed}")
    return seed


def _prepare_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(f"{out} exists and is not empty (overwrite it with --force)")
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create {parent}: {exc.strerror or exc}") from None
    if not os.access(parent, os.W_OK):
        raise CheckpointError(f"{parent} is not writable")


def make_checkpoint(out_dir: str | os.PathLike, preset: str = "tiny-flash", dtype: str = "fp8",
                    seed: int = 0, *, overwrite: bool = False,
                    shard_bytes: int = DEFAULT_SHARD_BYTES,
                    progress: Callable[[str], None] | None = None) -> CheckpointSummary:
    """Write a checkpoint directory (see the module docstring); returns what was written.

    The directory is built next to ``out_dir`` and renamed into place at the end, so an
    interrupted run never leaves a directory that looks complete.
    """
    t0 = time.monotonic()
    say = progress or logger.info
    cfg = hf_config(preset, dtype)
    seed = _check_seed(seed)
    if shard_bytes <= 0:
        raise CheckpointError(f"shard_bytes must be positive, got {shard_bytes}")
    out = Path(out_dir).expanduser().absolute()
    _prepare_out(out, overwrite)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    # The tensors are small: one thread is fastest, and immune to OpenMP stalls on a busy machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = _write(tmp, cfg, preset, dtype, seed, shard_bytes, say)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(threads)
    summary.path = out
    summary.seconds = time.monotonic() - t0
    say(f"wrote {out} ({summary.size_bytes / 2**20:.1f} MiB, {summary.num_params / 1e6:.2f}M params, "
        f"{summary.seconds:.1f} s)")
    return summary


def _write(tmp: Path, cfg: dict, preset: str, dtype: str, seed: int, shard_bytes: int,
           say: Callable[[str], None]) -> CheckpointSummary:
    from safetensors.torch import save_file

    say(f"{preset} ({dtype}, seed {seed}): {cfg['num_hidden_layers']} layers, ratios "
        f"{cfg['compress_ratios']}, hidden {cfg['hidden_size']}, vocab {cfg['vocab_size']}")
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    say("training the tokenizer")
    files = ["config.json"]
    files += tokenizer_gen.write_tokenizer(tmp, cfg["vocab_size"], cfg["max_position_embeddings"])
    # No sampling defaults: vLLM would apply them to every request that does not set its own.
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]},
        indent=2) + "\n")
    files.append("generation_config.json")

    # Generate and group into shards of about shard_bytes, in checkpoint order.
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    num_params = num_params_main = 0
    last_layer = None
    for spec, master in master_weights(cfg, seed):
        in_layer = spec.name.startswith(("layers.", "mtp."))
        layer = ".".join(spec.name.split(".")[:2]) if in_layer else None
        if layer != last_layer and layer is not None:
            say(f"generating {layer}")
            last_layer = layer
        num_params += spec.numel
        if not spec.name.startswith("mtp."):
            num_params_main += spec.numel
        for name, t in encode_tensor(spec, master, dtype).items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t.contiguous()
            size += nbytes
    n = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        say(f"writing shard {i}/{n} ({len(shard)} tensors)")
        save_file(shard, str(tmp / fname), metadata={"format": "pt"})
        os.chmod(tmp / fname, 0o644)  # safetensors creates it 0600
        files.append(fname)
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    files.append("model.safetensors.index.json")
    from vllm_dsv4_hw import __version__
    info = {"generator": GENERATOR, "generator_version": __version__,
            "format_version": FORMAT_VERSION,
            "preset": preset, "dtype": dtype, "seed": seed, "num_params": num_params,
            "num_params_main": num_params_main, "num_tensors": len(weight_map),
            "mtp_included": True,
            "note": "random weights; the bf16 and fp8 checkpoints of one seed hold the same values"}
    (tmp / "checkpoint_info.json").write_text(json.dumps(info, indent=2) + "\n")
    files.append("checkpoint_info.json")
    size_bytes = sum((tmp / f).stat().st_size for f in files)
    return CheckpointSummary(path=tmp, preset=preset, dtype=dtype, seed=seed, num_params=num_params,
                             num_params_main=num_params_main, num_tensors=len(weight_map),
                             size_bytes=size_bytes, files=files, seconds=0.0)


def read_checkpoint_info(path: str | os.PathLike) -> dict | None:
    """The ``checkpoint_info.json`` of a generated checkpoint, or None (e.g. a real checkpoint)."""
    p = Path(path) / "checkpoint_info.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None
