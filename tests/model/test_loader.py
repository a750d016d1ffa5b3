# SPDX-License-Identifier: Apache-2.0
"""The loader keeps weights as shipped and names the tensor in every error.

* An FP8 checkpoint loads into a network built from its config.json with every weight resident in
  the checkpoint's bytes (e4m3 weights and ue8m0 scales bit-equal, FP4 experts byte-equal), the
  bf16 twin of the same seed into a dense network; both networks give the same logits (the FP8
  path's matmuls apply each block's scale to its partial sum; the twin holds the same values).
* Resident parameter bytes are within 10% of the checkpoint's tensor bytes (the MTP layer
  excluded), and no parameter holds a dequantized copy of a quantized weight.
* ``mtp.*`` is skipped with one log line; errors name the tensor: missing, wrong shape, unexpected,
  a scale without its weight or a weight without its scale, a bad scale, a quantized tensor
  offered to a dense network, ``tid2eid`` range; the config validator names field, layer and the
  allowed values.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import pytest
import torch

from tests.conftest import SESSION_SEED
from vllm_dsv4_hw.attention.layer import DSV4Attention
from vllm_dsv4_hw.config import ConfigError, DSV4Config, validate_hf_config
from vllm_dsv4_hw.model.loader import (
    CheckpointLoadError,
    MissingTensorError,
    QuantFormatError,
    ShapeMismatchError,
    UnexpectedTensorError,
    checkpoint_state,
    load_weights,
    safetensors_weights,
)
from vllm_dsv4_hw.model.network import DSV4Network
from vllm_dsv4_hw.model.resident import resident_summary
from vllm_dsv4_hw.tools import checkpoint as ck

pytestmark = pytest.mark.usefixtures("vllm_single_rank")

CKPT_SEED = (SESSION_SEED * 3) % 100_000
_ROOT: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _module_state(tmp_path_factory):
    _ROOT["dir"] = tmp_path_factory.mktemp("dsv4_loader")
    yield
    _ckpt.cache_clear()
    _tensors.cache_clear()
    _ROOT.clear()


@functools.cache
def _ckpt(preset: str, dtype: str) -> Path:
    path = _ROOT["dir"] / f"{preset}-{dtype}"
    ck.make_checkpoint(path, preset, dtype, CKPT_SEED, progress=lambda _m: None)
    return path


@functools.cache
def _tensors(preset: str, dtype: str) -> tuple[tuple[str, torch.Tensor], ...]:
    return tuple(safetensors_weights(_ckpt(preset, dtype)))


def _config(preset: str, dtype: str) -> dict:
    return json.loads((_ckpt(preset, dtype) / "config.json").read_text())


def _fresh(dtype_ckpt: str = "bf16", dtype: torch.dtype = torch.float32) -> DSV4Network:
    cfg_dict = _config("tiny-flash", dtype_ckpt)
    acfg = DSV4Config.from_hf_dict(cfg_dict)
    return DSV4Network(
        cfg_dict,
        lambda i, r: DSV4Attention(
            acfg, i, ratio=r, dtype=dtype, max_positions=16, prefix=f"layers.{i}.attn"
        ),
        dtype=dtype,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_checkpoint_stays_as_shipped(dtype, caplog):
    fp8 = _tensors("tiny-flash", "fp8")
    net = _fresh("fp8", dtype)
    with caplog.at_level(logging.INFO, logger="vllm_dsv4_hw.model.loader"):
        loaded = load_weights(net, fp8, net.cfg)
    n_mtp = sum(1 for n, _ in fp8 if n.startswith("mtp."))
    mtp_lines = [r for r in caplog.records if "mtp" in r.getMessage()]
    assert len(mtp_lines) == 1 and f"skipped {n_mtp} " in mtp_lines[0].getMessage()
    assert loaded == {k for k in net.state_dict()}
    state = checkpoint_state(net)
    shipped = {n: t for n, t in fp8 if not n.startswith("mtp.")}
    assert set(state) == set(shipped)
    for name, t in shipped.items():
        mine = state[name]
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8):
            # the very bytes of the checkpoint (int8 packed FP4 held as uint8)
            assert torch.equal(mine.view(torch.uint8), t.view(torch.uint8)), name
        else:
            assert torch.equal(mine, t.to(mine.dtype)), name
    kinds = {t.dtype for t in net.parameters()}
    assert {torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.uint8} <= kinds
    ckpt_bytes = sum(t.numel() * t.element_size() for t in shipped.values())
    res = resident_summary(net, ckpt_bytes)
    # bf16 serving keeps every tensor's bytes; fp32 serving widens only the small bf16 tensors
    limit = 1.10 if dtype == torch.bfloat16 else 1.6
    assert 0.99 <= res.ratio <= limit, res.line()
    if dtype == torch.bfloat16:
        assert res.ratio <= 1.10


def test_fp8_and_bf16_twins_give_the_same_network(gen):
    a, b = _fresh("bf16"), _fresh("fp8")
    load_weights(a, _tensors("tiny-flash", "bf16"), a.cfg)
    load_weights(b, _tensors("tiny-flash", "fp8"), b.cfg)
    # Attention needs caches and metadata; the dense parts (MoE, shared experts, mHC, head) are
    # compared through one decoder layer's feed-forward block and the head.
    x = torch.randn(9, a.cfg.hidden_size, generator=gen)
    ids = torch.randint(0, a.cfg.vocab_size, (9,), generator=gen)
    for i in (0, 3):  # a hash-routed and a top-k layer
        fa, fb = a.layers[i].ffn(x, ids), b.layers[i].ffn(x, ids)
        assert float((fa - fb).abs().max()) <= 1e-5 * float(fa.abs().max()), i
    sa, sb = a.layers[2].attn, b.layers[2].attn
    assert sa.merged_qkv and sb.merged_qkv  # wq_a | wkv: one GEMM, from the two tensors
    for name in ("wq_a_wkv", "wo_b"):
        ya, yb = (
            getattr(sa, name)(x if name != "wo_b" else x[:, : sa.wo_b.input_size]),
            getattr(sb, name)(x if name != "wo_b" else x[:, : sb.wo_b.input_size]),
        )
        assert float((ya - yb).abs().max()) <= 1e-5 * float(ya.abs().max()), name


def _without(tensors, name):
    return [(n, t) for n, t in tensors if n != name]


def _replace(tensors, name, new):
    return [(n, new if n == name else t) for n, t in tensors]


def test_loader_errors_name_the_tensor():
    bf16 = _tensors("tiny-flash", "bf16")
    fp8 = _tensors("tiny-flash", "fp8")
    net = _fresh()

    with pytest.raises(
        MissingTensorError,
        match=r"1 tensor\(s\) missing.*layers\.3\.attn\.wkv"
        r"\.weight",
    ):
        load_weights(net, _without(bf16, "layers.3.attn.wkv.weight"))
    with pytest.raises(MissingTensorError, match=r"layers\.2\.ffn\.experts\.5\.w3\.weight"):
        load_weights(net, _without(bf16, "layers.2.ffn.experts.5.w3.weight"))
    with pytest.raises(MissingTensorError, match=r"layers\.3\.attn\.compressor\.wgate\.weight"):
        load_weights(net, _without(bf16, "layers.3.attn.compressor.wgate.weight"))

    bad = torch.zeros(7, 256, dtype=torch.bfloat16)
    with pytest.raises(ShapeMismatchError) as exc:
        load_weights(net, _replace(bf16, "layers.1.attn.wq_a.weight", bad))
    msg = str(exc.value)
    assert "layers.1.attn.wq_a.weight" in msg and "(128, 256)" in msg and "(7, 256)" in msg

    with pytest.raises(UnexpectedTensorError, match=r"layers\.0\.attn\.bogus"):
        load_weights(net, list(bf16) + [("layers.0.attn.bogus", torch.zeros(3))])
    for order in ("after", "before"):
        extra = [("layers.0.attn.q_norm.scale", torch.zeros(3))]
        with pytest.raises(
            UnexpectedTensorError,
            match=r"layers\.0\.attn\.q_norm\.scale: "
            r"unexpected scale",
        ):
            load_weights(net, list(bf16) + extra if order == "after" else extra + list(bf16))
    # quantized tensors never enter a dense network (no dequantized copies at load)
    with pytest.raises(QuantFormatError, match=r"layers\.\d+\..*dense"):
        load_weights(net, fp8)

    net8 = _fresh("fp8")
    with pytest.raises(
        MissingTensorError,
        match=r"without their \.scale.*layers\.4\.attn\.wo_b"
        r"\.weight",
    ):
        load_weights(net8, _without(fp8, "layers.4.attn.wo_b.scale"))
    wrong_scale = torch.zeros(3, 3, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    with pytest.raises(ShapeMismatchError, match=r"layers\.2\.ffn\.experts\.1\.w2\.scale"):
        load_weights(net8, _replace(fp8, "layers.2.ffn.experts.1.w2.scale", wrong_scale))
    with pytest.raises(ShapeMismatchError, match=r"layers\.2\.ffn\.experts\.1\.w2\.weight.*packed"):
        load_weights(
            net8,
            _replace(
                fp8, "layers.2.ffn.experts.1.w2.weight", torch.zeros(256, 256, dtype=torch.int8)
            ),
        )
    nan_scale = dict(fp8)["layers.1.attn.wq_a.scale"].view(torch.uint8).clone()
    nan_scale[0, 0] = 255
    with pytest.raises(
        QuantFormatError,
        match=r"layers\.1\.attn\.wq_a\.scale: ue8m0 scale byte "
        r"255",
    ):
        load_weights(
            net8, _replace(fp8, "layers.1.attn.wq_a.scale", nan_scale.view(torch.float8_e8m0fnu))
        )
    as_bf16 = dict(bf16)["layers.1.attn.wq_a.weight"]
    with pytest.raises(
        QuantFormatError,
        match=r"layers\.1\.attn\.wq_a\.weight: torch\.bfloat16 "
        r"cannot be loaded into an FP8",
    ):
        load_weights(net8, _replace(fp8, "layers.1.attn.wq_a.weight", as_bf16))
    tid = dict(bf16)["layers.0.ffn.gate.tid2eid"].clone()
    tid[5, 0] = 99
    with pytest.raises(QuantFormatError, match=r"layers\.0\.ffn\.gate\.tid2eid.*\[0, 8\)"):
        load_weights(net, _replace(bf16, "layers.0.ffn.gate.tid2eid", tid), net.cfg)
    assert issubclass(CheckpointLoadError, ValueError)
    assert all(
        issubclass(e, CheckpointLoadError)
        for e in (MissingTensorError, ShapeMismatchError, UnexpectedTensorError, QuantFormatError)
    )


def test_config_validator_names_field_layer_and_allowed_values():
    from transformers import DeepseekV4Config

    cfg = ck.hf_config("tiny-flash", "bf16")
    assert validate_hf_config(cfg).compress_ratios == tuple(cfg["compress_ratios"][:5])
    bad = dict(cfg, compress_ratios=[0, 0, 4, 64, 4, 0])
    with pytest.raises(ConfigError) as exc:
        validate_hf_config(bad)
    msg = str(exc.value)
    assert "compress_ratios[3] = 64" in msg and "layer 3" in msg and "0, 4, 128" in msg
    with pytest.raises(ConfigError, match=r"compress_ratios\[5\] = 2 \(MTP layer 0\)"):
        validate_hf_config(dict(cfg, compress_ratios=[0, 0, 4, 128, 4, 2]))
    with pytest.raises(ConfigError, match=r"compress_ratios has 4 entries; expected 6"):
        validate_hf_config(dict(cfg, compress_ratios=[0, 0, 4, 128]))
    with pytest.raises(ConfigError, match=r"compress_ratios has 7 entries"):
        validate_hf_config(dict(cfg, compress_ratios=[0, 0, 4, 128, 4, 0, 0]))
    with pytest.raises(ConfigError, match=r"scoring_func='softmax'"):
        validate_hf_config(dict(cfg, scoring_func="softmax"))
    fp8 = ck.hf_config("tiny-flash", "fp8")
    assert validate_hf_config(fp8).weights.fp8_linears
    with pytest.raises(
        ConfigError, match=r"weight_block_size=\[64, 64\].*\[128, 128\], \[32, 32\]"
    ):
        validate_hf_config(
            dict(
                fp8,
                quantization_config=dict(fp8["quantization_config"], weight_block_size=[64, 64]),
            )
        )
    with pytest.raises(ConfigError, match=r"expert_dtype='fp8'"):
        validate_hf_config(dict(fp8, expert_dtype="fp8"))
    assert validate_hf_config(
        dict(fp8, quantization_config=dict(fp8["quantization_config"], weight_block_size=[32, 32]))
    ).weights.block == (32, 32)
    # transformers' own config dict (no compress_ratios / num_hash_layers: layer_types and
    # mlp_layer_types instead) describes the same network.
    hf_dict = DeepseekV4Config(**cfg, experts_implementation="eager").to_dict()
    assert "num_hash_layers" not in hf_dict and "compress_ratios" not in hf_dict
    ours = validate_hf_config(cfg)
    assert validate_hf_config(hf_dict) == ours and ours.num_hash_layers == 2
    with pytest.raises(ConfigError, match=r"hash_moe layers must be the first"):
        validate_hf_config(
            dict(hf_dict, mlp_layer_types=["hash_moe", "moe", "hash_moe", "moe", "moe"])
        )
    # The network and the loader validate dict configs the same way.
    with pytest.raises(ConfigError, match=r"compress_ratios\[3\] = 64"):
        DSV4Network(bad, lambda i, r: torch.nn.Identity(), dtype=torch.float32)
    with pytest.raises(ConfigError, match=r"compress_ratios\[3\] = 64"):
        load_weights(_fresh(), [], bad)


def test_merged_projections_only_on_fp8_block_boundaries():
    """wq_a | wkv are one layer where each shard starts on a 128-row FP8 block (every shipped
    model); a shard ending inside a block stays its own layer (a checkpoint block never spans
    two); unquantized weights always merge."""
    from vllm_dsv4_hw.quant.config import DSV4HwQuantConfig
    from vllm_dsv4_hw.quant.linear import mergeable
    from vllm_dsv4_hw.quant.scheme import SHIPPED

    fp8 = DSV4HwQuantConfig(SHIPPED)
    assert mergeable(fp8, (1024, 512)) and mergeable(fp8, (1536, 512))
    assert not mergeable(fp8, (1000, 512)) and not mergeable(fp8, (1024, 500))
    assert mergeable(DSV4HwQuantConfig.dense(), (1000, 500))
